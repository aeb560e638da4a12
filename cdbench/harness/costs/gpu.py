"""GPU-side cost of a step: forward, bitmask copy, apply kernel, sampling.

:class:`GpuCosts` is what the scheduler asks; :class:`RooflineGpuCosts` answers
from the forward cost model and the measured mask-kernel tables,
:class:`FixedGpuCosts` from constants (tests, what-if runs).
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.costs.forward import ForwardCostModel, attention_pairs
from cdbench.harness.costs.mask import MaskCost, bitmask_bytes

_sum = np.add.reduce  # the direct ufunc reduction: cheaper than ndarray.sum per call


class GpuCosts(Protocol):
    """GPU-side time of one step, in seconds."""

    def forward_s(self, prefill_chunks: np.ndarray, prefill_cached: np.ndarray, decode_rows: int, decode_kv_tokens: int) -> float:
        """Forward of prefill chunks (new tokens, tokens already cached) and ``decode_rows`` decoding rows."""

    def decode_forward_s(self, decode_rows: int, decode_kv_tokens: np.ndarray) -> np.ndarray:
        """:meth:`forward_s` of decode-only steps of ``decode_rows`` rows, one a value of ``decode_kv_tokens``."""

    def draft_s(self, rows: int, drafts: int, kv_tokens: int) -> float:
        """The model's MTP head drafting ``drafts`` tokens for each of ``rows`` rows with ``kv_tokens`` of context."""

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        """Host-to-device copy of a ``mask_rows``-row bitmask."""

    def apply_s(self, mask_rows: int) -> float:
        """The apply kernel over ``mask_rows`` rows."""

    def sample_s(self, rows: int) -> float:
        """Sampling ``rows`` logits rows."""

    @property
    def mask_row_bytes(self) -> int:
        """Bytes of one bitmask row (what the host allocates and moves per row)."""


class FixedGpuCosts(BaseModel):
    """Linear GPU costs with explicit coefficients: hand-computable, for tests and what-ifs.

    A step's forward is ``forward_s + prefill_token_s·prefill tokens +
    decode_row_s·decode rows + kv_token_s·KV tokens read`` (0 when empty);
    MTP drafting is ``draft_token_s·rows·drafts``; copy, apply and sample are
    ``base + per_row·rows`` (0 for no rows).

    >>> FixedGpuCosts(forward_base_s=0.01, decode_row_s=1e-4).forward_s(np.zeros(0), np.zeros(0), 10, 0)
    0.011
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["fixed"] = "fixed"
    forward_base_s: float = Field(0.01, ge=0)
    prefill_token_s: float = Field(0.0, ge=0)
    decode_row_s: float = Field(0.0, ge=0)
    kv_token_s: float = Field(0.0, ge=0)
    draft_token_s: float = Field(0.0, ge=0, description="MTP drafting, per row and drafted token")
    copy_base_s: float = Field(0.0, ge=0)
    copy_row_s: float = Field(0.0, ge=0)
    apply_base_s: float = Field(0.0, ge=0)
    apply_row_s: float = Field(0.0, ge=0)
    sample_base_s: float = Field(0.0, ge=0)
    sample_row_s: float = Field(0.0, ge=0)
    row_bytes: int = Field(0, ge=0, description="bytes of one bitmask row (host costs per byte); 0: none")

    @property
    def mask_row_bytes(self) -> int:
        return self.row_bytes

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        tokens = float(_sum(prefill_chunks))
        if tokens + decode_rows <= 0:
            return 0.0
        return (self.forward_base_s + self.prefill_token_s * tokens + self.decode_row_s * decode_rows
                + self.kv_token_s * decode_kv_tokens)

    def decode_forward_s(self, decode_rows: int, decode_kv_tokens: np.ndarray) -> np.ndarray:
        if decode_rows <= 0:
            return np.zeros(len(decode_kv_tokens))
        return self.forward_base_s + self.decode_row_s * decode_rows + self.kv_token_s * decode_kv_tokens

    def draft_s(self, rows: int, drafts: int, kv_tokens: int) -> float:
        return self.draft_token_s * rows * drafts

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        return self.copy_base_s + self.copy_row_s * mask_rows if mask_rows else 0.0

    def apply_s(self, mask_rows: int) -> float:
        return self.apply_base_s + self.apply_row_s * mask_rows if mask_rows else 0.0

    def sample_s(self, rows: int) -> float:
        return self.sample_base_s + self.sample_row_s * rows if rows else 0.0


class RooflineGpuCosts:
    """GPU costs from the roofline forward model and the measured mask-cost tables.

    Mask and sampling times depend only on a row count; they are memoized per
    count, since the loop asks for the same few counts again and again. A
    decode-only step's forward depends only on its rows and context tokens,
    which repeat too (most steps of a long run meet a pair seen before): it is
    memoized per pair, up to :attr:`DECODE_MEMO` pairs (then started afresh, so
    memory stays bounded however long the run).
    """

    DECODE_MEMO = 1 << 16

    def __init__(self, forward: ForwardCostModel, mask: MaskCost) -> None:
        self.forward, self.mask = forward, mask
        self._decode: dict[tuple[int, int], float] = {}
        self._copy: dict[tuple[int, bool], float] = {}
        self._apply: dict[int, float] = {}
        self._sample: dict[int, float] = {}
        self.mask_row_bytes = bitmask_bytes(1, mask.vocab_size)

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        if not len(prefill_chunks):
            key = (decode_rows, decode_kv_tokens)
            value = self._decode.get(key)
            if value is None:
                if len(self._decode) >= self.DECODE_MEMO:
                    self._decode.clear()
                value = self._decode[key] = self.forward.step_s(0.0, 0.0, decode_rows, decode_kv_tokens, 0)
            return value
        tokens = float(_sum(prefill_chunks))
        pairs = float(attention_pairs(prefill_chunks, prefill_cached).sum())
        return self.forward.step_s(tokens, pairs, decode_rows, decode_kv_tokens, len(prefill_chunks))

    def decode_forward_s(self, decode_rows: int, decode_kv_tokens: np.ndarray) -> np.ndarray:
        memo = self._decode  # (forward_s's: the same values, priced one at a time or together)
        keys = decode_kv_tokens.tolist()
        values = [memo.get((decode_rows, kv)) for kv in keys]
        if None in values:
            missing = [i for i, value in enumerate(values) if value is None]
            if len(memo) + len(missing) > self.DECODE_MEMO:
                memo.clear()
            priced = self.forward.decode_step_s(decode_rows, decode_kv_tokens[missing]).tolist()
            for i, value in zip(missing, priced):
                values[i] = memo[(decode_rows, keys[i])] = value
        return np.array(values)

    def draft_s(self, rows: int, drafts: int, kv_tokens: int) -> float:
        return self.forward.mtp_draft_s(rows, drafts, kv_tokens)

    def copy_s(self, mask_rows: int, pinned: bool) -> float:
        key = (mask_rows, pinned)
        value = self._copy.get(key)
        if value is None:
            value = self._copy[key] = self.mask.copy_s(mask_rows, pinned) if mask_rows else 0.0
        return value

    def apply_s(self, mask_rows: int) -> float:
        value = self._apply.get(mask_rows)
        if value is None:
            value = self._apply[mask_rows] = self.mask.apply_s(mask_rows) if mask_rows else 0.0
        return value

    def sample_s(self, rows: int) -> float:
        value = self._sample.get(rows)
        if value is None:
            value = self._sample[rows] = self.mask.sample_s(rows) if rows else 0.0
        return value


