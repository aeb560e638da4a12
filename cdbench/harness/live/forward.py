"""A live forward step of a GQA transformer built from its :class:`ModelSpec`: dense, MoE or hybrid.

The weights are random bf16 (a step's time does not depend on their values):
per layer a fused QKV projection, rotary embeddings, optional per-head
query/key RMSNorm (Qwen3), attention over a KV cache, the output projection and
a gated SiLU MLP; the logits are computed only for the tokens that are sampled
(each decode row and the last token of each prefill chunk), as the engines do.

A mixture of experts replaces the MLP with routed experts run as grouped GEMMs
and an optional gated shared expert (:mod:`.experts`). A hybrid model
(Qwen3-Next, Qwen3.5) makes the layers that are not full attention Gated
DeltaNet layers (:mod:`.deltanet`): a fused projection to queries, keys, values,
the output gate ``z`` and the per-head ``beta`` and decay inputs; a short causal
convolution over the queries, keys and values (its last inputs kept per
request); the gated delta rule over a per-request state (the batched recurrent
step for decode rows, the chunked form for prefill chunks: with
flash-linear-attention's kernels on a GPU where the ``fla`` package imports,
the torch forms otherwise); a gated RMSNorm and the output projection. Its
full-attention layers may gate their output (``attention_output_gate``: a
sigmoid of a second query-sized projection). Rotary embeddings span the whole
head (Qwen3.5 rotates a quarter of it: the same kernels, the time unchanged).

The KV cache is paged (:mod:`.paged`): per full-attention layer, blocks of
``block_size`` tokens ``[blocks, kv_heads, block_size, head_dim]``, every layer
its own memory, so a step reads exactly the bytes an engine's cache would; a
request (decode row or prefill chunk) names its row of the block table. Per
layer, one fused kernel (:func:`~cdbench.kernels.rotary_kv.rotary_kv_write`)
applies Qwen3's per-head query/key RMSNorm and the rotary embedding to the
queries and keys and writes the keys and values into their pages, as the
engines' fused kernels do. Attention:

- decode rows: the paged decode-attention kernel
  (:func:`~cdbench.kernels.decode_attention.decode_attention`), each row over
  exactly its own keys through the block table (``per_row``, what ``live`` mode
  runs); or, for comparison, torch's ``scaled_dot_product_attention`` over the
  rows' pages gathered up to the longest row and masked per row (the ``G``
  query heads that share a KV head laid out as ``G`` query positions of it);
- prefill chunks: torch's ``scaled_dot_product_attention`` (flash attention on a
  Hopper GPU), causal, over the chunk's own keys, or aligned to the chunk's end
  (``causal_lower_right``) over its cached prefix gathered from its pages and
  the chunk.

A step of a fixed shape can be captured as a CUDA graph (:meth:`LiveForward.capture`)
and replayed, as engines run their decode batches: the decode rows' tokens,
positions, requests and lengths and the block table are device tensors a
replay reads.

With a :class:`TensorParallel` group the forward of a dense model is one rank's shard, as
tensor-parallel engines split it: the query and KV heads, the MLP's width and
the output vocabulary divided among the ranks (column-parallel QKV, gate/up
and LM head; row-parallel output and down projections), an all-reduce after
each row-parallel projection (two a layer) and an all-gather of the logits.

Torch only: importing this module needs no GPU; the forward runs on any torch
device (the CPU for tests, at tiny shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cdbench.harness.costs.hardware import ModelSpec, intermediate_size
from cdbench.harness.live import deltanet
from cdbench.harness.live.experts import (
    fused_experts,
    grouped_experts,
    route,
    shared_expert,
)
from cdbench.harness.live.paged import KVCache
from cdbench.kernels.decode_attention import decode_attention, lpt_order
from cdbench.kernels.layer_ops import add_rms_norm, silu_and_mul
from cdbench.kernels.rotary_kv import rotary_kv_write

ROPE_THETA = 500_000.0  # rotary base; the value only changes the numbers, not the time
NORM_EPS = 1e-6
SPREAD = 7919  # a prime stride through the vocabulary (request_tokens)
SLOT_SPREAD = 104_729  # another prime: each table row's token sequence starts elsewhere (request_tokens)
LINEAR_CHUNK = 64  # the chunked gated delta rule's chunk (flash-linear-attention's)


def check_supported(spec: ModelSpec) -> None:
    """Raise ``ValueError`` naming the model when the live forward cannot build it."""
    if spec.attention != "gqa":
        raise ValueError(f"{spec.name}: the live forward builds GQA models only (this one is {spec.attention})")
    if spec.n_heads % spec.n_kv_heads:
        raise ValueError(f"{spec.name}: n_heads {spec.n_heads} is not a multiple of n_kv_heads {spec.n_kv_heads}")
    if spec.is_moe and spec.moe_intermediate_size is None:
        raise ValueError(f"{spec.name}: the live forward of a MoE needs moe_intermediate_size")


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
    if spec.is_moe or spec.is_hybrid:
        raise ValueError(f"{spec.name}: the live forward shards dense models only over tensor-parallel ranks")
    width = intermediate_size(spec)
    for name, value in (("n_heads", spec.n_heads), ("n_kv_heads", spec.n_kv_heads), ("intermediate_size", width)):
        if value % size:
            raise ValueError(f"{spec.name}: {name} {value} does not divide among {size} tensor-parallel ranks")
    return spec.model_copy(update={"n_heads": spec.n_heads // size, "n_kv_heads": spec.n_kv_heads // size,
                                   "intermediate_size": width // size})


def request_tokens(slots: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token id at each ``positions`` of the request in table row ``slots``: the ids a step feeds when
    it is given none, computed on the device (a captured graph derives them from its refilled inputs).

    Each request its own sequence, as an engine feeds each row its own sampled token and each prompt its
    own text: with one sequence for every request (or one id per batch row, every step) the requests'
    contexts would be alike, their hidden states would converge and a MoE would route every row to the
    same few experts, reading a fraction of the weights a real batch reads.
    """
    return ((slots + 1) * SLOT_SPREAD + positions * SPREAD + 1) % vocab_size


