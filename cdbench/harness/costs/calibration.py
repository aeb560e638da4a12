"""Forward-step calibrations: measured step times on a GPU, and the fitted forward-model parameters.

``cdbench calibrate`` times the live forward (:mod:`cdbench.harness.live`) over
a grid of step shapes on a GPU and writes the times as a CSV of
:class:`ForwardMeasurement` rows; :mod:`.calibration_fit` fits a
:class:`ForwardCalibration` to them on any machine. Calibrations shipped in
``cdbench/harness/costs/calibrations/`` (``<model>__<gpu>.json``) are what
:class:`~cdbench.harness.costs.forward.ForwardCostModel` uses by default for
that model and GPU, as mask cost tables are picked by GPU name.

>>> shipped_calibration_path("llama-3.1-8b", "h100-sxm").name
'llama-3.1-8b__h100-sxm.json'
"""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdbench.harness.costs.hardware import normalize_name

CALIBRATION_DIR = Path(__file__).parent / "calibrations"


class CalibrationError(ValueError):
    """A calibration or measurement file that cannot be read or does not validate."""


@dataclass(frozen=True)
class ForwardMeasurement:
    """One timed step shape: ``decode_rows`` rows of ``decode_kv`` cached tokens each, and
    ``prefill_chunks`` chunks of ``prefill_new`` tokens after ``prefill_cached`` cached ones each; or, with
    ``mtp_drafts`` > 0 (kind ``draft``), the MTP head's ``mtp_drafts`` passes over ``decode_rows`` drafting
    requests of ``decode_kv`` cached tokens each."""

    model: str
    gpu_device: str          # torch.cuda.get_device_name() (or "cpu")
    torch_version: str
    kind: str                # decode | prefill | mixed | draft
    decode_rows: int
    decode_kv: int
    prefill_chunks: int
    prefill_new: int
    prefill_cached: int
    graph: bool              # timed as CUDA-graph replays
    reps: int
    median_s: float
    p10_s: float
    p90_s: float
    decode_attention: str = "dense"  # dense (masked, over the longest row) or per_row (live mode's kernel)
    tp: int = 1                      # tensor-parallel ranks the step ran on (this row: rank 0's shard)
    idle_s: float = 0.0              # each repetition launched after this long with the GPU idle (0: back to back)
    mtp_drafts: int = 0              # > 0: the MTP head's passes, not a step (kind draft)
    contexts_written: bool = False   # the rows' and chunks' cached contexts written by a prefill before timing

    @property
    def label(self) -> str:
        return shape_label(self.decode_rows, self.decode_kv, self.prefill_chunks, self.prefill_new,
                           self.prefill_cached, self.mtp_drafts)

    @property
    def prefill_tokens(self) -> int:
        return self.prefill_chunks * self.prefill_new

    @property
    def prefill_pairs(self) -> float:
        """Query-key pairs of the prefill chunks (see ``attention_pairs``)."""
        n, c = self.prefill_new, self.prefill_cached
        return self.prefill_chunks * (n * c + n * (n + 1) / 2.0)

    @property
    def decode_kv_tokens(self) -> int:
        """Cached tokens of the decode rows, summed (what the scheduler passes as ``decode_kv_tokens``)."""
        return self.decode_rows * self.decode_kv


def shape_label(decode_rows: int, decode_kv: int, prefill_chunks: int, prefill_new: int, prefill_cached: int,
                drafts: int = 0) -> str:
    """A step shape's name, as a calibration's ``fit`` lists it (``drafts`` > 0: the MTP head's passes).

    >>> shape_label(64, 1024, 1, 256, 0), shape_label(0, 0, 2, 1024, 512), shape_label(16, 4096, 0, 0, 0, 3)
    ('decode 64x1024 + prefill 1x256', 'prefill 2x1024+512', 'draft 16x4096 k3')
    """
    if drafts:
        return f"draft {decode_rows}x{decode_kv} k{drafts}"
    parts = []
    if decode_rows:
        parts.append(f"decode {decode_rows}x{decode_kv}")
    if prefill_chunks:
        chunk = f"prefill {prefill_chunks}x{prefill_new}"
        parts.append(chunk + (f"+{prefill_cached}" if prefill_cached else ""))
    return " + ".join(parts)


