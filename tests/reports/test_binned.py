import numpy as np
import pytest

from cdbench.reports.binned import FINE_BINS, MERGE, Binned


def _chunks(values, weights=None, size=997):
    def read():
        for start in range(0, len(values), size):
            yield values[start:start + size], None if weights is None else weights[start:start + size]
    return read


@pytest.mark.parametrize("log", [True, False])
def test_quantiles_within_a_fine_bin_of_the_exact_ones(log):
    values = np.random.default_rng(1).lognormal(0, 2 if log else 0.1, 50_000)
    hist = Binned.of(_chunks(values), log=log, spread=1.01)
    assert hist.log is log and hist.n == len(values) and hist.counts.sum() == len(values)
    for q in (0.01, 0.5, 0.9, 0.99):
        exact = np.quantile(values, q)
        step = hist.relative_width * (exact if log else hist.edges[-1])
        assert abs(hist.quantile(q) - exact) <= step


def test_weights_count_and_cdf_ends_at_one():
    values = np.array([1.0, 2.0, np.nan, 3.0, 4.0])
    weights = np.array([1.0, 1.0, 5.0, 1.0, 7.0])
    hist = Binned.of(_chunks(values, weights, size=2), log=False)
    assert hist.n == 4 and hist.counts.sum() == 10.0  # the NaN and its weight left out
    assert hist.quantile(0.5) > 3.0  # most of the weight is at 4
    x, share = hist.cdf()
    assert share[0] == 0.0 and share[-1] == 1.0 and np.all(np.diff(share) >= 0)
    edges, bars = hist.bars()
    assert len(bars) == FINE_BINS // MERGE and bars.sum() == 10.0 and len(edges) == len(bars) + 1


def test_equal_values_one_bar_and_nothing_none():
    hist = Binned.of(_chunks(np.full(10, 2.5)), log=None)
    assert hist.point and hist.quantile(0.99) == 2.5 and hist.bars()[1].tolist() == [10.0]
    assert Binned.of(_chunks(np.array([np.nan])), log=None) is None