@dataclass(frozen=True)
class PrefillChunk:
    """``new`` prompt tokens of the request in row ``slot`` of the cache's block table, after ``cached`` tokens
    already there."""

    slot: int
    cached: int
    new: int


@dataclass
class DecodeInputs:
    """The static tensors of a decode batch: a captured graph reads them, so refill them in place."""

    tokens: torch.Tensor | None  # [rows] int64: the token each row feeds; None: its request's (request_tokens)
    positions: torch.Tensor  # [rows] int64: its position in its request (= the row's cached length)
    slots: torch.Tensor      # [rows] int64: the row's request (its row of the block table and linear state)
    attend: int              # keys each row's attention covers (the longest row's positions + 1)
    mask: torch.Tensor | None  # [rows, 1, 1, attend] bool, None when every row attends to ``attend`` keys
    lengths: torch.Tensor | None = None  # [rows] keys of each row (per-row attention); None: the dense path


@dataclass
class DraftInputs:
    """The static tensors of an MTP head's drafting: one row a drafting request; refill them in place."""

    tokens: torch.Tensor | None  # [rows] int64: the first pass's input token; None: its request's (request_tokens)
    hidden: torch.Tensor     # [rows, hidden]: its last hidden state, the first pass's other input
    slots: torch.Tensor      # [rows] int64: its row of the block table
    positions: torch.Tensor  # [rows] int64: the first draft's position


