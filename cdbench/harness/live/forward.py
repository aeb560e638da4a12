"""A live forward step of a dense GQA transformer built from its :class:`ModelSpec`.

The weights are random bf16 (a step's time does not depend on their values):
per layer a fused QKV projection, rotary embeddings, optional per-head
query/key RMSNorm (Qwen3), attention over a KV cache, the output projection and
a gated SiLU MLP; the logits are computed only for the tokens that are sampled
(each decode row and the last token of each prefill chunk), as the engines do.

The KV cache holds one slot per running request, ``[slots, kv_heads, max_len,
head_dim]`` per layer, every layer its own memory, so a step reads exactly the
bytes an engine's cache would. Attention is torch's
``scaled_dot_product_attention`` (flash attention on a Hopper GPU):

- decode rows: one query each; the ``G`` query heads that share a KV head are
  laid out as ``G`` query positions of that head, so the kernel reads each
  cached KV head once for the whole group (what decode kernels do);
- prefill chunks: causal attention aligned to the chunk's end
  (``causal_lower_right``) over the cached prefix and the chunk itself.

Rows of one decode batch whose contexts differ are masked to their own length.
A step of a fixed shape can be captured as a CUDA graph (:meth:`LiveForward.capture`)
and replayed, as engines run their decode batches.

With a :class:`TensorParallel` group the forward is one rank's shard, as
tensor-parallel engines split it: the query and KV heads, the MLP's width and
the output vocabulary divided among the ranks (column-parallel QKV, gate/up
and LM head; row-parallel output and down projections), an all-reduce after
each row-parallel projection (two a layer) and an all-gather of the logits.

Torch only: importing this module needs no GPU; the forward runs on any torch
device (the CPU for tests, at tiny shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cdbench.harness.costs.hardware import ModelSpec, intermediate_size
from cdbench.kernels.decode_attention import decode_attention

ROPE_THETA = 500_000.0  # rotary base; the value only changes the numbers, not the time
NORM_EPS = 1e-6


def check_supported(spec: ModelSpec) -> None:
    """Raise ``ValueError`` naming the model when the live forward cannot build it."""
    if spec.is_moe or spec.attention != "gqa":
        raise ValueError(f"{spec.name}: the live forward builds dense GQA models only "
                         f"(this one is {'MoE' if spec.is_moe else spec.attention})")
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"{spec.name}: n_heads {spec.n_heads} is not a multiple of n_kv_heads {spec.n_kv_heads}")


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group: ``size`` ranks, this one ``rank``, joined in ``group``
    (a ``torch.distributed`` process group: NCCL on GPUs, gloo on the CPU)."""

    size: int
    rank: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def barrier(self, device: torch.device) -> None:
        """Return once every rank has called it: a one-element all-reduce, waited for."""
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=device), group=self.group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, width]`` of every rank, side by side: ``[rows, size * width]`` (rank order)."""
        import torch.distributed as dist

        rows, width = x.shape
        out = torch.empty((self.size * rows, width), device=x.device, dtype=x.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.13)
        gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, rows, width).permute(1, 0, 2).reshape(rows, self.size * width)


def shard(spec: ModelSpec, size: int) -> ModelSpec:
    """One rank's part of ``spec`` under ``size``-way tensor parallelism: heads, KV heads and MLP width
    divided (the embedding is whole; the LM head is divided by :class:`LiveForward`)."""
    if size == 1:
        return spec
    width = intermediate_size(spec)
    for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads), ("intermediate_size", width)):
        if value % size:
            raise ValueError(f"{spec.name}: {name} {value} does not divide among {size} tensor-parallel ranks")
    return spec.model_copy(update={"n_heads": spec.n_heads // size, "n_kv_heads": spec.n_kv_heads // size,
                                   "intermediate_size": width // size})


class KVCapacityError(RuntimeError):
    """A step needs more KV-cache slots, tokens or context than the live cache holds."""


@dataclass(frozen=True)
class PrefillChunk:
    """``new`` prompt tokens of the request in cache ``slot``, after ``cached`` tokens already there."""

    slot: int
    cached: int
    new: int


@dataclass
class KVCache:
    """Per-layer key and value slots, ``[slots, kv_heads, max_len, head_dim]`` each."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, spec: ModelSpec, slots: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> KVCache:
        return KVPool(spec, slots * max_len, device, dtype).cache(slots, max_len)

    @property
    def slots(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def max_len(self) -> int:
        return int(self.k[0].shape[2])

    @staticmethod
    def bytes_per_token(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> int:
        """Cache bytes one token takes over all layers."""
        return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * torch.finfo(dtype).bits // 8


class KVPool:
    """Per-layer cache memory for ``tokens`` tokens, viewed as caches of any slots × length that fit.

    One allocation serves every shape of a calibration grid, so the allocator
    never has to find room for a new cache of another shape.
    """

    def __init__(self, spec: ModelSpec, tokens: int, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.spec, self.tokens = spec, tokens
        size = tokens * spec.n_kv_heads * spec.head_dim
        # Zeroed, not empty: a decode batch reads every row up to the longest
        # context and masks the rest, and a masked position still multiplies its
        # value by a zero weight, so leftover NaN bits there would poison the row.
        self._k = [torch.zeros(size, device=device, dtype=dtype) for _ in range(spec.n_layers)]
        self._v = [torch.zeros(size, device=device, dtype=dtype) for _ in range(spec.n_layers)]

    def cache(self, slots: int, max_len: int) -> KVCache:
        if slots * max_len > self.tokens:
            raise ValueError(f"a cache of {slots} slots x {max_len} tokens does not fit a pool of {self.tokens}")
        shape = (slots, self.spec.n_kv_heads, max_len, self.spec.head_dim)
        n = slots * max_len * self.spec.n_kv_heads * self.spec.head_dim
        return KVCache([t[:n].view(shape) for t in self._k], [t[:n].view(shape) for t in self._v])


@dataclass
class DecodeInputs:
    """The static tensors of a decode batch: a captured graph reads them, so refill them in place."""

    tokens: torch.Tensor     # [rows] int64: the token each row feeds
    positions: torch.Tensor  # [rows] int64: where it goes in its slot (= the row's cached length)
    slots: torch.Tensor      # [rows] int64: the row's cache slot
    attend: int              # keys each row's attention covers (the longest row's positions + 1)
    mask: torch.Tensor | None  # [rows, 1, 1, attend] bool, None when every row attends to ``attend`` keys
    first_slot: int | None   # the rows hold slots first_slot, first_slot + 1, ...: attention reads a view
    lengths: torch.Tensor | None = None  # [rows] keys of each row (per-row attention); None: the dense path


class LiveForward:
    """Random-weight forward of ``spec`` on ``device``; :meth:`step` runs one continuous-batching step.

    With ``tp`` it is that rank's shard (the module doc); ``spec`` is then the shard's shape
    (what the KV cache holds), ``full_spec`` the whole model's.
    """

    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, tp: TensorParallel | None = None) -> None:
        check_supported(spec)
        self.full_spec, self.tp = spec, tp if tp is not None and tp.size > 1 else None
        spec = shard(spec, self.tp.size) if self.tp is not None else spec
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        h, d = spec.hidden_size, spec.head_dim
        self.group = spec.n_heads // spec.n_kv_heads
        self.q_width, self.kv_width = spec.n_heads * d, spec.n_kv_heads * d
        width = intermediate_size(spec)
        # each rank its own random weights (their values do not matter, only their shapes)
        gen = torch.Generator(device=self.device).manual_seed(seed + (self.tp.rank if self.tp else 0))

        def weight(*shape: int) -> torch.Tensor:
            # Small values keep activations finite through many layers; nothing else depends on them.
            return (torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32) * 0.02).to(dtype)

        self.embed = weight(spec.vocab_size, h)
        self.lm_head = weight(h, -(-spec.vocab_size // self.tp.size) if self.tp else spec.vocab_size)
        self.final_norm = torch.ones(h, device=self.device, dtype=dtype)
        self.layers = [
            _Layer(
                attn_norm=torch.ones(h, device=self.device, dtype=dtype),
                qkv=weight(h, self.q_width + 2 * self.kv_width),
                o=weight(self.q_width, h),
                mlp_norm=torch.ones(h, device=self.device, dtype=dtype),
                gate_up=weight(h, 2 * width),
                down=weight(width, h),
                q_norm=torch.ones(d, device=self.device, dtype=dtype) if spec.qk_norm else None,
                k_norm=torch.ones(d, device=self.device, dtype=dtype) if spec.qk_norm else None,
            )
            for _ in range(spec.n_layers)
        ]
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        self._inv_freq = inv_freq

    # ---- inputs -------------------------------------------------------------------------------------------

    def decode_inputs(self, positions: Sequence[int], slots: Sequence[int] | None = None,
                      tokens: Sequence[int] | None = None, per_row: bool = False) -> DecodeInputs:
        """Static decode tensors for rows at ``positions`` (their cached lengths) in ``slots``.

        ``per_row``: each row attends to exactly its own keys through the decode-attention kernel,
        which reads the lengths from a device tensor (so a captured graph serves any lengths, and
        rows may share a slot: a row's drafts are rows of its slot); otherwise dense attention over
        the longest row, masked per row, as in the calibration.
        """
        rows = len(positions)
        slots = range(rows) if slots is None else slots
        tokens = [0] * rows if tokens is None else tokens
        pos = torch.tensor(list(positions), device=self.device, dtype=torch.int64)
        if per_row:
            return DecodeInputs(torch.tensor(list(tokens), device=self.device, dtype=torch.int64), pos,
                                torch.tensor(list(slots), device=self.device, dtype=torch.int64),
                                0, None, None, pos + 1)
        attend = int(max(positions)) + 1 if rows else 0
        mask = None
        if rows and min(positions) != max(positions):
            mask = (torch.arange(attend, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        slots = list(slots)
        first = slots[0] if rows and slots == list(range(slots[0], slots[0] + rows)) else None
        return DecodeInputs(torch.tensor(list(tokens), device=self.device, dtype=torch.int64), pos,
                            torch.tensor(slots, device=self.device, dtype=torch.int64), attend, mask, first)

    # ---- the step -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, cache: KVCache, decode: DecodeInputs | None = None,
             prefill: Sequence[PrefillChunk] = (), prefill_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns the sampled tokens' logits, ``[rows + chunks, vocab]`` (decode rows first).

        ``prefill_tokens`` holds the chunks' token ids back to back (zeros when omitted).
        """
        rows = 0 if decode is None else int(decode.tokens.shape[0])
        n_prefill = sum(c.new for c in prefill)
        if rows + n_prefill == 0:
            raise ValueError("a step needs at least one decode row or prefill token")
        if prefill_tokens is None:
            prefill_tokens = torch.zeros(n_prefill, device=self.device, dtype=torch.int64)
        parts_tok, parts_pos = [], []
        if rows:
            parts_tok.append(decode.tokens)
            parts_pos.append(decode.positions)
        if n_prefill:
            parts_tok.append(prefill_tokens)
            parts_pos.append(torch.cat([torch.arange(c.cached, c.cached + c.new, device=self.device)
                                        for c in prefill]))
        tokens = torch.cat(parts_tok) if len(parts_tok) > 1 else parts_tok[0]
        positions = torch.cat(parts_pos) if len(parts_pos) > 1 else parts_pos[0]
        cos, sin = self._rope(positions)

        x = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(layer, F.rms_norm(x, (x.shape[-1],), layer.attn_norm, NORM_EPS),
                                    cos, sin, cache.k[index], cache.v[index], decode, rows, prefill)
            gate, up = (F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, NORM_EPS) @ layer.gate_up).chunk(2, dim=-1)
            x = x + self._reduce((F.silu(gate) * up) @ layer.down)
        # Logits only for the tokens that are sampled: every decode row, each chunk's last token
        # (slices, so the step reads no host data and a CUDA graph can capture it).
        if prefill:
            ends = [rows + sum(c.new for c in prefill[: i + 1]) for i in range(len(prefill))]
            x = torch.cat(([x[:rows]] if rows else []) + [x[end - 1:end] for end in ends])
        logits = F.rms_norm(x, (x.shape[-1],), self.final_norm, NORM_EPS) @ self.lm_head
        return logits if self.tp is None else self.tp.all_gather_columns(logits)[:, :self.full_spec.vocab_size]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, added over the ranks (nothing to add on one)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return torch.cos(angles).to(self.dtype), torch.sin(angles).to(self.dtype)

    def _attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache_k: torch.Tensor, cache_v: torch.Tensor, decode: DecodeInputs | None, rows: int,
                   prefill: Sequence[PrefillChunk]) -> torch.Tensor:
        spec, d = self.spec, self.spec.head_dim
        q, k, v = (x @ layer.qkv).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = q.view(-1, spec.n_heads, d)
        k = k.view(-1, spec.n_kv_heads, d)
        v = v.view(-1, spec.n_kv_heads, d)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (d,), layer.q_norm, NORM_EPS)
            k = F.rms_norm(k, (d,), layer.k_norm, NORM_EPS)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = []
        if rows:
            # Write each row's new key/value at its position, then attend over the slot.
            cache_k[decode.slots, :, decode.positions] = k[:rows]
            cache_v[decode.slots, :, decode.positions] = v[:rows]
            if decode.lengths is not None:
                o = decode_attention(q[:rows], cache_k, cache_v, decode.slots, decode.lengths)
            else:
                # [rows, kv_heads, group, d]: the query heads sharing a KV head are its query positions.
                q_rows = q[:rows].view(rows, spec.n_kv_heads, self.group, d)
                if decode.first_slot is not None:
                    window = slice(decode.first_slot, decode.first_slot + rows)
                    keys, values = cache_k[window, :, :decode.attend], cache_v[window, :, :decode.attend]
                else:  # scattered slots: gathered copies (a paged kernel would read them in place)
                    keys = cache_k.index_select(0, decode.slots)[:, :, :decode.attend]
                    values = cache_v.index_select(0, decode.slots)[:, :, :decode.attend]
                o = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=decode.mask)
            out.append(o.reshape(rows, self.q_width))
        return self._prefill_attention(layer, q, k, v, cache_k, cache_v, rows, prefill, out)

    def _prefill_attention(self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cache_k: torch.Tensor, cache_v: torch.Tensor, rows: int,
                           prefill: Sequence[PrefillChunk], out: list[torch.Tensor]) -> torch.Tensor:
        """Each prefill chunk's causal attention after the decode rows' (``out``), then the output projection."""
        start = rows
        for chunk in prefill:
            stop = start + chunk.new
            end = chunk.cached + chunk.new
            cache_k[chunk.slot, :, chunk.cached:end] = k[start:stop].transpose(0, 1)
            cache_v[chunk.slot, :, chunk.cached:end] = v[start:stop].transpose(0, 1)
            q_chunk = q[start:stop].transpose(0, 1)[None]  # [1, heads, new, d]
            keys, values = cache_k[chunk.slot, :, :end][None], cache_v[chunk.slot, :, :end][None]
            if chunk.cached == 0:
                o = F.scaled_dot_product_attention(q_chunk, keys, values, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q_chunk, keys, values, enable_gqa=True,
                                                   attn_mask=causal_lower_right(chunk.new, end))
            out.append(o[0].transpose(0, 1).reshape(chunk.new, self.q_width))
            start = stop
        attn = torch.cat(out) if len(out) > 1 else out[0]
        return self._reduce(attn @ layer.o)

    # ---- CUDA graphs --------------------------------------------------------------------------------------

    def capture(self, cache: KVCache, decode: DecodeInputs | None = None, prefill: Sequence[PrefillChunk] = (),
                warmup: int = 2) -> StepGraph:
        """Capture a step of this shape as a CUDA graph (decode rows read ``decode``'s static tensors)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # on a side stream, as torch's graph capture asks
                self.step(cache, decode, prefill)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.step(cache, decode, prefill)
        return StepGraph(graph, decode, logits)


@dataclass
class StepGraph:
    """A captured step: refill ``inputs`` in place, :meth:`replay`, read ``logits``."""

    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs | None
    logits: torch.Tensor

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


@dataclass(frozen=True)
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x`` ``[tokens, heads, d]``."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
