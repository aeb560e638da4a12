"""Predicted grammar costs of a spec no backend measured, from features of the spec.

``model`` mode prices each spec with its measured compile time and mean mask
fill (:mod:`.spec_profile`). A spec that was never measured (its backend is
not installed here, or the user asks for ``predict``) needs a price too: a
:class:`SpecCostPredictor` holds, per constraint kind, a ridge regression of
log compile seconds and of log mean fill seconds on the spec's
:func:`~cdbench.harness.costs.spec_features.spec_features`, fitted on the
spec-cost store's entries (what model mode measures: ``cdbench measure-specs``), the kind's compile failure rate, and the
regressions' error on corpora held out of the fit, so every prediction comes
with the error it can be expected to have.

The fit is in log space because costs spread over orders of magnitude and
their errors are multiplicative: the prediction is a typical (geometric)
value, not a mean. Ridge, because corpora give tens to hundreds of specs per
kind for 15-30 correlated features; its strength is chosen by
cross-validation that leaves one corpus out at a time (a new corpus is what
a prediction meets, and specs of one corpus resemble each other), and where
no strength beats the kind's median there, the median is the model. A kind
with fewer than ``min_specs`` measured specs is priced at its median too (a
regression on a handful of points would fit noise); the stored model and
its error say which. Features are
clipped to the range seen in the fit: a log-linear model extrapolated past
its data can be off by orders of magnitude, a clipped one by what the
features it cannot see add.

Shipped predictors live in ``cdbench/harness/costs/predictors/``
(``<backend>__<vocab>.json``, made by ``scripts/spec_costs/fit_predictor.py``).

>>> sorted(shipped_predictors())
['llguidance__qwen3.6', 'xgrammar__qwen3.6']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdbench.backends.base import CONSTRAINT_KINDS, ConstraintSpec
from cdbench.harness.costs.grammar_profile import COMPILE_STATUSES
from cdbench.harness.costs.spec_features import FEATURE_NAMES, spec_features

PREDICTOR_DIR = Path(__file__).with_name("predictors")
MIN_FIT_SPECS = 15
"""Measured specs a kind needs for a regression; with fewer, its median stands for every spec of it."""
RIDGE_GRID = np.logspace(-4, 2, 25)
"""Ridge strengths tried, per training spec, on standardised features (cross-validation picks one, or the median)."""
CV_MIN_GROUPS = 3
"""Corpora a kind's training specs need for cross-validation to leave one corpus out at a time."""


class PredictorError(ValueError):
    """A predictor file that cannot be read, or a spec a predictor cannot price; the message names it."""


class UnknownPredictorError(PredictorError):
    """No predictor is shipped for a backend and vocabulary; the message lists those that are."""


@dataclass(frozen=True)
class SpecCostRow:
    """One measured spec: its compile outcome, and its mean fill where an instance was walked.

    ``corpus`` names the group the held-out split goes by (a corpus file's stem, or a finer group such as
    the source a derived corpus took the item from). ``status`` is a compile outcome
    (:data:`~cdbench.harness.costs.grammar_profile.COMPILE_STATUSES`); ``compile_s`` is given exactly when
    it is ``ok``, ``fill_mean_s`` only then (``None``: compiled, not walked).
    """

    spec: ConstraintSpec
    corpus: str
    status: str
    compile_s: float | None = None
    fill_mean_s: float | None = None

    def __post_init__(self) -> None:
        if self.status not in COMPILE_STATUSES:
            raise ValueError(f"{self.corpus}: unknown compile status {self.status!r}; known: "
                             f"{', '.join(COMPILE_STATUSES)}")
        ok = self.status == "ok"
        if ok != (self.compile_s is not None) or (not ok and self.fill_mean_s is not None):
            raise ValueError(f"{self.corpus}: a {self.status} row has a compile time and a mean fill "
                             f"only when its status is ok (got {self.compile_s}, {self.fill_mean_s})")
        for name in ("compile_s", "fill_mean_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{self.corpus}: {name} must be a positive finite time, got {value}")

    @property
    def kind(self) -> str:
        return self.spec.kind