class LiveForward:
    """Random-weight forward of ``spec`` on ``device``; :meth:`step` runs one continuous-batching step.

    With ``tp`` it is that rank's shard (the module doc); ``spec`` is then the shard's shape
    (what the KV cache holds), ``full_spec`` the whole model's.

    ``balance_decode``: per-row decode attention launches its rows longest first (sorted once a
    step, on the device; :mod:`cdbench.kernels.decode_attention`); False keeps the row order
    (benchmarks compare the two). Read when a step runs or is captured.

    ``moe_kernels``: a MoE's routed experts as torch's grouped GEMMs (``"grouped_mm"``) or vLLM's
    fused layout (``"fused"``, :func:`~.experts.fused_experts`; ``benchmarks/live_step_kernels.py``
    compares the two).

    ``mtp``: also build the model's multi-token-prediction head (``spec.mtp_layers`` decoder layers after a
    projection of the embedded token and the hidden state, sharing the embedding, final norm and LM head,
    as DeepSeek-V3's and Qwen3.5's MTP modules are), which :meth:`draft` runs; its layers' KV pages are the
    cache's full-attention layers after the model's (``KVPool(extra_layers=spec.mtp_layers)``).
    """

    def __init__(self, spec: ModelSpec, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0, tp: TensorParallel | None = None, linear_kernels: str = "auto",
                 balance_decode: bool = True, moe_kernels: str = "grouped_mm", mtp: bool = False) -> None:
        self.balance_decode = balance_decode
        check_supported(spec)
        if moe_kernels not in ("grouped_mm", "fused"):
            raise ValueError(f"moe_kernels must be grouped_mm or fused, got {moe_kernels!r}")
        self._experts = fused_experts if moe_kernels == "fused" else grouped_experts
        if linear_kernels not in ("auto", "torch", "fla"):
            raise ValueError(f"linear_kernels must be auto, torch or fla, got {linear_kernels!r}")
        self.full_spec, self.tp = spec, tp if tp is not None and tp.size > 1 else None
        spec = shard(spec, self.tp.size) if self.tp is not None else spec
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        # the Gated DeltaNet kernels: flash-linear-attention's on a GPU where it imports ("auto"), else torch's
        self._fla = None
        if spec.is_hybrid and linear_kernels != "torch" and self.device.type == "cuda":
            self._fla = deltanet.fla_kernels()
        if linear_kernels == "fla" and self._fla is None:
            raise ValueError("linear_kernels 'fla' needs a CUDA device and the flash-linear-attention package")
        self.linear_kernels = "fla" if self._fla is not None else "torch"
        h, d = spec.hidden_size, spec.head_dim
        self.group = spec.n_heads // spec.n_kv_heads
        self.q_width, self.kv_width = spec.n_heads * d, spec.n_kv_heads * d
        self.gate_width = self.q_width if spec.attention_output_gate else 0
        width = intermediate_size(spec) if not spec.is_moe else 0
        # each rank its own random weights (their values do not matter, only their shapes)
        gen = torch.Generator(device=self.device).manual_seed(seed + (self.tp.rank if self.tp else 0))

        def weight(*shape: int) -> torch.Tensor:
            # Small values keep activations finite through many layers; nothing else depends on them.
            return (torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32) * 0.02).to(dtype)

        self.embed = weight(spec.vocab_size, h)
        self.lm_head = weight(h, -(-spec.vocab_size // self.tp.size) if self.tp else spec.vocab_size)
        self.final_norm = torch.ones(h, device=self.device, dtype=dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=dtype)

        def moe() -> _Moe | None:
            if not spec.is_moe:
                return None
            e, w, s = spec.n_experts, spec.moe_intermediate_size, spec.shared_expert_intermediate_size
            return _Moe(router=weight(h, e), gate_up=weight(e, h, 2 * w), down=weight(e, w, h),
                        shared_gate_up=weight(h, 2 * s) if s else None, shared_down=weight(s, h) if s else None,
                        shared_gate=weight(h, 1) if s else None)

        def linear() -> _Linear:
            hk, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
            dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
            channels = 2 * hk * dk + hv * dv
            return _Linear(qkvz=weight(h, channels + hv * dv), ba=weight(h, 2 * hv),
                           conv=weight(channels, spec.linear_conv_kernel_dim),
                           a_log=torch.zeros(hv, device=self.device, dtype=torch.float32),
                           dt_bias=torch.ones(hv, device=self.device, dtype=torch.float32),
                           norm=ones(dv), out=weight(hv * dv, h))

        def layer(full: bool, cache_index: int) -> _Layer:
            return _Layer(
                attn_norm=ones(h),
                qkv=weight(h, self.q_width + self.gate_width + 2 * self.kv_width) if full else None,
                o=weight(self.q_width, h) if full else None,
                mlp_norm=ones(h),
                gate_up=weight(h, 2 * width) if width else None,
                down=weight(width, h) if width else None,
                q_norm=ones(d) if spec.qk_norm and full else None,
                k_norm=ones(d) if spec.qk_norm and full else None,
                cache_index=cache_index,
                linear=None if full else linear(),
                moe=moe(),
            )

        self.layers = []
        full_index = linear_index = 0
        for index in range(spec.n_layers):
            full = spec.is_full_attention(index)
            self.layers.append(layer(full, full_index if full else linear_index))
            full_index, linear_index = full_index + full, linear_index + (not full)
        # the MTP head: its layers are full attention, paged after the model's own
        if mtp and not spec.mtp_layers:
            raise ValueError(f"{spec.name} has no MTP layer (mtp_layers = 0) to draft with")
        self.mtp_layers = [layer(True, full_index + j) for j in range(spec.mtp_layers)] if mtp else []
        self.mtp_fc = weight(2 * h, h) if mtp else None  # [embedded token; hidden state] -> hidden
        self.mtp_norms = (ones(h), ones(h)) if mtp else None
        self._warmup_stream: torch.cuda.Stream | None = None  # the captures' warm-up stream (_capture)
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        self._inv_freq = inv_freq

    # ---- inputs -------------------------------------------------------------------------------------------

    def decode_inputs(self, positions: Sequence[int], slots: Sequence[int] | None = None,
                      tokens: Sequence[int] | None = None, per_row: bool = False) -> DecodeInputs:
        """Static decode tensors for rows at ``positions`` (their cached lengths) in ``slots``.

        ``per_row``: each row attends to exactly its own keys through the paged decode-attention
        kernel, which reads the lengths from a device tensor (so a captured graph serves any lengths,
        and rows may share a request: a row's drafts are rows of its request); otherwise dense
        attention over the rows' pages gathered up to the longest row, masked per row.
        """
        rows = len(positions)
        slots = range(rows) if slots is None else slots
        token_ids = None if tokens is None else torch.tensor(list(tokens), device=self.device, dtype=torch.int64)
        pos = torch.tensor(list(positions), device=self.device, dtype=torch.int64)
        slot_ids = torch.tensor(list(slots), device=self.device, dtype=torch.int64)
        if per_row:
            return DecodeInputs(token_ids, pos, slot_ids, 0, None, pos + 1)
        attend = int(max(positions)) + 1 if rows else 0
        mask = None
        if rows and min(positions) != max(positions):
            mask = (torch.arange(attend, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        return DecodeInputs(token_ids, pos, slot_ids, attend, mask)

    # ---- the step -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, cache: KVCache, decode: DecodeInputs | None = None,
             prefill: Sequence[PrefillChunk] = (), prefill_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns the sampled tokens' logits, ``[rows + chunks, vocab]`` (decode rows first).

        ``prefill_tokens`` holds the chunks' token ids back to back (each request's own,
        :func:`request_tokens`, when omitted; so are the decode rows' when ``decode.tokens`` is ``None``).
        """
        rows = 0 if decode is None else int(decode.positions.shape[0])
        n_prefill = sum(c.new for c in prefill)
        if rows + n_prefill == 0:
            raise ValueError("a step needs at least one decode row or prefill token")
        parts_pos, parts_slot = [], []
        if rows:
            parts_pos.append(decode.positions)
            parts_slot.append(decode.slots)
        if n_prefill:
            parts_pos += [torch.arange(c.cached, c.cached + c.new, device=self.device) for c in prefill]
            parts_slot += [torch.full((c.new,), c.slot, device=self.device, dtype=torch.int64) for c in prefill]
        positions = torch.cat(parts_pos) if len(parts_pos) > 1 else parts_pos[0]
        token_slots = torch.cat(parts_slot) if len(parts_slot) > 1 else parts_slot[0]
        tokens = request_tokens(token_slots, positions, self.spec.vocab_size)
        if rows and decode.tokens is not None:
            tokens[:rows] = decode.tokens
        if n_prefill and prefill_tokens is not None:
            tokens[rows:] = prefill_tokens
        cos, sin = self._rope(positions)
        # every token's page and offset, once for all layers (the fused rotary kernel writes k and v there)
        where = cache.where(token_slots, positions) if cache.k else None

        # the per-row decode kernel's launch order, sorted once for every layer
        order = lpt_order(decode.lengths) if rows and decode.lengths is not None and self.balance_decode else None
        def mixer(layer: _Layer, normed: torch.Tensor) -> torch.Tensor:
            i = layer.cache_index
            if layer.linear is None:
                return self._attention(layer, normed, cos, sin, cache, i, where, decode, rows, prefill, order)
            return self._linear_attention(layer.linear, normed, cache.state[i], cache.conv[i], decode, rows, prefill)

        normed, _ = self._decoder(self.layers, F.embedding(tokens, self.embed), mixer)
        # Logits only for the tokens that are sampled: every decode row, each chunk's last token
        # (slices, so the step reads no host data and a CUDA graph can capture it).
        if prefill:
            ends = [rows + sum(c.new for c in prefill[: i + 1]) for i in range(len(prefill))]
            normed = torch.cat(([normed[:rows]] if rows else []) + [normed[end - 1:end] for end in ends])
        logits = normed @ self.lm_head
        return logits if self.tp is None else self.tp.all_gather_columns(logits)[:, :self.full_spec.vocab_size]

    def _decoder(self, layers: Sequence[_Layer], residual: torch.Tensor,
                 mixer: Callable[[_Layer, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers`` over the residual stream ``residual`` (changed in place): each layer's token mixer
        ``mixer(layer, normed)`` and FFN, each output added to the stream and the sum normalized by the next
        norm in one kernel (:func:`~cdbench.kernels.layer_ops.add_rms_norm`, the engines' fused add + RMSNorm).
        Returns the stream after the final norm, and the stream."""
        normed, _ = add_rms_norm(residual, layers[0].attn_norm, NORM_EPS)
        for index, layer in enumerate(layers):
            normed, residual = add_rms_norm(residual, layer.mlp_norm, NORM_EPS, mixer(layer, normed))
            following = layers[index + 1].attn_norm if index + 1 < len(layers) else self.final_norm
            normed, residual = add_rms_norm(residual, following, NORM_EPS, self._ffn(layer, normed))
        return normed, residual

    def _ffn(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The dense gated MLP, or the routed experts and the shared expert."""
        if layer.moe is None:
            return self._reduce(silu_and_mul(x @ layer.gate_up) @ layer.down)
        moe = layer.moe
        weights, ids = route(x, moe.router, self.spec.experts_per_token)
        out = self._experts(x, weights, ids, moe.gate_up, moe.down)
        if moe.shared_gate_up is not None:
            out = out + shared_expert(x, moe.shared_gate_up, moe.shared_down, moe.shared_gate)
        return out

    def _linear_attention(self, lin: _Linear, x: torch.Tensor, state: torch.Tensor, conv: torch.Tensor,
                          decode: DecodeInputs | None, rows: int, prefill: Sequence[PrefillChunk]) -> torch.Tensor:
        """A Gated DeltaNet layer over the step's tokens (decode rows first, then the prefill chunks).

        Each decode row steps its slot's state and convolution inputs by one token (rows sharing a
        slot each step from the slot's state: a row's drafts verify in one pass); each prefill chunk
        continues its slot's (a chunk with nothing cached starts from zeros).
        """
        spec = self.spec
        hk, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
        dk, dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        channels, keep = 2 * hk * dk + hv * dv, spec.linear_conv_kernel_dim - 1
        mixed, z = (x @ lin.qkvz).split([channels, hv * dv], dim=-1)
        b, a = (x @ lin.ba).chunk(2, dim=-1)
        conv_out = []
        if rows:
            window = torch.cat([conv[decode.slots], mixed[:rows, :, None]], dim=-1)  # [rows, channels, kernel]
            conv_out.append((window * lin.conv).sum(-1))
            conv[decode.slots] = window[..., 1:]
        start = rows
        for chunk in prefill:
            stop = start + chunk.new
            head = conv[chunk.slot] if chunk.cached else torch.zeros_like(conv[chunk.slot])
            seq = torch.cat([head, mixed[start:stop].T], dim=-1)  # [channels, kernel - 1 + new]
            conv_out.append(F.conv1d(seq[None], lin.conv[:, None, :], groups=channels)[0].T)
            conv[chunk.slot] = seq[:, seq.shape[1] - keep:]
            start = stop
        mixed = F.silu(torch.cat(conv_out) if len(conv_out) > 1 else conv_out[0])
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = deltanet.expand_heads(deltanet.l2_normalize(q.reshape(-1, hk, dk)), hv)
        k = deltanet.expand_heads(deltanet.l2_normalize(k.reshape(-1, hk, dk)), hv)
        v = v.reshape(-1, hv, dv)
        beta = torch.sigmoid(b.float())
        g = -lin.a_log.exp() * F.softplus(a.float() + lin.dt_bias)  # log decay per token and value head
        if self._fla is not None:
            o = self._fla_delta_rule(q.to(x.dtype), k.to(x.dtype), v, g, beta, state, decode, rows, prefill)
        else:
            o = self._torch_delta_rule(q, k, v, g, beta, state, decode, rows, prefill)
        o = F.rms_norm(o.to(x.dtype), (dv,), lin.norm, NORM_EPS) * F.silu(z.reshape(-1, hv, dv))
        return o.reshape(-1, hv * dv) @ lin.out

    def _torch_delta_rule(self, q, k, v, g, beta, state, decode, rows, prefill) -> torch.Tensor:
        """The gated delta rule in torch: the batched recurrent step for the decode rows, each chunk's chunked form."""
        out = []
        if rows:
            o, new = deltanet.decode_gated_delta_rule(q[:rows], k[:rows], v[:rows], g[:rows], beta[:rows],
                                                      state[decode.slots])
            state[decode.slots] = new.to(state.dtype)
            out.append(o)
        start = rows
        for chunk in prefill:
            stop = start + chunk.new
            first = state[chunk.slot] if chunk.cached else torch.zeros_like(state[chunk.slot])
            o, last = deltanet.chunk_gated_delta_rule(q[start:stop], k[start:stop], v[start:stop], g[start:stop],
                                                      beta[start:stop], first, chunk=LINEAR_CHUNK)
            state[chunk.slot] = last.to(state.dtype)
            out.append(o)
            start = stop
        return torch.cat(out) if len(out) > 1 else out[0]

    def _fla_delta_rule(self, q, k, v, g, beta, state, decode, rows, prefill) -> torch.Tensor:
        """The gated delta rule with flash-linear-attention's kernels: the decode rows as a batch of one-token
        sequences through the fused recurrent kernel, each prefill chunk through the chunked kernel (one call a
        chunk, as the torch path: no host data, so a CUDA graph can capture it); states in float32."""
        chunk_kernel, recurrent_kernel = self._fla
        scale = self.spec.linear_key_head_dim ** -0.5
        out = []
        if rows:
            # by keyword: fla's recurrent kernel takes other gates (gk, gv) between g and beta
            o, new = recurrent_kernel(q[:rows, None], k[:rows, None], v[:rows, None], g=g[:rows, None],
                                      beta=beta[:rows, None], scale=scale, initial_state=state[decode.slots].float(),
                                      output_final_state=True)
            state[decode.slots] = new.to(state.dtype)
            out.append(o[:, 0])
        start = rows
        for chunk in prefill:
            stop = start + chunk.new
            first = state[chunk.slot][None].float() if chunk.cached else None
            o, last = chunk_kernel(q[None, start:stop], k[None, start:stop], v[None, start:stop], g=g[None, start:stop],
                                   beta=beta[None, start:stop], scale=scale, initial_state=first,
                                   output_final_state=True)
            state[chunk.slot] = last[0].to(state.dtype)
            out.append(o[0])
            start = stop
        return torch.cat(out) if len(out) > 1 else out[0]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial sums, added over the ranks (nothing to add on one)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return torch.cos(angles).to(self.dtype), torch.sin(angles).to(self.dtype)

    def _attention(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                   i: int, where: torch.Tensor, decode: DecodeInputs | None, rows: int,
                   prefill: Sequence[PrefillChunk], order: torch.Tensor | None) -> torch.Tensor:
        spec, d = self.spec, self.spec.head_dim
        q, gate, k, v = (x @ layer.qkv).split([self.q_width, self.gate_width, self.kv_width, self.kv_width], dim=-1)
        q = q.view(-1, spec.n_heads, d)
        k = k.view(-1, spec.n_kv_heads, d)
        v = v.view(-1, spec.n_kv_heads, d)
        # one kernel: q/k norm (Qwen3), the rotary of q and k in place, k and v into their pages
        rotary_kv_write(q, k, v, cos, sin, cache.k[i], cache.v[i], where, layer.q_norm, layer.k_norm, NORM_EPS)
        out = []
        if rows:
            if decode.lengths is not None:
                o = decode_attention(q[:rows], cache.k[i], cache.v[i], decode.slots, decode.lengths,
                                     balance=self.balance_decode, order=order, block_table=cache.block_table)
            else:
                # [rows, kv_heads, group, d]: the query heads sharing a KV head are its query positions.
                q_rows = q[:rows].view(rows, spec.n_kv_heads, self.group, d)
                # the rows' pages gathered up to the longest row: [rows, kv_heads, attend, d]
                blocks = cache.block_table[decode.slots, :-(-decode.attend // cache.block_size)]
                keys, values = (c[blocks].transpose(1, 2).flatten(2, 3)[:, :, :decode.attend]
                                for c in (cache.k[i], cache.v[i]))
                o = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=decode.mask)
            out.append(o.reshape(rows, self.q_width))
        start = rows
        for chunk in prefill:
            stop = start + chunk.new
            q_chunk = q[start:stop].transpose(0, 1)[None]  # [1, heads, new, d]
            if chunk.cached == 0:  # the chunk's own keys, as written to its pages
                keys, values = k[start:stop].transpose(0, 1)[None], v[start:stop].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q_chunk, keys, values, is_causal=True, enable_gqa=True)
            else:
                end = chunk.cached + chunk.new
                keys, values = cache.pages(i, chunk.slot, end)
                o = F.scaled_dot_product_attention(q_chunk, keys[None], values[None], enable_gqa=True,
                                                   attn_mask=causal_lower_right(chunk.new, end))
            out.append(o[0].transpose(0, 1).reshape(chunk.new, self.q_width))
            start = stop
        attn = torch.cat(out) if len(out) > 1 else out[0]
        if self.gate_width:
            attn = attn * torch.sigmoid(gate)
        return self._reduce(attn @ layer.o)

    # ---- MTP drafting -------------------------------------------------------------------------------------

    def draft_inputs(self, positions: Sequence[int], slots: Sequence[int]) -> DraftInputs:
        """Static drafting tensors for requests in table rows ``slots`` whose first draft goes at ``positions``
        (the first token each request's own, :func:`request_tokens` at the draft's position, derived in the pass
        so that a captured graph follows its refilled slots; a hidden state of fixed values: its shape is what
        matters to the passes' time)."""
        rows = len(positions)
        gen = torch.Generator(device=self.device).manual_seed(rows)
        hidden = (torch.randn((rows, self.spec.hidden_size), generator=gen, device=self.device) * 0.02).to(self.dtype)
        return DraftInputs(None, hidden, torch.tensor(list(slots), device=self.device, dtype=torch.int64),
                           torch.tensor(list(positions), device=self.device, dtype=torch.int64))

    @torch.inference_mode()
    def draft(self, cache: KVCache, draft: DraftInputs, passes: int) -> torch.Tensor:
        """Run the MTP head ``passes`` times over the drafting rows, as an engine drafts ``passes`` tokens
        after a verification step: each pass embeds the previous pass's greedy token, projects it with the
        previous hidden state, runs the head's layers (their keys and values written at the pass's position,
        attending to the request's keys there) and the LM head. Returns the last pass's logits."""
        if not self.mtp_layers:
            raise ValueError("this forward has no MTP head (build it with mtp=True)")
        h = self.spec.hidden_size
        hidden = draft.hidden
        tokens = request_tokens(draft.slots, draft.positions, self.spec.vocab_size) if draft.tokens is None \
            else draft.tokens
        rows = int(tokens.shape[0])
        enorm, hnorm = self.mtp_norms
        logits = None
        for j in range(passes):
            positions = draft.positions + j
            inputs = DecodeInputs(tokens, positions, draft.slots, 0, None, positions + 1)
            cos, sin = self._rope(positions)
            where = cache.where(draft.slots, positions)
            order = lpt_order(inputs.lengths) if self.balance_decode else None
            x = torch.cat([F.rms_norm(F.embedding(tokens, self.embed), (h,), enorm, NORM_EPS),
                           F.rms_norm(hidden, (h,), hnorm, NORM_EPS)], dim=-1) @ self.mtp_fc
            normed, hidden = self._decoder(
                self.mtp_layers, x, lambda layer, normed: self._attention(
                    layer, normed, cos, sin, cache, layer.cache_index, where, inputs, rows, (), order))
            logits = normed @ self.lm_head
            if self.tp is not None:
                logits = self.tp.all_gather_columns(logits)[:, :self.full_spec.vocab_size]
            tokens = logits.argmax(dim=-1)
        return logits

    # ---- CUDA graphs --------------------------------------------------------------------------------------

    def capture(self, cache: KVCache, decode: DecodeInputs | None = None, prefill: Sequence[PrefillChunk] = (),
                warmup: int = 2) -> StepGraph:
        """Capture a step of this shape as a CUDA graph (decode rows read ``decode``'s static tensors).

        The capture's warm-up steps run for real; the linear-attention states and convolution inputs of the
        step's slots are put back afterwards, so capturing does not move the requests in those slots.
        """
        with kept_linear_state(cache, decode, prefill):
            graph, logits = self._capture(lambda: self.step(cache, decode, prefill), warmup)
        return StepGraph(graph, decode, logits, cache)

    def capture_draft(self, cache: KVCache, draft: DraftInputs, passes: int, warmup: int = 2) -> StepGraph:
        """Capture :meth:`draft` of these rows and passes as a CUDA graph (it reads ``draft``'s static tensors)."""
        graph, logits = self._capture(lambda: self.draft(cache, draft, passes), warmup)
        return StepGraph(graph, draft, logits, cache)

    def _capture(self, run: Callable[[], torch.Tensor], warmup: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``run`` captured as a CUDA graph after ``warmup`` real runs, and the tensor its replays write."""
        # one side stream for every capture: cuBLAS keeps a workspace for each stream it ran on, so a new stream a
        # capture would add one a capture (up to torch's pool of streams) that no memory profile sees
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(self.device)
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # on a side stream, as torch's graph capture asks
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out


@contextmanager
def kept_linear_state(cache: KVCache, decode: DecodeInputs | None = None,
                      prefill: Sequence[PrefillChunk] = ()) -> Iterator[list[torch.Tensor]]:
    """Within the block, steps may move the linear-attention states and convolution inputs of these rows' and
    chunks' slots; on leaving, they are what they were (a full-attention layer's cache needs no such care: a
    replay rewrites the positions a warm-up wrote). Yields the copies kept aside (a row a slot, per layer the
    states then the convolution inputs)."""
    if not cache.state:
        yield []
        return
    slots = [chunk.slot for chunk in prefill]
    index = torch.tensor(slots, dtype=torch.int64, device=cache.state[0].device)
    if decode is not None:
        index = torch.cat([decode.slots.to(index.device), index])
    # each slot once: a row's drafts and a graph's padding rows share a slot, and a slot's state is large (a
    # request's heads x key_dim x value_dim a layer), so a copy a query token would take far more memory than
    # the states it saves. (Indexing copies: no clone.)
    index = torch.unique(index)
    saved = [(t, t[index]) for t in [*cache.state, *cache.conv]]
    try:
        yield [kept for _, kept in saved]
    finally:
        for t, kept in saved:
            t[index] = kept


@dataclass
class StepGraph:
    """A captured step: refill ``inputs`` in place, :meth:`replay`, read ``logits``. It keeps the cache it was
    captured on (a replay reads that cache's block table, which must outlive it)."""

    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs | DraftInputs | None
    logits: torch.Tensor
    cache: KVCache

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


@dataclass(frozen=True)
class _Moe:
    router: torch.Tensor          # [hidden, experts]
    gate_up: torch.Tensor         # [experts, hidden, 2 * width]
    down: torch.Tensor            # [experts, width, hidden]
    shared_gate_up: torch.Tensor | None
    shared_down: torch.Tensor | None
    shared_gate: torch.Tensor | None  # [hidden, 1]


@dataclass(frozen=True)
class _Linear:
    """A Gated DeltaNet layer's weights."""

    qkvz: torch.Tensor     # [hidden, 2 * key_heads * key_dim + 2 * value_heads * value_dim]
    ba: torch.Tensor       # [hidden, 2 * value_heads]: beta's and the decay's inputs
    conv: torch.Tensor     # [channels, kernel]: depthwise causal convolution over q, k, v
    a_log: torch.Tensor    # [value_heads] float32: the decay rate's log
    dt_bias: torch.Tensor  # [value_heads] float32
    norm: torch.Tensor     # [value_dim]: the gated RMSNorm's weight
    out: torch.Tensor      # [value_heads * value_dim, hidden]


@dataclass(frozen=True)
class _Layer:
    """One decoder layer: full attention (``qkv``, ``o``) or linear attention (``linear``), then a dense MLP
    (``gate_up``, ``down``) or a MoE (``moe``); ``cache_index``: its place among the cache's layers of its kind."""

    attn_norm: torch.Tensor
    qkv: torch.Tensor | None
    o: torch.Tensor | None
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    cache_index: int = 0
    linear: _Linear | None = None
    moe: _Moe | None = None

