"""Roofline cost of one forward step of a continuously batched engine.

A step runs the linear layers over every token in the batch (prefill chunks and
one token per decoding row), attention for the prefill chunks (compute-bound,
growing with the context each new token attends to) and for the decode rows
(memory-bound, reading each row's KV cache), plus, with tensor parallelism, two
all-reduces per layer. Each part costs the larger of its FLOPs at the GPU's
achievable compute rate and its bytes at the achievable memory bandwidth (a
roofline per part, as in Vidur's per-operator view but from first principles
rather than profiled tables). A mixture of experts reads only the experts its
tokens touch: with ``N`` tokens each routed to ``k`` of ``E`` experts, the
expected number of distinct experts is ``E·(1 − (1 − k/E)^N)`` under uniform
routing. ``moe_imbalance = ρ ≥ 1`` models a skewed router as uniform routing
over the ``E/ρ`` experts that take the traffic, ``(E/ρ)·(1 − (1 − kρ/E)^N)``
(one token still reads ``k``; large batches read ``E/ρ``). The default is 1:
the models are trained toward uniform routing by an auxiliary load-balancing
loss (``router_aux_loss_coef`` in the Qwen3 MoE configs), uniform is the upper
bound on the bytes read, and the live forward's random router routes near
uniformly, so a calibration on it measures ρ = 1; a skew measured on real
traffic (e.g. SGLang's expert-distribution recorder) goes in here. A MoE's
calibration may route each prefill chunk's tokens over fewer experts than its
decode rows (``chunk_routing_skew``, :meth:`ForwardCostModel._experts_touched`).
Its routed experts run as one grouped GEMM a layer (live mode: torch's
``grouped_mm``), whose kernel takes a smaller row tile when a step's mean rows an
expert, ``tokens·k/E``, are at most ``SMALL_TILE_ROWS``; a calibration may price
the experts' FLOPs of such a step ``1 + expert_small_tile_cost`` times
(:attr:`PeakTimes.small_tile_flops_s`).

A hybrid model's linear-attention (Gated DeltaNet) layers keep a fixed state per
request instead of a KV cache: a decode row reads and writes its request's state
(``2·state`` bytes) and spends ``7·d_k·d_v`` FLOPs per value head on the
recurrence (``Sᵀk``, the rank-one update, the decay, ``Sᵀq``: the
``fused_recurrent_gated_delta_rule`` of flash-linear-attention); a prefill chunk
runs the chunked form (chunks of ``C = 64`` tokens, fla's
``chunk_gated_delta_rule``): per token and value head ``6·d_k·d_v`` FLOPs for
the three state products (``w·S``, ``q·S``, ``kᵀ·u``) and ``2·C·(d_k + d_v)``
within its chunk, and reads and writes the state once per chunk. Full-attention
layers are priced as before, over their own count.

:meth:`ForwardCostModel.mtp_draft_s` prices multi-token-prediction drafting: each
drafted token per row is one pass of the MTP layer and the LM head over the rows, at
the roofline, or as a calibration that measured the head's passes fitted them.

A fixed per-step overhead is added to the sum, and the whole is multiplied by
the host's forward speed (:mod:`.forward_speed`: 1 by default; decode-only
steps and steps with prefill chunks may have a speed each). A forward
calibration (:mod:`.calibration`, fitted by
``cdbench calibrate`` to live forward steps timed on a GPU) replaces the
efficiencies and adds per-token and per-row costs; the one shipped for
the model and GPU is used by default, and :attr:`ForwardCostModel.calibration_source`
says which (``none``: the uncalibrated roofline).

Examples
--------
>>> fwd = ForwardCostModel("llama-3.1-8b", "h100-sxm", forward_calibration="none")
>>> round(fwd.step_s(decode_rows=1, decode_kv_tokens=1000) * 1e3, 1)   # ms, batch 1
6.2
>>> fwd.step_s(prefill_tokens=512, prefill_context_tokens=attention_pairs(512, 0)) > 0.01
True
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cdbench.harness.costs.calibration import (
    CalibrationError,
    ForwardCalibration,
    shipped_calibration_path,
)
from cdbench.harness.costs.forward_speed import PROBE_PREFIX, RUN_SPEED_SIGMA, ForwardSpeed
from cdbench.harness.costs.hardware import (
    GPUSpec,
    ModelSpec,
    intermediate_size,
    resolve_gpu,
    resolve_model,
)

ACTIVATION_BYTES = 2  # all-reduced hidden states are bf16
LINEAR_CHUNK = 64  # flash-linear-attention's chunk size for chunk_gated_delta_rule
RECURRENT_FLOPS = 7  # per key x value element of a state, one decode token (module docstring)
CHUNK_STATE_FLOPS = 6  # per key x value element, one prefill token: three state products
# torch's grouped_mm on Hopper (aten/src/ATen/native/cuda/GroupMM.cu, CUTLASS) runs a 64x128x128 tile when the
# mean rows a group (expert) are at most 128 (or the GEMM's N is: never, for the experts' 2·width and hidden
# columns of the MoE specs), else a 128x256x64 tile
SMALL_TILE_ROWS = 128


def attention_pairs(new_tokens, cached_tokens):
    """Query-key pairs of a causal prefill chunk: ``n`` new tokens after ``c`` cached ones.

    Token ``i`` of the chunk attends to ``c + i + 1`` keys, so the chunk has
    ``n·c + n·(n+1)/2`` pairs. Works on scalars and numpy arrays; sum it over
    the batch's prefill chunks to get ``prefill_context_tokens``.

    >>> attention_pairs(4, 10)
    50.0
    """
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2.0


@dataclass(frozen=True)
class StepCost:
    """Where a step's time goes (seconds; ``total_s`` includes the overhead and the forward speed).

    The linear parts are each at its own roof; the step pays their smooth
    maximum (a hard maximum for the uncalibrated roofline). ``overhead_s`` is the
    fixed per-step cost, ``per_token_s`` the fitted per-token, per-row and
    per-layer costs (0 without a calibration). A step of several tokens reads
    its weights at the matrix kernels' rate: in ``linear_memory_s``.
    """

    linear_compute_s: float
    linear_memory_s: float
    prefill_attention_s: float
    decode_attention_s: float
    communication_s: float
    overhead_s: float
    total_s: float
    per_token_s: float = 0.0

    @property
    def linear_bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof the linear layers hit."""
        return "compute" if self.linear_compute_s >= self.linear_memory_s else "memory"