@dataclass(frozen=True)
class PredictedSpecCost:
    """What a spec is predicted to cost on one backend: compile seconds, mean fill seconds per token.

    ``median_error_compile`` / ``median_error_fill``: the median ``|predicted / measured - 1|`` of the
    predictor on held-out corpora for this kind (NaN: no held-out spec of the kind was measured).
    ``failure_rate``: the share of the kind's measured specs that did not compile.
    """

    compile_s: float
    fill_mean_s: float
    kind: str
    median_error_compile: float
    median_error_fill: float
    failure_rate: float


class LogLinearFit(BaseModel):
    """``log(seconds) = intercept + coef · (clip(x, low, high) - center) / scale`` over ``features``.

    ``method`` ``median``: ``intercept`` is the specs' median log seconds and the feature lists are
    empty, because they were too few (``n`` < ``min_specs``: ``cv_error`` is ``None``) or because the
    median priced them better in cross-validation than any ridge fit. ``ridge``: the strength chosen.
    ``cv_error``: the chosen candidate's cross-validated mean ``|log(predicted / measured)|``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: Literal["ridge", "median"]
    n: int = Field(ge=1)
    intercept: float
    ridge: float | None = None
    cv_error: float | None = None
    features: list[str] = []
    center: list[float] = []
    scale: list[float] = []
    low: list[float] = []
    high: list[float] = []
    coef: list[float] = []

    def predict_log(self, x: np.ndarray) -> np.ndarray:
        """Log seconds for each row of ``x`` (features in :attr:`features` order), clipped to the fit's range."""
        if self.method == "median":
            return np.full(len(x), self.intercept)
        z = (np.clip(x, self.low, self.high) - np.asarray(self.center)) / np.asarray(self.scale)
        return self.intercept + z @ np.asarray(self.coef)


class HeldOutError(BaseModel):
    """How a kind's fit did on held-out corpora: the median and 90th percentile of ``|predicted / measured - 1|``
    and the mean ``|log(predicted / measured)|`` over ``n`` held-out specs (``None``: none measured), by the
    ``method`` the held-out fit used (``none``: the kind had no measured training spec). The relative error
    is bounded by 1 below and unbounded above, so the log error says more about the slow specs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: Literal["ridge", "median", "none"]
    n: int = Field(ge=0)
    median: float | None = None
    p90: float | None = None
    mean_abs_log: float | None = None


class KindCostModel(BaseModel):
    """One kind's predictor: its compile and fill fits (``None``: no spec of it measured), its compile
    outcomes over ``specs`` measured specs and failure rate, and the held-out errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    specs: int = Field(ge=1)
    statuses: dict[str, int]
    failure_rate: float = Field(ge=0, le=1)
    compile: LogLinearFit | None
    fill: LogLinearFit | None
    held_out_compile: HeldOutError
    held_out_fill: HeldOutError


