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
_JOINED_PAGES = 8  # a run's forwards over fewer pages are gathered from them joined


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
    which repeat too (most steps of a long run meet a pair seen before, or one near
    it): it is priced a page at a time, the :attr:`DECODE_PAGE` consecutive context
    lengths around the one asked for in one array (the forward model prices each
    value of an array as it prices it alone), and the pages are remembered per
    row count, up to :attr:`DECODE_MEMO` values (then started afresh, so memory
    stays bounded however long the run). A step with prefill chunks is remembered
    by its tokens, their attention pairs, its decode rows and context and its chunk
    count, up to :attr:`PREFILL_MEMO` of them: a prompt alone in its step (SGLang's
    batches without decode rows) is priced once a prompt length.
    """

    DECODE_MEMO = 1 << 20
    DECODE_PAGE = 1 << 8
    PREFILL_MEMO = 1 << 16

    def __init__(self, forward: ForwardCostModel, mask: MaskCost) -> None:
        self.forward, self.mask = forward, mask
        self._pages: dict[tuple[int, int], np.ndarray] = {}  # (rows, context // DECODE_PAGE) -> forwards
        self._prefill: dict[tuple, float] = {}  # (prefill tokens, their pairs, decode rows, context, chunks) -> forward
        self._prefill_one: dict[tuple, float] = {}  # (a lone chunk's tokens, its cached ones, decode rows, context)
        self._copy: dict[tuple[int, bool], float] = {}
        self._apply: dict[int, float] = {}
        self._sample: dict[int, float] = {}
        self.mask_row_bytes = bitmask_bytes(1, mask.vocab_size)

    def forward_s(self, prefill_chunks, prefill_cached, decode_rows, decode_kv_tokens) -> float:
        if not len(prefill_chunks) and isinstance(decode_kv_tokens, int | np.integer):
            if decode_rows <= 0:
                return 0.0
            page = self.DECODE_PAGE
            return float(self._page(decode_rows, int(decode_kv_tokens) // page)[decode_kv_tokens % page])
        one = None
        if len(prefill_chunks) == 1:  # (a prompt alone: by its chunk, no pairs summed)
            one = (int(prefill_chunks[0]), int(prefill_cached[0]), decode_rows, decode_kv_tokens)
            value = self._prefill_one.get(one)
            if value is not None:
                return value
        tokens = float(_sum(prefill_chunks))
        pairs = float(attention_pairs(prefill_chunks, prefill_cached).sum())
        key = (tokens, pairs, decode_rows, decode_kv_tokens, len(prefill_chunks))
        value = self._prefill.get(key)
        if value is None:
            if len(self._prefill) >= self.PREFILL_MEMO:
                self._prefill.clear()
            value = self._prefill[key] = self.forward.step_s(tokens, pairs, decode_rows, decode_kv_tokens,
                                                             len(prefill_chunks))
        if one is not None:
            if len(self._prefill_one) >= self.PREFILL_MEMO:
                self._prefill_one.clear()
            self._prefill_one[one] = value
        return value

    def _page(self, rows: int, page: int) -> np.ndarray:
        """The forwards of decode steps of ``rows`` rows at the context lengths of page ``page``."""
        values = self._pages.get((rows, page))
        if values is None:
            size = self.DECODE_PAGE
            if (len(self._pages) + 1) * size > self.DECODE_MEMO:
                self._pages.clear()
            values = self._pages[(rows, page)] = self.forward.decode_step_s(rows, np.arange(page * size,
                                                                                            (page + 1) * size))
        return values

    def decode_forward_s(self, decode_rows: int, decode_kv_tokens: np.ndarray) -> np.ndarray:
        if decode_rows <= 0 or not len(decode_kv_tokens):
            return np.zeros(len(decode_kv_tokens))
        size = self.DECODE_PAGE
        first, last = int(np.minimum.reduce(decode_kv_tokens)) // size, int(np.maximum.reduce(decode_kv_tokens)) // size
        if first == last:  # (a run's contexts grow step by step: mostly within one page)
            return self._page(decode_rows, first)[decode_kv_tokens - first * size]
        if last - first < _JOINED_PAGES:  # (a few pages: gathered from them joined)
            joined = np.concatenate([self._page(decode_rows, page) for page in range(first, last + 1)])
            return joined[decode_kv_tokens - first * size]
        pages = decode_kv_tokens // size
        out = np.empty(len(decode_kv_tokens))
        for page in np.unique(pages).tolist():
            on = pages == page
            out[on] = self._page(decode_rows, page)[decode_kv_tokens[on] - page * size]
        return out

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