@dataclass(frozen=True)
class ForwardParams:
    """The forward model's free parameters (see :class:`~.calibration.ForwardCalibration`).

    The uncalibrated roofline is the GPU spec's two efficiencies for every
    part, a hard maximum between the linear roofs (``linear_sharpness=inf``)
    and a fixed per-step overhead only. With ``all_reduce_s`` None (the
    roofline, one-GPU fits and fits made before it existed) the all-reduces
    cost the GPU spec's latency and link bandwidth.
    """

    compute_efficiency: float
    memory_efficiency: float
    attention_efficiency: float
    kv_memory_efficiency: float
    linear_sharpness: float
    step_overhead_s: float
    token_layer_s: float = 0.0
    row_layer_s: float = 0.0
    attention_rows: float = 0.0
    attention_sharpness: float = float("inf")
    multi_token_s: float = 0.0
    chunk_layer_s: float = 0.0
    mixed_row_layer_s: float = 0.0
    decode_layer_s: float = 0.0
    all_reduce_s: float | None = None
    all_reduce_token_s: float = 0.0
    chunk_routing_skew: float = 1.0
    multi_token_read: float = 0.0
    chunk_attention_rows: float = 0.0
    expert_small_tile_cost: float = 0.0

    @classmethod
    def roofline(cls, gpu: GPUSpec, step_overhead_s: float) -> ForwardParams:
        return cls(gpu.compute_efficiency, gpu.memory_efficiency, gpu.compute_efficiency, gpu.memory_efficiency,
                   float("inf"), step_overhead_s)

    @classmethod
    def from_calibration(cls, cal: ForwardCalibration) -> ForwardParams:
        return cls(cal.compute_efficiency, cal.memory_efficiency, cal.attention_efficiency,
                   cal.kv_memory_efficiency, cal.linear_sharpness, cal.step_overhead_s, cal.token_layer_s,
                   cal.row_layer_s, cal.attention_rows, cal.attention_sharpness, cal.multi_token_s,
                   cal.chunk_layer_s, cal.mixed_row_layer_s, cal.decode_layer_s, cal.all_reduce_s,
                   cal.all_reduce_token_s, cal.chunk_routing_skew or 1.0, cal.multi_token_read,
                   cal.chunk_attention_rows, cal.expert_small_tile_cost or 0.0)


