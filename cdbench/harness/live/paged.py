"""The live forward's paged KV cache: fixed-size blocks, a block table per request, as the engines page it.

Every full-attention layer keeps its keys and values in pages
``[blocks, kv_heads, block_size, head_dim]`` (every layer its own memory, so a
step reads exactly the bytes an engine's cache would). A request is a row of
the block table ``[requests, max_blocks]``: its position ``p`` lives at offset
``p % block_size`` of block ``table[request, p // block_size]``, so its pages
may lie anywhere in the pool (vLLM's ``block_size`` 16 is the default). The
decode-attention kernel and the fused rotary/KV write read the table on the
device, so a captured graph serves any table contents.

A linear-attention layer (hybrid models) keeps a fixed state a request
instead, ``[requests, value_heads, key_dim, value_dim]``, and its convolution's
last inputs ``[requests, channels, kernel - 1]``, indexed by the same request
row (SGLang's state pool, one slot a running request).

:class:`KVPool` owns the pages and hands out blocks (:class:`BlockAllocator`);
:meth:`KVPool.cache` views it as a cache of a fixed shape (the calibration's
grid: every request holding the blocks of a given length, the blocks of
different requests interleaved as an engine's are after a while), and
:class:`PagedRequests` grows requests block by block and frees them at their
end (``live`` mode).

:func:`size_kv_pool` sizes a pool from the GPU's memory as the engines size
their caches (``live`` mode's default): a fraction of the device's memory
(vLLM ``gpu_memory_utilization``, SGLang ``mem_fraction_static``) less what is
in use once the weights and fixed buffers are built, the activation peak of a
profiled largest step and the CUDA graphs' memory; the linear-attention state
of every request row comes out of it first, the rest is pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cdbench.harness.costs.hardware import ModelSpec

BLOCK_SIZE = 16  # tokens a block (vLLM's default block_size)


class KVCapacityError(RuntimeError):
    """A step needs more KV-cache blocks, requests or context than the live cache holds."""


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


@dataclass
class KVCache:
    """The step's view of the cache: per full-attention layer the pages ``k``, ``v``; the block table; per
    linear-attention layer each request's recurrent ``state`` and convolution inputs ``conv`` (empty lists
    unless hybrid)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    block_table: torch.Tensor  # [requests, max_blocks] int32 on the device
    block_size: int
    state: list[torch.Tensor] = field(default_factory=list)
    conv: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def allocate(cls, spec: ModelSpec, slots: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, block_size: int = BLOCK_SIZE) -> KVCache:
        """A cache of ``slots`` requests, each holding the blocks of ``max_len`` tokens."""
        return KVPool(spec, slots * blocks_for(max_len, block_size) * block_size, device, dtype,
                      block_size).cache(slots, max_len)

    @property
    def slots(self) -> int:
        """Requests the block table has rows for."""
        return int(self.block_table.shape[0])

    @property
    def max_len(self) -> int:
        """The longest context a request's row of the table can hold."""
        return int(self.block_table.shape[1]) * self.block_size

    @staticmethod
    def bytes_per_token(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, extra_layers: int = 0) -> int:
        """Cache bytes one token takes over the full-attention layers (and ``extra_layers`` more: an MTP head's)."""
        layers = spec.n_full_attention_layers + extra_layers
        return 2 * layers * spec.n_kv_heads * spec.head_dim * torch.finfo(dtype).bits // 8

    @staticmethod
    def bytes_per_slot(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> int:
        """Fixed bytes one request takes in the linear-attention layers (state and convolution inputs; 0 unless
        hybrid)."""
        size = torch.finfo(dtype).bits // 8
        return int(spec.model_copy(update={"bytes_per_state": size, "bytes_per_kv": size}).state_bytes_per_request())

    def where(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's flat cache position (``block * block_size + offset``) from its request and position,
        on the device (a CUDA graph captures it)."""
        b = self.block_size
        return self.block_table[slots, positions // b].to(torch.int64) * b + positions % b

    def pages(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``slot``'s first ``length`` keys and values of full-attention layer ``layer``, gathered from
        its pages into ``[kv_heads, length, head_dim]`` (a prefill chunk's attention over its cached prefix)."""
        blocks = self.block_table[slot, :blocks_for(length, self.block_size)]
        return tuple(c[blocks].transpose(0, 1).flatten(1, 2)[:, :length] for c in (self.k[layer], self.v[layer]))


@dataclass(frozen=True)
class KVSizing:
    """How a live KV pool was sized from the GPU's memory (:func:`size_kv_pool`; ``live.json``). Bytes."""

    memory_fraction: float     # of the device's memory, for everything the run holds (the policy's kv_memory_fraction)
    total_bytes: int           # the device's memory
    in_use_bytes: int          # in use before the pool: weights, fixed buffers, the CUDA context
    activation_peak_bytes: int  # the profiled largest step's peak above what it started from
    graph_bytes: int           # the CUDA graphs' memory pools, as measured when capturing (0 without graphs)
    state_bytes: int           # the linear-attention state of every request row (0 unless hybrid)
    token_bytes: int           # page bytes of one token: the full-attention layers' and an MTP head's
    tokens: int                # the pool's capacity (whole blocks)


def size_kv_pool(spec: ModelSpec, *, total_bytes: int, memory_fraction: float, in_use_bytes: int,
                 activation_peak_bytes: int, graph_bytes: int, requests: int, max_len: int,
                 block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.bfloat16, extra_layers: int = 0) -> KVSizing:
    """The pool of ``spec``'s cache that ``memory_fraction`` of ``total_bytes`` leaves once ``in_use_bytes``, the
    activation peak and the graphs are taken, and the linear-attention state of ``requests`` rows (pages of
    ``extra_layers`` more full-attention layers a token: an MTP head's), in whole blocks; ``KVCapacityError``
    naming the numbers when it holds no context of ``max_len`` tokens."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    state = requests * KVCache.bytes_per_slot(spec, dtype)
    per_token = KVCache.bytes_per_token(spec, dtype, extra_layers)
    room = int(total_bytes * memory_fraction) - in_use_bytes - activation_peak_bytes - graph_bytes - state
    tokens = max(0, room) // per_token // block_size * block_size
    if tokens < max_len:
        gib = 2**30
        raise KVCapacityError(
            f"{spec.name}: a KV pool of {tokens} tokens holds no context of {max_len}: {memory_fraction:g} of "
            f"{total_bytes / gib:.2f} GiB less {in_use_bytes / gib:.2f} GiB in use (weights, buffers), a "
            f"{activation_peak_bytes / gib:.2f} GiB activation peak, {graph_bytes / gib:.2f} GiB of CUDA graphs "
            f"and {state / gib:.2f} GiB of linear-attention state for {requests} requests leaves "
            f"{room / gib:.2f} GiB at {per_token} bytes a token (raise kv_memory_fraction, lower "
            "max_running_requests or max_batched_tokens, or set costs.live_kv_tokens)")
    return KVSizing(memory_fraction, total_bytes, in_use_bytes, activation_peak_bytes, graph_bytes, state, per_token,
                    tokens)


class BlockAllocator:
    """The pool's free blocks, handed out last freed first (as vLLM's free-block queue does, a request's
    blocks end up scattered over the pool)."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self._free = list(range(blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCapacityError(f"{n} KV blocks asked, {len(self._free)} of {self.blocks} free")
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class KVPool:
    """Pages for ``tokens`` tokens (rounded up to whole blocks) in every full-attention layer, and the
    linear-attention layers' per-request state, grown to the most requests a cache asked for.
    ``extra_layers``: full-attention layers beyond the model's, after them (an MTP head's, which engines
    page beside the model's when they draft with it).

    One allocation serves every shape of a calibration grid, so the allocator never has to find room
    for a new cache of another shape.
    """

    def __init__(self, spec: ModelSpec, tokens: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16, block_size: int = BLOCK_SIZE, extra_layers: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.spec, self.block_size = spec, block_size
        self.device, self.dtype = torch.device(device), dtype
        self.blocks = blocks_for(tokens, block_size)
        shape = (self.blocks, spec.n_kv_heads, block_size, spec.head_dim)
        # Zeroed, not empty: a key block is read whole and masked past a row's length, and a masked
        # position still multiplies its value by a zero weight, so leftover NaN bits would poison the row.
        full = spec.n_full_attention_layers + extra_layers
        self.k = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(full)]
        self.v = [torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(full)]
        self._state: list[torch.Tensor] = []
        self._conv: list[torch.Tensor] = []

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (whole blocks)."""
        return self.blocks * self.block_size

    def blocks_needed(self, slots: int, max_len: int) -> int:
        return slots * blocks_for(max_len, self.block_size)

    def cache(self, slots: int, max_len: int) -> KVCache:
        """A cache of ``slots`` requests each holding the blocks of ``max_len`` tokens: request ``r``'s
        ``j``-th block is ``j * slots + r`` (interleaved, as an engine's pages are after requests came and went)."""
        per = blocks_for(max_len, self.block_size)
        if slots * per > self.blocks:
            raise ValueError(f"a cache of {slots} requests x {max_len} tokens ({slots * per} blocks of "
                             f"{self.block_size}) does not fit a pool of {self.blocks} blocks")
        table = (torch.arange(per, device=self.device, dtype=torch.int32)[None, :] * slots
                 + torch.arange(slots, device=self.device, dtype=torch.int32)[:, None])
        return self._view(table)

    def empty_cache(self, slots: int, max_len: int) -> KVCache:
        """A cache of ``slots`` request rows of ``max_len`` tokens and no block given out yet
        (:class:`PagedRequests` fills the table)."""
        return self._view(torch.zeros((slots, blocks_for(max_len, self.block_size)), device=self.device,
                                      dtype=torch.int32))

    def _view(self, table: torch.Tensor) -> KVCache:
        slots, m = table.shape[0], self.spec
        if m.n_linear_layers and (not self._state or self._state[0].shape[0] < slots):
            channels = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
            state = (slots, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim)
            self._state = [torch.zeros(state, device=self.device, dtype=self.dtype) for _ in range(m.n_linear_layers)]
            self._conv = [torch.zeros((slots, channels, m.linear_conv_kernel_dim - 1), device=self.device,
                                      dtype=self.dtype) for _ in range(m.n_linear_layers)]
        return KVCache(self.k, self.v, table, self.block_size, [t[:slots] for t in self._state],
                       [t[:slots] for t in self._conv])


class PagedRequests:
    """Requests of a run in a paged cache: each takes a free row of the block table when it first runs,
    a block whenever its context grows past its last one, and gives both back at its end.

    The table on the device is updated by one small copy a step, of the entries that changed.
    """

    def __init__(self, pool: KVPool, requests: int, max_len: int) -> None:
        self.pool, self.max_len = pool, max_len
        self.cache = pool.empty_cache(requests, max_len)
        self.allocator = BlockAllocator(pool.blocks)
        self._rows: dict[int, int] = {}  # request id -> its row of the table
        self._blocks: dict[int, list[int]] = {}  # request id -> its blocks, in order
        self._free_rows = list(range(requests - 1, -1, -1))
        self._changed: list[tuple[int, int, int]] = []  # (row, column, block) not yet on the device

    @property
    def running(self) -> int:
        return len(self._rows)

    def rows(self, rids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Each request's row of the table, with blocks for ``tokens`` tokens of context (allocated as needed)."""
        out = np.empty(len(rids), np.int64)
        b = self.pool.block_size
        for i, (rid, n) in enumerate(zip(rids.tolist(), tokens.tolist(), strict=True)):
            row = self._rows.get(rid)
            if row is None:
                if not self._free_rows:
                    raise KVCapacityError(f"request {rid}: all {self.cache.slots} rows of the live KV cache's "
                                          "block table are taken")
                row = self._rows[rid] = self._free_rows.pop()
                self._blocks[rid] = []
            if n > self.max_len:
                raise KVCapacityError(f"request {rid}: a context of {n} tokens; the live KV cache's block table "
                                      f"holds {self.max_len}")
            held = self._blocks[rid]
            more = blocks_for(n, b) - len(held)
            if more > 0:
                new = self.allocator.allocate(more)
                self._changed += [(row, len(held) + j, block) for j, block in enumerate(new)]
                held += new
            out[i] = row
        return out

    def release(self, rids) -> None:
        """The requests ``rids`` ended (or lost their KV): their blocks and rows are free."""
        for rid in rids:
            row = self._rows.pop(rid, None)
            if row is None:
                continue
            self.allocator.release(self._blocks.pop(rid))
            self._free_rows.append(row)

    def keep_only(self, running: np.ndarray) -> None:
        """Release every request not in ``running`` (the engine's running batch)."""
        gone = self._rows.keys() - set(running.tolist())
        if gone:
            self.release(sorted(gone))

    def flush(self) -> None:
        """Copy the table entries that changed to the device (before the step that reads them)."""
        if not self._changed:
            return
        index = torch.tensor(self._changed, dtype=torch.int64)
        table = self.cache.block_table
        table[index[:, 0].to(table.device), index[:, 1].to(table.device)] = index[:, 2].to(table.device,
                                                                                             torch.int32)
        self._changed = []
