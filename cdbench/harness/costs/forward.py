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
expected number of distinct experts is ``E·(1 − (1 − k/E)^N)``.

The sum is multiplied by ``calibration`` (1 by default; ``live`` mode fits it
against measured steps) and a fixed per-step overhead is added.

Examples
--------
>>> fwd = ForwardCostModel("llama-3.1-8b", "h100-sxm")
>>> round(fwd.step_s(decode_rows=1, decode_kv_tokens=1000) * 1e3, 1)   # ms, batch 1
6.2
>>> fwd.step_s(prefill_tokens=512, prefill_context_tokens=attention_pairs(512, 0)) > 0.01
True
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.costs.hardware import (
    GPUSpec,
    ModelSpec,
    resolve_gpu,
    resolve_model,
)

ACTIVATION_BYTES = 2  # all-reduced hidden states are bf16


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
    """Where a step's time goes (seconds; ``total_s`` includes calibration and overhead)."""

    linear_compute_s: float
    linear_memory_s: float
    prefill_attention_s: float
    decode_attention_s: float
    communication_s: float
    overhead_s: float
    total_s: float

    @property
    def linear_bound(self) -> str:
        """``"compute"`` or ``"memory"``: which roof the linear layers hit."""
        return "compute" if self.linear_compute_s >= self.linear_memory_s else "memory"