@dataclass(frozen=True)
class PeakTimes:
    """A step's parts at the datasheet peaks (no efficiency), per rank; numpy arrays or floats."""

    linear_flops_s: object
    weight_bytes_s: object
    prefill_attention_s: object  # the full-attention layers' query-key pairs
    decode_attention_flops_s: object
    kv_bytes_s: object
    communication_s: object
    tokens: object
    decode_rows: object
    prefill_chunks: object = 0
    all_reduces: int = 0  # per step: two a layer with tensor parallelism, none on one GPU
    expert_bytes_s: object = 0.0  # the routed experts every token routed uniformly touches (weight_bytes_s: the rest)
    prefill_state_s: object = 0.0  # a hybrid's linear-attention layers over the prefill chunks
    # the routed experts' FLOPs (in linear_flops_s) of a step whose grouped GEMM runs its small tile, else 0
    small_tile_flops_s: object = 0.0


def smooth_max(a, b, sharpness: float):
    """``(a^p + b^p)^(1/p)``: the larger of ``a`` and ``b``, rounded at the corner (``p = inf``: ``max``)."""
    if np.isinf(sharpness):
        return np.maximum(a, b)
    hi = np.maximum(np.maximum(a, b), 1e-30)
    return hi * ((a / hi) ** sharpness + (b / hi) ** sharpness) ** (1.0 / sharpness)