class SpecCostPredictor(BaseModel):
    """Per-kind cost predictors of one backend and vocabulary (see the module docstring).

    ``corpora``: the groups the models were fitted on; the held-out errors come from a fit without
    ``held_out_corpora``, evaluated on them, before the stored models were refitted on every group.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: str
    vocab: str
    source: str = ""
    min_specs: int = Field(ge=1)
    corpora: list[str]
    held_out_corpora: list[str]
    kinds: dict[str, KindCostModel]

    @classmethod
    def fit(
        cls,
        rows: Sequence[SpecCostRow],
        backend: str,
        vocab: str,
        held_out_corpora: Iterable[str],
        *,
        source: str = "",
        min_specs: int = MIN_FIT_SPECS,
    ) -> SpecCostPredictor:
        """Fit on ``rows`` without ``held_out_corpora`` and measure the error there; then refit on all rows.

        Raises ``ValueError`` when ``rows`` is empty, a held-out corpus has no row, or every row is held out.
        """
        if not rows:
            raise ValueError("no measured specs to fit")
        held_out = sorted(set(held_out_corpora))
        corpora = sorted({r.corpus for r in rows})
        missing = [c for c in held_out if c not in corpora]
        if missing:
            raise ValueError(f"held-out corpora without rows: {', '.join(missing)}; corpora: {', '.join(corpora)}")
        train, test = split_by_corpus(rows, held_out)
        if held_out and not train:
            raise ValueError("every row is in a held-out corpus: nothing left to fit on")
        features = {id(r): _feature_vector(r.spec) for r in rows}
        kinds = {}
        for kind in CONSTRAINT_KINDS:
            all_rows = [r for r in rows if r.kind == kind]
            if not all_rows:
                continue
            errors = {}
            for target in ("compile_s", "fill_mean_s"):
                kind_train = [r for r in train if r.kind == kind and getattr(r, target) is not None]
                kind_test = [r for r in test if r.kind == kind and getattr(r, target) is not None]
                errors[target] = _held_out_error(kind_train, kind_test, target, features, min_specs)
            statuses = {s: sum(r.status == s for r in all_rows) for s in COMPILE_STATUSES}
            kinds[kind] = KindCostModel(
                kind=kind,
                specs=len(all_rows),
                statuses={s: c for s, c in statuses.items() if c},
                failure_rate=1.0 - statuses["ok"] / len(all_rows),
                compile=_fit_target(all_rows, "compile_s", features, min_specs),
                fill=_fit_target(all_rows, "fill_mean_s", features, min_specs),
                held_out_compile=errors["compile_s"],
                held_out_fill=errors["fill_mean_s"],
            )
        return cls(backend=backend, vocab=vocab, source=source, min_specs=min_specs, corpora=corpora,
                   held_out_corpora=held_out, kinds=kinds)

    def predict(self, spec: ConstraintSpec) -> PredictedSpecCost:
        """The predicted costs of ``spec``; :class:`PredictorError` for a kind the predictor has no
        compiled spec of (raises :class:`~cdbench.harness.costs.spec_features.SpecFeatureError` for a
        spec of the wrong type)."""
        model = self.kinds.get(spec.kind)
        if model is None or model.compile is None or model.fill is None:
            known = [k for k, m in self.kinds.items() if m.compile is not None and m.fill is not None]
            raise PredictorError(f"the {self.backend} / {self.vocab} spec-cost predictor has no measured "
                                 f"{spec.kind} spec to predict from; it predicts: {', '.join(known) or 'nothing'}")
        features = spec_features(spec)
        costs = []
        for fit in (model.compile, model.fill):
            unknown = [f for f in fit.features if f not in features]
            if unknown:
                raise PredictorError(f"the {self.backend} / {self.vocab} predictor uses {spec.kind} features "
                                     f"{', '.join(unknown)} that spec_features no longer computes: refit it")
            x = np.array([[features[f] for f in fit.features]])
            costs.append(float(np.exp(fit.predict_log(x)[0])))
        return PredictedSpecCost(
            compile_s=costs[0],
            fill_mean_s=costs[1],
            kind=spec.kind,
            median_error_compile=_or_nan(model.held_out_compile.median),
            median_error_fill=_or_nan(model.held_out_fill.median),
            failure_rate=model.failure_rate,
        )

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> SpecCostPredictor:
        """Read a predictor file; :class:`PredictorError` names the file and what is wrong with it."""
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise PredictorError(f"{path}: cannot read spec-cost predictor: {exc}") from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise PredictorError(f"{path}: invalid spec-cost predictor at {where!r}: {first['msg']}") from exc

    @classmethod
    def builtin(cls, backend: str, vocab: str) -> SpecCostPredictor:
        """The shipped predictor of ``backend`` with ``vocab``; :class:`UnknownPredictorError` if none is."""
        path = PREDICTOR_DIR / f"{backend}__{vocab}.json"
        if not path.is_file():
            shipped = ", ".join(sorted(shipped_predictors())) or "none"
            raise UnknownPredictorError(f"no spec-cost predictor shipped for backend {backend!r} with vocabulary "
                                        f"{vocab!r}; shipped (backend__vocab): {shipped}")
        return cls.load(path)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def shipped_predictors() -> dict[str, Path]:
    """``backend__vocab`` → file of every shipped predictor."""
    return {p.stem: p for p in sorted(PREDICTOR_DIR.glob("*__*.json"))}


def split_by_corpus(rows: Sequence[SpecCostRow], held_out: Iterable[str]) -> tuple[list[SpecCostRow],
                                                                                   list[SpecCostRow]]:
    """``(training rows, held-out rows)``: a row is held out when its corpus is in ``held_out``."""
    held = set(held_out)
    return [r for r in rows if r.corpus not in held], [r for r in rows if r.corpus in held]


def _feature_vector(spec: ConstraintSpec) -> np.ndarray:
    features = spec_features(spec)
    return np.array([features[name] for name in FEATURE_NAMES[spec.kind]])


def _fit_target(rows: Sequence[SpecCostRow], target: str, features: dict[int, np.ndarray],
                min_specs: int) -> LogLinearFit | None:
    """The fit of log ``target`` over the rows that have it (``None``: none has): the median with fewer
    than ``min_specs`` rows, else the candidate (a ridge strength, or the median) that cross-validation
    across the rows' corpora prices best."""
    measured = [r for r in rows if getattr(r, target) is not None]
    if not measured:
        return None
    y = np.log([getattr(r, target) for r in measured])
    median = LogLinearFit(method="median", n=len(y), intercept=float(np.median(y)))
    if len(measured) < min_specs:
        return median
    x = np.stack([features[id(r)] for r in measured])
    scores = _cv_errors(x, y, _folds([r.corpus for r in measured]))
    best = int(np.flatnonzero(scores == scores.min())[-1])  # on a tie, the stronger shrinkage
    if best == len(RIDGE_GRID):
        return median.model_copy(update={"cv_error": float(scores[best])})
    center, scale = _standardiser(x)
    lam = float(RIDGE_GRID[best] * len(y))
    coef = _ridge_path((x - center) / scale, y - y.mean(), [lam])[0]
    return LogLinearFit(
        method="ridge", n=len(y), intercept=float(y.mean()), ridge=lam, cv_error=float(scores[best]),
        features=list(FEATURE_NAMES[measured[0].kind]), center=center.tolist(), scale=scale.tolist(),
        low=x.min(axis=0).tolist(), high=x.max(axis=0).tolist(), coef=coef.tolist(),
    )