class ForwardCostModel:
    """Forward-step time of ``model`` on ``gpu`` with ``tp``-way tensor parallelism.

    Parameters
    ----------
    model, gpu : a built-in name, a YAML/JSON spec file, or a spec object.
    tp : tensor-parallel degree; weights, FLOPs and (GQA) KV heads split over
        ranks, and each layer pays two ring all-reduces of the hidden states.
    calibration : multiplies the roofline time (fit by ``live`` mode).
    step_overhead_s : fixed cost of a step (launches, synchronisation).
    """

    def __init__(
        self,
        model: str | Path | ModelSpec,
        gpu: str | Path | GPUSpec,
        tp: int = 1,
        calibration: float = 1.0,
        step_overhead_s: float = 2e-4,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if calibration <= 0:
            raise ValueError(f"calibration must be > 0, got {calibration}")
        self.model = m = resolve_model(model)
        self.gpu = g = resolve_gpu(gpu)
        self.tp, self.calibration, self.step_overhead_s = tp, calibration, step_overhead_s

        flops_rate = g.bf16_dense_flops * g.compute_efficiency
        byte_rate = g.hbm_bandwidth_Bps * g.memory_efficiency
        # Per-rank coefficients, precomputed so one step is a handful of multiplications.
        self._linear_s_per_token = 2.0 * m.active / tp / flops_rate
        if m.is_moe:
            per_expert = (m.params_total - m.active) / (m.n_experts - m.experts_per_token)
            always_read = m.active - m.experts_per_token * per_expert
            self._expert_s = per_expert * m.bytes_per_weight / tp / byte_rate
            self._n_experts = m.n_experts
            self._miss_prob = 1.0 - m.experts_per_token / m.n_experts  # one token skips a given expert
        else:
            always_read, self._expert_s, self._n_experts, self._miss_prob = m.params_total, 0.0, 0, 1.0
        self._dense_weight_s = always_read * m.bytes_per_weight / tp / byte_rate
        heads_per_rank = -(-m.n_heads // tp)
        v_dim = m.v_head_dim or m.head_dim
        self._attn_s_per_pair = 2.0 * heads_per_rank * (m.head_dim + v_dim) * m.n_layers / flops_rate
        self._kv_read_s_per_token = m.kv_elements_per_token_layer(tp) * m.bytes_per_kv * m.n_layers / byte_rate
        if tp > 1:
            link_rate = g.nvlink_bandwidth_Bps / 2.0  # one direction of the datasheet total
            ring_bytes = 2.0 * (tp - 1) / tp * m.hidden_size * ACTIVATION_BYTES
            self._comm_s_per_token = 2 * m.n_layers * ring_bytes / link_rate
            self._comm_fixed_s = 2 * m.n_layers * g.collective_latency_s
        else:
            self._comm_s_per_token = self._comm_fixed_s = 0.0

    def __repr__(self) -> str:
        return f"ForwardCostModel({self.model.name!r}, {self.gpu.name!r}, tp={self.tp}, calibration={self.calibration})"

    def _parts(self, prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens, maximum):
        tokens = prefill_tokens + decode_rows
        linear_compute = self._linear_s_per_token * tokens
        experts_touched = self._n_experts * (1.0 - self._miss_prob**tokens)
        linear_memory = self._dense_weight_s + self._expert_s * experts_touched
        prefill_attn = self._attn_s_per_pair * prefill_context_tokens
        decode_attn = maximum(self._attn_s_per_pair * decode_kv_tokens, self._kv_read_s_per_token * decode_kv_tokens)
        comm = self._comm_s_per_token * tokens + self._comm_fixed_s
        return linear_compute, linear_memory, prefill_attn, decode_attn, comm

    def step_s(
        self,
        prefill_tokens: float = 0,
        prefill_context_tokens: float = 0,
        decode_rows: float = 0,
        decode_kv_tokens: float = 0,
    ) -> float:
        """Seconds for one step (0 when there is nothing to run).

        Parameters
        ----------
        prefill_tokens : new prompt tokens in the step (all chunks).
        prefill_context_tokens : query-key pairs of those chunks, summed
            (:func:`attention_pairs` per chunk).
        decode_rows : rows decoding one token each (spec decoding: 1 + k each).
        decode_kv_tokens : KV-cache tokens those rows read, summed.
        """
        if prefill_tokens + decode_rows <= 0:
            return 0.0
        lc, lm, pa, da, comm = self._parts(prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens, max)
        return self.calibration * (max(lc, lm) + pa + da + comm) + self.step_overhead_s

    def step_s_array(self, prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens) -> np.ndarray:
        """:meth:`step_s` over numpy arrays (broadcast), e.g. to price a whole schedule at once."""
        pf, pairs, rows, kv = (np.asarray(x, dtype=np.float64) for x in
                               (prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens))
        lc, lm, pa, da, comm = self._parts(pf, pairs, rows, kv, np.maximum)
        total = self.calibration * (np.maximum(lc, lm) + pa + da + comm) + self.step_overhead_s
        return np.where(pf + rows > 0, total, 0.0)

    def breakdown(
        self,
        prefill_tokens: float = 0,
        prefill_context_tokens: float = 0,
        decode_rows: float = 0,
        decode_kv_tokens: float = 0,
    ) -> StepCost:
        """The parts of :meth:`step_s` (uncalibrated), for reports and tests."""
        lc, lm, pa, da, comm = self._parts(prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens, max)
        total = self.step_s(prefill_tokens, prefill_context_tokens, decode_rows, decode_kv_tokens)
        return StepCost(lc, lm, pa, da, comm, self.step_overhead_s if total else 0.0, total)


class ForwardConfig(BaseModel):
    """The forward cost model as run configuration (YAML/CLI).

    >>> ForwardConfig(model="qwen3-8b", gpu="h200").build().gpu.name
    'h200'
    """

    model_config = ConfigDict(extra="forbid")
    model: str | ModelSpec = Field(default="llama-3.1-8b", description="built-in name, spec file, or inline spec")
    gpu: str | GPUSpec = Field(default="h100-sxm", description="built-in name, spec file, or inline spec")
    tp: int = Field(default=1, ge=1)
    calibration: float = Field(default=1.0, gt=0)
    step_overhead_s: float = Field(default=2e-4, ge=0)

    def build(self) -> ForwardCostModel:
        return ForwardCostModel(self.model, self.gpu, self.tp, self.calibration, self.step_overhead_s)