class ForwardCostModel:
    """Forward-step time of ``model`` on ``gpu`` with ``tp``-way tensor parallelism.

    Parameters
    ----------
    model, gpu : a built-in name, a YAML/JSON spec file, or a spec object.
    tp : tensor-parallel degree; weights, FLOPs and (GQA) KV heads split over
        ranks, and each layer pays two ring all-reduces of the hidden states.
    speed : the host's forward speed: each step's time, overhead included, is
        multiplied by it (a number, or a :class:`~.forward_speed.ForwardSpeed`
        with its own factor for steps with prefill chunks).
    step_overhead_s : fixed cost of a step (launches, synchronisation) of the
        uncalibrated roofline; a forward calibration brings its own.
    forward_calibration : ``"auto"`` (default): the calibration shipped for this
        model and GPU when there is one and ``tp`` is 1, else the roofline;
        ``"none"``: the uncalibrated roofline; or a calibration file or object.
        :attr:`calibration_source` says which was used.
    """

    def __init__(
        self,
        model: str | Path | ModelSpec,
        gpu: str | Path | GPUSpec,
        tp: int = 1,
        speed: float | ForwardSpeed = 1.0,
        step_overhead_s: float = 2e-4,
        forward_calibration: str | Path | ForwardCalibration = "auto",
        moe_imbalance: float = 1.0,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if not isinstance(speed, ForwardSpeed):
            if speed <= 0:
                raise ValueError(f"forward speed must be > 0, got {speed}")
            speed = ForwardSpeed.given(speed)
        if moe_imbalance < 1:
            raise ValueError(f"moe_imbalance must be >= 1, got {moe_imbalance}")
        self.model = m = resolve_model(model)
        self.gpu = g = resolve_gpu(gpu)
        self.tp, self.speed = tp, speed
        self._decode_speed, self._prefill_speed = speed.decode, speed.prefill
        fit, self.calibration_source = _pick_calibration(forward_calibration, m, g, tp)
        self.params = p = ForwardParams.from_calibration(fit) if fit else ForwardParams.roofline(g, step_overhead_s)
        self.step_overhead_s = p.step_overhead_s

        flops_rate, byte_rate = g.bf16_dense_flops, g.hbm_bandwidth_Bps
        # Per-rank coefficients at the peaks, precomputed so one step is a handful of multiplications.
        self._linear_s_per_token = 2.0 * m.active / tp / flops_rate
        if m.is_moe:
            per_expert = (m.params_total - m.active) / (m.n_experts - m.experts_per_token)
            always_read = m.active - m.experts_per_token * per_expert
            self._expert_s = per_expert * m.bytes_per_weight / tp / byte_rate
            self._n_experts = m.n_experts / moe_imbalance  # the experts that take the traffic
            # a chunk's routing skew is measured after full-attention layers only (_experts_touched)
            self._skewed_layer_share = m.n_full_attention_layers / m.n_layers
            self._miss_prob = 1.0 - m.experts_per_token * moe_imbalance / m.n_experts  # one token skips one of them
            self._expert_flops_s_per_token = 2.0 * m.experts_per_token * per_expert / tp / flops_rate
            self._small_tile_tokens = SMALL_TILE_ROWS * m.n_experts / m.experts_per_token
        else:
            always_read, self._expert_s, self._n_experts, self._miss_prob = m.params_total, 0.0, 0, 1.0
            self._skewed_layer_share = 0.0
            self._expert_flops_s_per_token, self._small_tile_tokens = 0.0, 0.0
        self.moe_imbalance = moe_imbalance
        self._dense_weight_s = always_read * m.bytes_per_weight / tp / byte_rate
        heads_per_rank = -(-m.n_heads // tp)
        self._heads_per_rank = heads_per_rank
        v_dim = m.v_head_dim or m.head_dim
        full = m.n_full_attention_layers
        self._attn_s_per_pair = 2.0 * heads_per_rank * (m.head_dim + v_dim) * full / flops_rate
        self._kv_read_s_per_token = m.kv_elements_per_token_layer(tp) * m.bytes_per_kv * full / byte_rate
        # linear attention: per decode row, per prefill token, per prefill chunk (0 unless hybrid)
        self._hybrid = m.is_hybrid
        state_elements = (-(-m.linear_num_value_heads // tp) * m.linear_key_head_dim * m.linear_value_head_dim
                          * m.n_linear_layers)
        self._state_s_per_visit = 2.0 * m.state_bytes_per_request(tp) / byte_rate  # read and write once
        self._recurrent_s_per_row = RECURRENT_FLOPS * state_elements / flops_rate
        chunk_flops = CHUNK_STATE_FLOPS * m.linear_key_head_dim * m.linear_value_head_dim + 2.0 * LINEAR_CHUNK * (
            m.linear_key_head_dim + m.linear_value_head_dim)
        self._chunked_s_per_token = (chunk_flops * -(-m.linear_num_value_heads // tp) * m.n_linear_layers
                                     / flops_rate)
        self._mtp: _MtpRoof | None = None  # built on the first mtp_draft_s
        self._mtp_fit = fit.mtp_draft if fit else None
        if tp > 1:
            link_rate = g.nvlink_bandwidth_Bps / 2.0  # one direction of the datasheet total
            ring_bytes = 2.0 * (tp - 1) / tp * m.hidden_size * ACTIVATION_BYTES
            self._comm_s_per_token = 2 * m.n_layers * ring_bytes / link_rate
            self._comm_fixed_s = 2 * m.n_layers * g.collective_latency_s
        else:
            self._comm_s_per_token = self._comm_fixed_s = 0.0
        self._all_reduces = 2 * m.n_layers if tp > 1 else 0

    def __repr__(self) -> str:
        return (f"ForwardCostModel({self.model.name!r}, {self.gpu.name!r}, tp={self.tp}, "
                f"speed={self.speed.describe()!r}, forward_calibration={self.calibration_source!r})")

    def peak_times(self, prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens,
                   prefill_chunks=0) -> PeakTimes:
        """The step's parts at the datasheet peaks (what a calibration fit scales)."""
        tokens = prefill_tokens + decode_rows
        experts_touched = self._n_experts * (1.0 - self._miss_prob**tokens)
        prefill_attention_s = self._attn_s_per_pair * prefill_context_tokens
        decode_attention_flops_s = self._attn_s_per_pair * decode_kv_tokens
        kv_bytes_s = self._kv_read_s_per_token * decode_kv_tokens
        prefill_state_s = 0.0
        if self._hybrid:  # the linear layers' recurrence, and their state read and written once per row or chunk
            prefill_state_s = self._chunked_s_per_token * prefill_tokens
            decode_attention_flops_s = decode_attention_flops_s + self._recurrent_s_per_row * decode_rows
            kv_bytes_s = kv_bytes_s + self._state_s_per_visit * (decode_rows + prefill_chunks)
        return PeakTimes(
            linear_flops_s=self._linear_s_per_token * tokens,
            weight_bytes_s=self._dense_weight_s,
            prefill_attention_s=prefill_attention_s,
            decode_attention_flops_s=decode_attention_flops_s,
            kv_bytes_s=kv_bytes_s,
            communication_s=self._comm_s_per_token * tokens + self._comm_fixed_s,
            tokens=tokens,
            decode_rows=decode_rows,
            prefill_chunks=prefill_chunks,
            all_reduces=self._all_reduces,
            expert_bytes_s=self._expert_s * experts_touched,
            prefill_state_s=prefill_state_s,
            # the kernel picks its tile from the step's pairs over all experts, however they are routed
            small_tile_flops_s=self._expert_flops_s_per_token * tokens * (tokens <= self._small_tile_tokens),
        )

    def _parts(self, peak: PeakTimes, params: ForwardParams):
        lc = peak.linear_flops_s
        if params.expert_small_tile_cost:
            # measured, not derived: the MoE's prefill steps of at most 2,048 tokens cost more a token than
            # longer ones, where qwen3-30b-a3b's grouped GEMM changes tile (reports/calibration/README.md)
            lc = lc + params.expert_small_tile_cost * peak.small_tile_flops_s
        lc = lc / params.compute_efficiency
        experts = peak.expert_bytes_s
        if params.chunk_routing_skew > 1 and self._expert_s:
            share = self._skewed_layer_share
            skewed = self._expert_s * self._experts_touched(peak, params.chunk_routing_skew)
            experts = skewed if share == 1.0 else share * skewed + (1.0 - share) * experts
        lm = (peak.weight_bytes_s + experts) / params.memory_efficiency
        if params.multi_token_read:
            # one token runs the linear layers as matrix-vector kernels, which stream the weights near the copy
            # rate; two or more run matrix kernels, which read them slower (ForwardCalibration.multi_token_read)
            lm = lm * np.where(peak.tokens >= 2, 1.0 + params.multi_token_read, 1.0)
        pa = peak.prefill_attention_s
        if params.chunk_attention_rows:
            # a short chunk's attention runs too few blocks to fill the GPU: it takes as long as
            # chunk_attention_rows query rows would over the same keys (ForwardCalibration)
            rows = np.maximum((peak.tokens - peak.decode_rows) / np.maximum(peak.prefill_chunks, 1), 1e-9)
            rows = rows * self._heads_per_rank
            pa = pa * np.maximum(rows, params.chunk_attention_rows) / rows
        pa = (pa + peak.prefill_state_s) / params.attention_efficiency
        da = np.maximum(peak.decode_attention_flops_s / params.attention_efficiency,
                        peak.kv_bytes_s / params.kv_memory_efficiency)
        if params.attention_rows > 0:
            # Fewer rows than attention_rows leave the GPU partly idle: the rows run at their per-row pace.
            rows = np.maximum(peak.decode_rows, 1e-9)
            da = da * smooth_max(rows, params.attention_rows, params.attention_sharpness) / rows
        n_layers = self.model.n_layers
        per_token = n_layers * (params.token_layer_s * peak.tokens + params.row_layer_s * peak.decode_rows
                                + params.chunk_layer_s * peak.prefill_chunks)
        if params.mixed_row_layer_s:
            # measured, not derived: the mixed shapes' residuals grow with their decode rows
            # (reports/calibration/README.md)
            per_token = per_token + n_layers * params.mixed_row_layer_s * (peak.prefill_chunks > 0) * peak.decode_rows
        if params.multi_token_s:
            # fits made before multi_token_read: a constant for any step of two or more tokens
            per_token = per_token + np.where(peak.tokens >= 2, params.multi_token_s, 0.0)
        if params.decode_layer_s:
            # the decode rows' attention runs its own kernels in every layer, beside any prefill chunk's
            per_token = per_token + n_layers * params.decode_layer_s * (peak.decode_rows > 0)
        comm = peak.communication_s
        if params.all_reduce_s is not None and peak.all_reduces:
            # each all-reduce waits out its latency until its bytes take longer (NCCL's small messages are
            # latency-bound, large ones bandwidth-bound): the latency fitted to the ranks' measured steps,
            # the per-token time measured by live TP runs (or fitted)
            comm = peak.all_reduces * np.maximum(params.all_reduce_s, params.all_reduce_token_s * peak.tokens)
        return lc, lm, pa, da, comm, per_token

    def _experts_touched(self, peak: PeakTimes, skew: float):
        """Distinct experts a step reads when each prefill chunk's tokens route over their own ``E/skew`` of them.

        Measured, not derived: in the live forward's MoE measurements a prefill chunk costs far less
        than as many decode rows of the same token ids (qwen3-30b-a3b on an H200: a chunk of 64 tokens
        13.7 ms, 64 decode rows 29.4 ms), as if the chunk's tokens read fewer distinct experts; counted
        on the CPU, the random-weight model's router sends a chunk's tokens to fewer experts than decode
        rows, fewer the deeper the layer (reports/calibration/README.md). So decode rows route uniformly
        (``E·(1 − (1 − k/E)^rows)``, module doc), and the tokens of one chunk share one random subset of
        ``E/skew`` experts, each token reading ``k`` of them: the chunk touches a share
        ``s = (1 − (1 − k·skew/E)^n)/skew`` of all experts. Chunks and rows route independently, so an
        expert is missed by all of them with probability ``(1 − k/E)^rows·(1 − s)^chunks``. A step's
        chunks are taken as equal (the step gives only their total tokens). ``skew = 1`` is uniform
        routing of every token.
        """
        prefill = peak.tokens - peak.decode_rows
        chunks = np.maximum(peak.prefill_chunks, 1)  # callers that give no chunk count run one chunk
        hit = min((1.0 - self._miss_prob) * skew, 1.0)  # one token's chance to read a given expert of its subset
        share = (1.0 - (1.0 - hit) ** (prefill / chunks)) / skew
        return self._n_experts * (1.0 - self._miss_prob**peak.decode_rows * (1.0 - share) ** chunks)

    def price(self, peak: PeakTimes, params: ForwardParams | None = None):
        """Step seconds of ``peak`` under ``params`` (default this model's); arrays broadcast."""
        params = params or self.params
        lc, lm, pa, da, comm, per_token = self._parts(peak, params)
        body = smooth_max(lc, lm, params.linear_sharpness) + pa + da + comm + per_token
        speed = self._decode_speed
        if self._prefill_speed != speed or self.speed.prefill_by_tokens:
            # a step with prefill chunks runs at its own measured speed (by its prefill tokens where measured so)
            prefill = np.asarray(peak.tokens) - np.asarray(peak.decode_rows)
            speed = np.where(prefill > 0, self.speed.prefill_at(prefill), speed)
        return speed * (body + params.step_overhead_s)

    def step_s(
        self,
        prefill_tokens: float = 0,
        prefill_context_tokens: float = 0,
        decode_rows: float = 0,
        decode_kv_tokens: float = 0,
        prefill_chunks: int = 0,
    ) -> float:
        """Seconds for one step (0 when there is nothing to run).

        Parameters
        ----------
        prefill_tokens : new prompt tokens in the step (all chunks).
        prefill_context_tokens : query-key pairs of those chunks, summed
            (:func:`attention_pairs` per chunk).
        decode_rows : rows decoding one token each (spec decoding: 1 + k each).
        decode_kv_tokens : KV-cache tokens those rows read, summed.
        prefill_chunks : how many prefill chunks carry those tokens (each one's attention runs
            its own kernels in every layer).
        """
        if prefill_tokens + decode_rows <= 0:
            return 0.0
        return float(self.price(self.peak_times(prefill_tokens, prefill_context_tokens, decode_rows,
                                                decode_kv_tokens, prefill_chunks)))

    def step_s_array(self, prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens,
                     prefill_chunks=0) -> np.ndarray:
        """:meth:`step_s` over numpy arrays (broadcast), e.g. to price a whole schedule at once."""
        pf, pairs, rows, kv, chunks = (np.asarray(x, dtype=np.float64) for x in
                                       (prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens,
                                        prefill_chunks))
        total = self.price(self.peak_times(pf, pairs, rows, kv, chunks))
        return np.where(pf + rows > 0, total, 0.0)

    def decode_step_s(self, decode_rows: int, decode_kv_tokens: np.ndarray) -> np.ndarray:
        """:meth:`step_s` of decode-only steps of ``decode_rows`` rows, one a value of ``decode_kv_tokens``: the
        same values, the row count's terms computed as :meth:`step_s` computes them (Python scalars)."""
        if decode_rows <= 0:
            return np.zeros(len(decode_kv_tokens))
        return self.price(self.peak_times(0.0, 0.0, decode_rows, np.asarray(decode_kv_tokens, np.float64), 0))

    def breakdown(
        self,
        prefill_tokens: float = 0,
        prefill_context_tokens: float = 0,
        decode_rows: float = 0,
        decode_kv_tokens: float = 0,
        prefill_chunks: int = 0,
    ) -> StepCost:
        """The parts of :meth:`step_s` (before the forward speed), for reports and tests."""
        peak = self.peak_times(prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens, prefill_chunks)
        lc, lm, pa, da, comm, per_token = (float(x) for x in self._parts(peak, self.params))
        total = self.step_s(prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens, prefill_chunks)
        overhead = self.params.step_overhead_s if total else 0.0
        return StepCost(lc, lm, pa, da, comm, overhead, total, per_token)

    def mtp_draft_s(self, rows: float, drafts: int, kv_tokens: float = 0.0) -> float:
        """Seconds the MTP head takes to draft ``drafts`` tokens for each of ``rows`` decode rows.

        Drafting is sequential: draft ``j`` feeds draft ``j + 1``, so it is ``drafts`` passes of the
        head over the rows, each reading the head's weights (the experts its rows touch) and the LM
        head, and attending over the rows' ``kv_tokens`` of context (one more per row each pass):
        :meth:`mtp_roof_s`. A calibration's fitted draft term (``mtp_draft``, measured draft shapes)
        makes each pass its fixed cost plus its scale times that price. Times the decode speed (the
        passes run inside the step: no step overhead). ``ValueError`` when the model has no MTP layer.
        """
        roof = self.mtp_roof_s(rows, drafts, kv_tokens)
        fit = self._mtp_fit
        if fit is not None and roof:
            roof = drafts * fit.pass_s + fit.roof_scale * roof
        return self._decode_speed * roof

    def mtp_roof_s(self, rows: float, drafts: int, kv_tokens: float = 0.0) -> float:
        """The MTP head's ``drafts`` passes over ``rows`` rows at the roofline with this model's efficiencies
        (the step fit's, or the GPU spec's): no fitted draft term, no forward speed."""
        if not self.model.mtp_layers:
            raise ValueError(f"{self.model.name} has no MTP layer (mtp_layers = 0) to draft with")
        if rows <= 0 or drafts <= 0:
            return 0.0
        if self._mtp is None:
            self._mtp = _MtpRoof(self.model, self.tp, self.gpu.bf16_dense_flops, self.gpu.hbm_bandwidth_Bps)
        return sum(self._mtp.pass_s(rows, kv_tokens + j * rows, self.params) for j in range(drafts))


class _MtpRoof:
    """The MTP head's parts at the datasheet peaks, per rank: one pass over some rows.

    A pass runs the head's layers (a projection of the last hidden state joined
    with the next token's embedding, ``2h x h``; a full-attention layer over its own
    KV cache; the MoE FFN with its shared expert) and the shared LM head.
    """

    def __init__(self, m: ModelSpec, tp: int, flops_rate: float, byte_rate: float) -> None:
        if m.attention != "gqa":
            raise ValueError(f"{m.name}: MTP pricing covers GQA attention only")
        h, layers = m.hidden_size, m.mtp_layers
        q_width = m.n_heads * m.head_dim * (2 if m.attention_output_gate else 1)
        attention = h * q_width + 2 * h * m.n_kv_heads * m.head_dim + m.n_heads * (m.v_head_dim or m.head_dim) * h
        if m.is_moe:
            if m.moe_intermediate_size is None:
                raise ValueError(f"{m.name}: MTP pricing of a MoE needs moe_intermediate_size")
            expert = 3 * h * m.moe_intermediate_size
            dense = h * m.n_experts + 3 * h * m.shared_expert_intermediate_size
            self.n_experts, self.miss_prob, k = m.n_experts, 1.0 - m.experts_per_token / m.n_experts, m.experts_per_token
        else:
            expert, dense, self.n_experts, self.miss_prob, k = 0, 3 * h * intermediate_size(m), 0, 1.0, 0
        dense_layer = 2 * h * h + attention + dense
        lm_head = m.vocab_size * h
        scale = m.bytes_per_weight / tp / byte_rate
        self.weight_s = (layers * dense_layer + lm_head) * scale
        self.expert_s = layers * expert * scale
        self.flops_s_per_row = 2.0 * (layers * (dense_layer + k * expert) + lm_head) / tp / flops_rate
        v_dim = m.v_head_dim or m.head_dim
        self.attn_s_per_pair = 2.0 * -(-m.n_heads // tp) * (m.head_dim + v_dim) * layers / flops_rate
        self.kv_s_per_token = m.kv_elements_per_token_layer(tp) * m.bytes_per_kv * layers / byte_rate

    def pass_s(self, rows: float, kv_tokens: float, params: ForwardParams) -> float:
        touched = self.n_experts * (1.0 - self.miss_prob**rows)
        linear = max(self.flops_s_per_row * rows / params.compute_efficiency,
                     (self.weight_s + self.expert_s * touched) / params.memory_efficiency)
        attention = max(self.attn_s_per_pair * kv_tokens / params.attention_efficiency,
                        self.kv_s_per_token * kv_tokens / params.kv_memory_efficiency)
        return linear + attention


def _pick_calibration(choice: str | Path | ForwardCalibration, model: ModelSpec, gpu: GPUSpec,
                      tp: int) -> tuple[ForwardCalibration | None, str]:
    """The calibration to use and how to name it (``"none"``, a shipped file's name, or a path)."""
    if isinstance(choice, ForwardCalibration):
        cal, source = choice, f"{choice.model} on {choice.gpu} (given)"
    elif str(choice) == "none":
        return None, "none"
    elif str(choice) == "auto":
        path = shipped_calibration_path(model.name, gpu.name, tp)
        if not path.is_file():
            return None, "none"
        cal, source = ForwardCalibration.load(path), path.name
    else:
        cal, source = ForwardCalibration.load(choice), str(choice)
    if (cal.model, cal.gpu, cal.tp) != (model.name, gpu.name, tp):
        raise CalibrationError(f"forward calibration {source} is for {cal.model} on {cal.gpu} at tp={cal.tp}, "
                               f"not {model.name} on {gpu.name} at tp={tp}")
    return cal, source


class ForwardConfig(BaseModel):
    """The forward cost model as run configuration (YAML/CLI).

    >>> ForwardConfig(model="qwen3-8b", gpu="h200").build().gpu.name
    'h200'
    """

    model_config = ConfigDict(extra="forbid")
    model: str | ModelSpec = Field(default="llama-3.1-8b", description="built-in name, spec file, or inline spec")
    gpu: str | GPUSpec = Field(default="h100-sxm", description="built-in name, spec file, or inline spec")
    tp: int = Field(default=1, ge=1)
    forward_speed: float | ForwardSpeed | str = Field(
        default=1.0, description="this host's forward time over the calibration's price (1.04: 4 % slower), "
        "multiplying every step's forward: a number; live-run:<run folder or PACK::RUN>, fitted from that live "
        "run's steps; or probe:<file>, from cdbench calibrate --probe (both resolved into a fitted speed, with "
        "its source, when the run's configuration is checked). 'calibration' is its earlier name")
    forward_speed_sigma: float | Literal["measured"] = Field(
        default=0.0, description="the forward speed's spread from run to run (a lognormal sigma): each run's speed "
        "times a factor drawn from its seed (copies of a model arm then sample a host's run-to-run speed); "
        "'measured': the spread measured between live copies (forward_speed.RUN_SPEED_SIGMA); 0: none")
    step_overhead_s: float = Field(default=2e-4, ge=0, description="uncalibrated roofline only")
    forward_calibration: str = Field(
        default="auto", description="auto (the shipped fit for this model and GPU, else none), none, or a file")
    moe_imbalance: float = Field(default=1.0, ge=1, description="MoE routing skew (1: uniform; module doc)")

    @model_validator(mode="before")
    @classmethod
    def _earlier_name(cls, data: Any) -> Any:
        # configs written before forward_speed (every run folder's config.yaml) name it calibration
        if isinstance(data, dict) and "calibration" in data:
            data = dict(data)
            earlier = data.pop("calibration")
            if "forward_speed" not in data:
                data["forward_speed"] = earlier
            elif earlier != 1.0:
                raise ValueError("calibration is forward_speed's earlier name: set one of them")
        return data

    @field_validator("forward_speed_sigma")
    @classmethod
    def _sigma(cls, value: float | str) -> float | str:
        if value != "measured" and not 0.0 <= value < 0.5:
            raise ValueError("a run-to-run speed sigma is 0 or more, below 0.5 (or 'measured')")
        return value

    def speed_sigma(self) -> float:
        """``forward_speed_sigma`` as a number."""
        return RUN_SPEED_SIGMA if self.forward_speed_sigma == "measured" else float(self.forward_speed_sigma)

    @field_validator("forward_speed")
    @classmethod
    def _speed_source(cls, value: float | ForwardSpeed | str) -> float | ForwardSpeed | str:
        if isinstance(value, str):
            for prefix in ("live-run:", PROBE_PREFIX):
                if value.startswith(prefix) and value.removeprefix(prefix):
                    return value
            raise ValueError("expected a number, 'live-run:<run folder or PACK::RUN>' or 'probe:<file>'")
        if isinstance(value, float) and not value > 0:
            raise ValueError("a forward speed is > 0")
        return value

    def speed(self) -> ForwardSpeed:
        """``forward_speed`` as a :class:`ForwardSpeed`; a ``live-run:`` or ``probe:`` source must have been
        resolved (:func:`cdbench.results.run_config.validate_run_config` does) before."""
        value = self.forward_speed
        if isinstance(value, str):
            raise ValueError(f"costs.forward_speed {value!r} is fitted when the run's configuration is checked "
                             "(validate_run_config); it was not")
        return value if isinstance(value, ForwardSpeed) else ForwardSpeed.given(value)

    def build(self) -> ForwardCostModel:
        return ForwardCostModel(self.model, self.gpu, self.tp, self.speed(), self.step_overhead_s,
                                self.forward_calibration, self.moe_imbalance)