def _standardiser(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    center, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0  # a constant feature: its standardised column is 0, so ridge gives it no weight
    return center, scale


def _ridge_path(z: np.ndarray, y: np.ndarray, lambdas: Sequence[float]) -> np.ndarray:
    """Ridge coefficients of centred ``y`` on standardised ``z`` for each strength (one SVD serves all)."""
    u, s, vt = np.linalg.svd(z, full_matrices=False)
    uty = u.T @ y
    return np.stack([vt.T @ (s / (s**2 + lam) * uty) for lam in lambdas])


def _folds(groups: Sequence[str]) -> np.ndarray:
    """A fold number per row: its corpus where there are :data:`CV_MIN_GROUPS` or more (a new corpus is
    what a prediction meets), else one of 5 folds at random (seeded)."""
    names = sorted(set(groups))
    if len(names) >= CV_MIN_GROUPS:
        return np.array([names.index(g) for g in groups])
    return np.random.default_rng(0).permutation(len(groups)) % 5


def _cv_errors(x: np.ndarray, y: np.ndarray, folds: np.ndarray) -> np.ndarray:
    """The mean ``|log(predicted / measured)|`` over every row predicted from the folds without it, for each
    strength of :data:`RIDGE_GRID` and, last, for the median of the other folds.

    The mean of log errors rather than the median relative error reported: a median ignores the slowest
    half of the specs, and those (a schema that takes seconds where most take milliseconds) are the ones a
    simulation must not price as typical; in log space, one of them does not outweigh all the others."""
    log_errors = np.empty((len(RIDGE_GRID) + 1, len(y)))
    for fold in np.unique(folds):
        test, train = folds == fold, folds != fold
        center, scale = _standardiser(x[train])
        n = int(train.sum())
        coefs = _ridge_path((x[train] - center) / scale, y[train] - y[train].mean(), RIDGE_GRID * n)
        log_errors[:-1, test] = y[train].mean() + coefs @ ((x[test] - center) / scale).T - y[test]
        log_errors[-1, test] = np.median(y[train]) - y[test]
    return np.mean(np.abs(log_errors), axis=1)


def _held_out_error(train: Sequence[SpecCostRow], test: Sequence[SpecCostRow], target: str,
                    features: dict[int, np.ndarray], min_specs: int) -> HeldOutError:
    fit = _fit_target(train, target, features, min_specs)
    if fit is None:
        return HeldOutError(method="none", n=len(test))
    if not test:
        return HeldOutError(method=fit.method, n=0)
    log_ratio = fit.predict_log(np.stack([features[id(r)] for r in test])) - np.log([getattr(r, target) for r in test])
    error = np.abs(np.expm1(log_ratio))
    return HeldOutError(method=fit.method, n=len(test), median=float(np.median(error)),
                        p90=float(np.quantile(error, 0.9)), mean_abs_log=float(np.mean(np.abs(log_ratio))))