_FIELDS = [f.name for f in fields(ForwardMeasurement)]
# absent from files measured before they existed (dense, one GPU, back to back, no draft shapes, contexts unwritten)
_OPTIONAL = {"decode_attention", "tp", "idle_s", "mtp_drafts", "contexts_written"}


def write_measurements(rows: list[ForwardMeasurement], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def read_measurements(path: Path) -> list[ForwardMeasurement]:
    """Rows of a measurement CSV; a bad row raises :class:`CalibrationError` naming its line."""
    casts = {f.name: f.type for f in fields(ForwardMeasurement)}
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            present = set(reader.fieldnames or ())
            missing = set(_FIELDS) - present - _OPTIONAL
            if missing:
                raise CalibrationError(f"{path}: measurement CSV lacks columns {', '.join(sorted(missing))}")
            rows = []
            for line, raw in enumerate(reader, start=2):
                try:
                    rows.append(ForwardMeasurement(**{k: _cast(casts[k], raw[k], k) for k in _FIELDS if k in present}))
                except ValueError as exc:
                    raise CalibrationError(f"{path}:{line}: {exc}") from exc
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read measurements: {exc}") from exc
    if not rows:
        raise CalibrationError(f"{path}: no measurements")
    return rows


def _cast(kind: str, text: str, field: str = "") -> object:
    if kind == "int":
        return int(text)
    if kind == "float" and field == "idle_s":
        value = float(text)
        if not value >= 0:
            raise ValueError(f"idle {text!r} is negative")
        return value
    if kind == "float":
        value = float(text)
        if not value > 0:
            raise ValueError(f"time {text!r} is not positive")
        return value
    if kind == "bool":
        if text not in ("True", "False"):
            raise ValueError(f"{text!r} is not True or False")
        return text == "True"
    return text


class ShapeFit(BaseModel):
    """The fitted model against one measured shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    shape: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction, signed."""
        return self.predicted_s / self.measured_s - 1.0

    @property
    def is_draft(self) -> bool:
        """The MTP head's passes (a draft shape, :func:`shape_label`), not a step."""
        return self.shape.startswith("draft ")


class MtpDraftFit(BaseModel):
    """The MTP head's passes as measured: each pass costs ``pass_s`` plus ``roof_scale`` times its roofline
    price at the step fit's efficiencies (:meth:`~cdbench.harness.costs.forward.ForwardCostModel.mtp_draft_s`),
    least squares on the relative errors of the draft shapes (:func:`~.calibration_fit.fit_draft`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pass_s: float = Field(ge=0, description="fixed cost of one pass of the head (its kernels' launches)")
    roof_scale: float = Field(ge=0, description="multiplies a pass's roofline price")


class ForwardCalibration(BaseModel):
    """Fitted parameters of the forward cost model for one model on one GPU.

    The step time is
    ``step_overhead_s
    + smoothmax(linear FLOPs / (peak·compute_efficiency),
                weight bytes / (peak bandwidth·memory_efficiency)·(1 + multi_token_read if 2+ tokens))
    + prefill pairs' FLOPs / (peak·attention_efficiency)·max(q, chunk_attention_rows) / q
    + max(decode attention FLOPs at that rate, KV bytes / (peak bandwidth·kv_memory_efficiency))
      · smoothmax(rows, attention_rows) / rows
    + n_layers·(tokens·token_layer_s + decode rows·row_layer_s + prefill chunks·chunk_layer_s
                + decode rows beside prefill chunks·mixed_row_layer_s + decode_layer_s if decode rows)``,
    with ``smoothmax(a, b) = (a^p + b^p)^(1/p)``, ``p = linear_sharpness``
    (the linear layers move from the bandwidth roof to the compute roof
    gradually, not at a corner); the decode-attention smooth maximum uses
    ``attention_sharpness``: a batch of fewer than ``attention_rows`` rows
    leaves part of the GPU idle, so its attention takes as long as
    ``attention_rows`` rows of the same context would.

    A step of one token runs the linear layers as matrix-vector kernels, which
    stream the weights at close to the copy rate; a step of two or more runs
    matrix kernels, whose tiles are sized for many tokens and read the same
    weights slower. ``multi_token_read`` is that: the weight read of a step of
    two or more tokens takes ``1 + multi_token_read`` times the one-token
    read. The cost is a share of the weight-read floor, so it scales with the
    bytes a rank reads (half at TP=2; a MoE's grows with the experts its tokens
    touch until all are), and the smooth maximum hides it as a larger step
    turns compute-bound: large at two tokens, gone in a long prefill. It
    replaces ``multi_token_s``, a constant added to every step of two or more
    tokens (fits made before, which keep it and price it so: 0 since): fitted
    to prefill and mixed steps as much as to decode, the constant came out
    several times the measured one-to-two-row step (qwen3-8b on the H200:
    0.52 ms against 0.07-0.11 ms).

    A prefill chunk's attention (flash attention) runs one thread block per
    query tile and head, so a chunk of few tokens runs too few blocks to fill
    the GPU, each streaming the whole cached prefix: its query rows (new tokens
    times the rank's query heads, ``q`` above) below ``chunk_attention_rows``
    take as long as that many rows would over the same keys. Fitted where a
    measured step has a chunk after a cached prefix (0 otherwise); a
    short chunk after a long prefix is where it shows (qwen3-8b on the H200:
    64 new tokens after 2,048 cached took 1.4 ms more than the same chunk
    alone, the pairs' FLOPs at the fitted rate 0.3 ms).

    Each prefill chunk's attention runs its own kernels in every layer:
    ``chunk_layer_s``, fitted where the measurements hold steps of several
    chunks (0 otherwise). Decode rows in a step with prefill chunks cost more
    than in a decode-only step: ``mixed_row_layer_s`` per such row and layer,
    fitted under the same condition (the several-chunk shapes beside 64 decode
    rows are what separate it from the other per-row and per-chunk costs).
    The fixed cost of a step is one constant:
    measurements of one model at its one depth cannot tell a per-layer fixed
    cost from a per-step one, so it is fitted as ``step_overhead_s``.
    A step with decode rows pays ``n_layers·decode_layer_s`` for their
    attention's own kernels (what a prefill step beside a few decode rows
    shows: one decode row beside a prompt chunk adds 1.1-1.3 ms on qwen3-8b,
    reports/calibration/README.md), fitted where the measurements hold both
    prefill-only steps and steps with decode rows (otherwise it is the step
    overhead again).
    A calibration of ``tp`` > 1 is fitted to one rank's sharded steps, their
    all-reduces included; it prices only runs of that many ranks. Its
    ``2·n_layers`` all-reduces a step each cost
    ``max(all_reduce_s, tokens·all_reduce_token_s)`` (latency-bound small
    messages, bandwidth-bound large ones), both fitted for ``tp`` > 1 only;
    ``all_reduce_token_s`` is held at a measured value when
    one is given (``all_reduce_runs``: the per-row slope of live TP runs'
    all-reduce, where it is bandwidth-bound). A fit without ``all_reduce_s`` (None: one GPU, or a
    ``tp`` > 1 fit made before it existed) prices the GPU spec's all-reduces, as
    it was fitted with. A MoE's weight bytes count the routed experts its step
    touches; ``chunk_routing_skew`` (fitted for MoE models only, None otherwise)
    has each prefill chunk's tokens route over ``n_experts / chunk_routing_skew``
    of them while decode rows route uniformly
    (:meth:`~cdbench.harness.costs.forward.ForwardCostModel._experts_touched`).
    The routed experts run as one grouped GEMM a layer, whose kernel runs a
    smaller row tile when a step's mean rows an expert are few
    (:data:`~cdbench.harness.costs.forward.SMALL_TILE_ROWS`, read from torch's
    dispatch); ``expert_small_tile_cost`` (fitted for a MoE whose measured steps
    lie on both sides of that switch, None otherwise) has the experts' FLOPs of
    such a step cost ``1 + expert_small_tile_cost`` times theirs at the large tile.
    ``mtp_draft`` prices the MTP head's drafting passes (:class:`MtpDraftFit`), fitted to the draft shapes
    alone and only where they were measured (a model with an MTP head); the step terms ignore those
    shapes. None: the head's passes are the roofline's at the step fit's efficiencies.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    gpu: str = Field(description="the GPUSpec name the fit is for")
    gpu_device: str = Field(description="the device the measurements ran on (torch.cuda.get_device_name)")
    compute_efficiency: float = Field(gt=0, le=1.5)
    memory_efficiency: float = Field(gt=0, le=1.5)
    attention_efficiency: float = Field(gt=0, le=1.5)
    kv_memory_efficiency: float = Field(gt=0, le=1.5)
    linear_sharpness: float = Field(ge=1)
    step_overhead_s: float = Field(ge=0)
    token_layer_s: float = Field(ge=0, description="per token and layer (norms, rotary, activations, cache writes)")
    row_layer_s: float = Field(ge=0, description="per decode row and layer (per-row attention work)")
    attention_rows: float = Field(ge=0, description="decode rows below which attention leaves the GPU idle")
    attention_sharpness: float = Field(ge=1)
    multi_token_s: float = Field(0.0, ge=0, description="added to a step of two or more tokens: fits made before "
                                 "multi_token_read (0 since)")
    multi_token_read: float = Field(0.0, ge=0, description="a step of two or more tokens reads the weights in "
                                    "1 + this times the one-token read (matrix kernels instead of matrix-vector)")
    chunk_attention_rows: float = Field(0.0, ge=0, description="query rows (a prefill chunk's tokens x the rank's "
                                        "query heads) below which its attention leaves the GPU partly idle")
    chunk_layer_s: float = Field(0.0, ge=0, description="per prefill chunk and layer (its attention's own kernels)")
    mixed_row_layer_s: float = Field(0.0, ge=0, description="per decode row and layer in a step with prefill "
                                     "chunks (beyond row_layer_s)")
    decode_layer_s: float = Field(0.0, ge=0, description="per layer in a step with decode rows (their attention's "
                                  "own kernels)")
    all_reduce_s: float | None = Field(None, ge=0, description="latency of one all-reduce (tp > 1; None: the GPU "
                                       "spec's latency and bandwidth)")
    all_reduce_token_s: float = Field(0.0, ge=0, description="one all-reduce's time per token of the step once "
                                      "past its latency (tp > 1)")
    chunk_routing_skew: float | None = Field(None, ge=1, description="a MoE's prefill chunk routes its tokens over "
                                             "n_experts / chunk_routing_skew experts (1: uniformly over all; None: "
                                             "not fitted, a dense model or a fit made before the term)")
    expert_small_tile_cost: float | None = Field(None, ge=0, description="a MoE step's routed experts' FLOPs "
                                                 "cost 1 + this times more when its grouped GEMM runs the small "
                                                 "tile (mean rows an expert <= SMALL_TILE_ROWS; None: not fitted)")
    mtp_draft: MtpDraftFit | None = Field(None, description="the MTP head's passes, fitted to the draft shapes "
                                          "(None: none measured; priced by the roofline)")
    all_reduce_runs: list[str] = Field(default_factory=list, description="the live tensor-parallel runs whose "
                                       "measured all-reduce gave all_reduce_token_s (empty: fitted)")
    decode_attention: Literal["dense", "per_row"] = Field(
        "dense", description="how the measured decode rows attended: dense (masked, over the longest row) or "
        "per_row (each row its own length, the decode-attention kernel live mode runs)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks of the measured steps (1: one GPU)")
    contexts_written: bool = Field(False, description="the measured decode rows' and chunks' cached contexts were "
                                   "written by a prefill before timing, as a live request's are (a MoE routes rows "
                                   "over written contexts to fewer experts); False: unwritten (zeros)")
    idle_s: float = Field(0.0, ge=0, description="each measured repetition was launched after this long with the "
                          "GPU idle (0: back to back); a probe of this calibration times its shapes the same way")
    measurements: str = Field(description="the measurement CSV, relative to the repository")
    command: str = Field(description="the command that measured them")
    torch_version: str
    fit: list[ShapeFit]

    @property
    def max_abs_error(self) -> float:
        return max(abs(s.error) for s in self.fit)

    @property
    def median_abs_error(self) -> float:
        errors = sorted(abs(s.error) for s in self.fit)
        mid = len(errors) // 2
        return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ForwardCalibration:
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CalibrationError(f"{path}: cannot read forward calibration: {exc}") from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "<root>"
            raise CalibrationError(f"{path}: invalid forward calibration field {field!r}: {first['msg']}") from exc


def shipped_calibration_path(model: str, gpu: str, tp: int = 1) -> Path:
    """Where the shipped calibration of ``model`` on ``gpu`` (spec names) at ``tp`` ranks lives, whether or not
    it exists."""
    ranks = f"__tp{tp}" if tp > 1 else ""
    return CALIBRATION_DIR / f"{normalize_name(model)}__{normalize_name(gpu)}{ranks}.json"
