"""Property tests for the small parsers of the command line: dotted overrides, --set, --tolerance."""

import copy

from hypothesis import given
from hypothesis import strategies as st

from cdbench.cli.support import parse_set_options
from cdbench.reports.gate import parse_tolerances
from cdbench.results.config_files import apply_overrides

keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
paths = st.lists(keys, min_size=1, max_size=4).map(".".join)
scalars = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), keys)


def _get(tree, dotted):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


@given(st.dictionaries(paths, scalars, max_size=5))
def test_every_override_lands_at_its_path_unless_a_later_one_replaced_a_parent(overrides):
    base = {"keep": {"me": 1}}
    original = copy.deepcopy(base)
    try:
        out = apply_overrides(base, overrides)
    except ValueError:
        return  # a path through a value set earlier: reported as ConfigError, checked elsewhere
    assert base == original
    for path, value in overrides.items():
        later = [p for p in overrides if p != path and path.startswith(p + ".")]
        if not later:
            assert _get(out, path) == value


@given(st.dictionaries(paths, st.one_of(st.integers(), st.booleans()), max_size=5))
def test_set_options_parse_yaml_values(values):
    items = [f"{path}={str(v).lower() if isinstance(v, bool) else v}" for path, v in values.items()]
    assert parse_set_options(items) == values


@given(st.dictionaries(keys, st.floats(min_value=0, max_value=1e6, allow_nan=False), max_size=5))
def test_tolerances_round_trip(tolerances):
    assert parse_tolerances([f"{k}={v!r}" for k, v in tolerances.items()]) == tolerances
