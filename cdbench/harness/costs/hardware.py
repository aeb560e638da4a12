"""Built-in model and GPU specifications, and loading custom ones.

The forward-pass cost model (:mod:`cdbench.harness.costs.forward`) prices a
step from a :class:`ModelSpec` and a :class:`GPUSpec`. Built-in specs are
looked up by name (case-insensitive, aliases allowed); anything else can be
described in YAML or JSON and loaded with :func:`load_spec_file`.

Examples
--------
>>> resolve_model("llama-3.1-8b").n_layers
32
>>> resolve_gpu("H100").hbm_bandwidth_Bps
3350000000000.0
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class UnknownSpecError(KeyError):
    """A model or GPU name that is neither built in nor a readable spec file."""

    def __str__(self) -> str:
        return str(self.args[0])


class SpecFileError(ValueError):
    """A custom spec file that cannot be read or does not validate."""


class ModelSpec(BaseModel):
    """The shape of a transformer, as the roofline needs it.

    Counts are whole-model (before tensor parallelism). For a mixture of
    experts, ``params_total`` counts every expert and ``params_active`` what one
    token passes through; ``n_experts``/``experts_per_token`` are the routed
    experts per MoE layer (shared experts belong to the always-read part).

    ``attention="mla"`` is DeepSeek's multi-head latent attention: the KV cache
    holds one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` values
    per token and layer instead of per-head keys and values.

    A hybrid model (Qwen3-Next, Qwen3.5) mixes full attention with Gated
    DeltaNet linear attention: with ``full_attention_interval = n`` every
    ``n``-th layer (the ``n``-th, ``2n``-th, ...) is full attention and the
    others are linear (the ``layer_types`` pattern of the published configs).
    A linear layer keeps a fixed state per request instead of a growing KV
    cache: per value head a ``linear_key_head_dim x linear_value_head_dim``
    matrix, plus the last ``linear_conv_kernel_dim - 1`` inputs of its short
    convolution over the query, key and value channels. ``mtp_layers`` is the
    multi-token-prediction head (one decoder layer on the last hidden state and
    the next token's embedding, sharing the embedding and the LM head) used to
    draft tokens. Every field added for these has a default that leaves a
    dense or plain-MoE model as it was.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    aliases: tuple[str, ...] = ()
    params_total: float = Field(gt=0, description="all weights, including every expert")
    params_active: float | None = Field(default=None, gt=0, description="weights one token uses (MoE); default: all")
    n_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="query/key head dimension")
    v_head_dim: int | None = Field(default=None, gt=0, description="value head dimension; default head_dim")
    attention: Literal["gqa", "mla"] = "gqa"
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    n_experts: int = Field(default=0, ge=0, description="routed experts per MoE layer (0: dense)")
    experts_per_token: int = Field(default=0, ge=0)
    vocab_size: int = Field(gt=0)
    intermediate_size: int | None = Field(default=None, gt=0, description="dense MLP width (the live forward builds it)")
    qk_norm: bool = Field(default=False, description="RMSNorm on each query and key head (Qwen3)")
    moe_intermediate_size: int | None = Field(default=None, gt=0, description="one routed expert's MLP width")
    shared_expert_intermediate_size: int = Field(default=0, ge=0, description="the shared expert's width (0: none)")
    attention_output_gate: bool = Field(
        default=False, description="full attention's output gated by a sigmoid of a second query-sized projection")
    full_attention_interval: int = Field(default=1, ge=1, description="every n-th layer full attention, others linear")
    linear_num_key_heads: int = Field(default=0, ge=0, description="Gated DeltaNet query/key heads")
    linear_num_value_heads: int = Field(default=0, ge=0, description="Gated DeltaNet value heads (state matrices)")
    linear_key_head_dim: int = Field(default=0, ge=0)
    linear_value_head_dim: int = Field(default=0, ge=0)
    linear_conv_kernel_dim: int = Field(default=0, ge=0, description="short causal convolution before the recurrence")
    mtp_layers: int = Field(default=0, ge=0, description="multi-token-prediction layers (draft head)")
    bytes_per_state: float = Field(default=2.0, gt=0, description="bytes per linear-attention state element")
    bytes_per_weight: float = Field(default=2.0, gt=0, description="2 for bf16, 1 for fp8")
    bytes_per_kv: float = Field(default=2.0, gt=0, description="bytes per cached KV element")
    source: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        if self.params_active is not None and self.params_active > self.params_total:
            raise ValueError(f"{self.name}: params_active > params_total")
        if self.attention == "mla" and (self.kv_lora_rank is None or self.qk_rope_head_dim is None):
            raise ValueError(f"{self.name}: attention 'mla' needs kv_lora_rank and qk_rope_head_dim")
        if (self.n_experts > 0) != (self.experts_per_token > 0) or self.experts_per_token > self.n_experts:
            raise ValueError(f"{self.name}: need 0 < experts_per_token <= n_experts for a MoE (both 0 if dense)")
        if self.n_experts > 0 and self.params_active is None:
            raise ValueError(f"{self.name}: a MoE needs params_active")
        linear = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                  self.linear_value_head_dim, self.linear_conv_kernel_dim)
        if self.full_attention_interval > self.n_layers:
            raise ValueError(f"{self.name}: full_attention_interval {self.full_attention_interval} leaves no "
                             f"full-attention layer among {self.n_layers}")
        if self.full_attention_interval > 1 and min(linear) == 0:
            raise ValueError(f"{self.name}: full_attention_interval > 1 needs every linear_* shape (linear layers)")
        if self.linear_num_key_heads and self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"{self.name}: linear_num_value_heads is not a multiple of linear_num_key_heads")
        return self

    @property
    def active(self) -> float:
        return self.params_total if self.params_active is None else self.params_active

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention."""
        return self.full_attention_interval > 1

    @property
    def n_full_attention_layers(self) -> int:
        """Layers with softmax attention over a KV cache (all of them unless hybrid)."""
        return self.n_layers // self.full_attention_interval

    @property
    def n_linear_layers(self) -> int:
        """Gated DeltaNet layers: a fixed state per request, no KV cache."""
        return self.n_layers - self.n_full_attention_layers

    def is_full_attention(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is full attention: the published ``layer_types`` pattern."""
        return (layer + 1) % self.full_attention_interval == 0

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """KV-cache bytes one token of context takes on one of ``tp`` ranks, over the full-attention layers.

        With :meth:`state_bytes_per_request`, what a KV-cache capacity model needs: a request of
        ``n`` context tokens holds ``n * kv_bytes_per_token + state_bytes_per_request``.
        """
        return self.kv_elements_per_token_layer(tp) * self.bytes_per_kv * self.n_full_attention_layers

    def state_bytes_per_request(self, tp: int = 1) -> float:
        """Fixed bytes one request holds on one of ``tp`` ranks in the linear-attention layers (0 unless hybrid).

        Per layer: one ``key_dim x value_dim`` state matrix per value head, and the short
        convolution's last ``kernel - 1`` inputs over the query, key and value channels; heads split
        over ranks as the engines shard them. The state's element size is ``bytes_per_state``
        (vLLM keeps it in the model's dtype by default: ``MambaStateDtypeCalculator``); the
        convolution's is ``bytes_per_kv``.
        """
        if not self.n_linear_layers:
            return 0.0
        v_heads = -(-self.linear_num_value_heads // tp)
        k_heads = -(-self.linear_num_key_heads // tp)
        state = v_heads * self.linear_key_head_dim * self.linear_value_head_dim * self.bytes_per_state
        channels = 2 * k_heads * self.linear_key_head_dim + v_heads * self.linear_value_head_dim
        conv = channels * (self.linear_conv_kernel_dim - 1) * self.bytes_per_kv
        return (state + conv) * self.n_linear_layers

    def request_cache_bytes(self, context_tokens: float, tp: int = 1) -> float:
        """Bytes one request of ``context_tokens`` holds on one rank: its KV cache and its linear state."""
        return context_tokens * self.kv_bytes_per_token(tp) + self.state_bytes_per_request(tp)

    def kv_elements_per_token_layer(self, tp: int = 1) -> float:
        """KV-cache elements one token stores in one layer on one of ``tp`` ranks.

        GQA splits KV heads over ranks (replicated when there are fewer heads
        than ranks); MLA's latent is per token, so every rank holds all of it.
        """
        if self.attention == "mla":
            return float(self.kv_lora_rank + self.qk_rope_head_dim)  # type: ignore[operator]
        heads = -(-self.n_kv_heads // tp)
        return 2.0 * heads * self.head_dim


def intermediate_size(spec: ModelSpec) -> int:
    """The MLP width: the spec's, else what ``params_total`` leaves after embeddings and attention.

    Untied input and output embeddings and a gated MLP of three matrices;
    rounded to a multiple of 256 as released models are.
    """
    if spec.intermediate_size is not None:
        return spec.intermediate_size
    d, h = spec.head_dim, spec.hidden_size
    attention = h * (spec.n_heads * d) * 2 + h * (spec.n_kv_heads * d) * 2
    mlp = (spec.params_total - 2 * spec.vocab_size * h) / spec.n_layers - attention
    width = round(mlp / (3 * h) / 256) * 256
    if width <= 0:
        raise ValueError(f"{spec.name}: params_total leaves no MLP; give intermediate_size")
    return width


class GPUSpec(BaseModel):
    """A GPU's roofline: datasheet peaks and the fraction of them that kernels reach.

    ``hbm_bandwidth_Bps`` and ``bf16_dense_flops`` are datasheet values;
    ``memory_efficiency`` and ``compute_efficiency`` are the achievable
    fractions (assumptions, to be calibrated). ``nvlink_bandwidth_Bps`` is the
    datasheet total (both directions); ``pcie_bandwidth_Bps`` is one direction.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    aliases: tuple[str, ...] = ()
    hbm_bandwidth_Bps: float = Field(gt=0)
    hbm_bytes: float = Field(gt=0)
    bf16_dense_flops: float = Field(gt=0)
    nvlink_bandwidth_Bps: float = Field(gt=0)
    pcie_bandwidth_Bps: float = Field(gt=0)
    memory_efficiency: float = Field(default=0.8, gt=0, le=1)
    compute_efficiency: float = Field(default=0.65, gt=0, le=1)
    collective_latency_s: float = Field(default=8e-6, ge=0, description="fixed cost of one small all-reduce")
    source: str = ""


_HF = "model card / config.json on Hugging Face"

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            name="llama-3.1-8b", aliases=("llama3.1-8b", "meta-llama-3.1-8b"),
            params_total=8.03e9, n_layers=32, hidden_size=4096, n_heads=32, n_kv_heads=8,
            head_dim=128, vocab_size=128256, intermediate_size=14336,
            source=f"meta-llama/Llama-3.1-8B {_HF}",
        ),
        ModelSpec(
            name="qwen3-8b", params_total=8.19e9, n_layers=36, hidden_size=4096, n_heads=32,
            n_kv_heads=8, head_dim=128, vocab_size=151936, intermediate_size=12288, qk_norm=True,
            source=f"Qwen/Qwen3-8B {_HF}",
        ),
        ModelSpec(
            # 61 GB of bf16 weights: fits one 80 GB H100, leaving under 19 GB for activations and KV cache.
            name="qwen3-30b-a3b", params_total=30.5e9, params_active=3.3e9, n_layers=48,
            hidden_size=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128,
            experts_per_token=8, vocab_size=151936, moe_intermediate_size=768, qk_norm=True,
            source=f"Qwen/Qwen3-30B-A3B {_HF}: 48 layers, 128 experts, 8 per token, moe_intermediate_size 768",
        ),
        ModelSpec(
            # Qwen3.5's hybrid MoE: 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated (40
            # layers: 30 linear, 10 full), 256 routed experts (8 per token) plus a shared expert in every layer,
            # one MTP layer. The counts are from the shapes (main stack, MTP layer and vision tower excluded):
            # 34.66e9 total, 3.45e9 active. 69 GB of bf16 weights: fits one 141 GB H200 with ~60 GB for
            # the caches; on an 80 GB H100 it leaves under 10 GB.
            name="qwen3.5-35b-a3b", aliases=("qwen3.5-moe",), params_total=34.66e9, params_active=3.455e9,
            n_layers=40, hidden_size=2048, n_heads=16, n_kv_heads=2, head_dim=256, n_experts=256,
            experts_per_token=8, vocab_size=248320, qk_norm=True, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, attention_output_gate=True, full_attention_interval=4,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, mtp_layers=1,
            source=(f"Qwen/Qwen3.5-35B-A3B {_HF} (the model card: 40 layers, 30 linear + 10 full attention, 256 "
                    "experts, top-8 + 1 shared, hidden 2048, MTP); shapes as in THUDM/slime "
                    "scripts/models/qwen3.5-35B-A3B.sh (16 heads, 2 KV groups, kv-channels 256, moe ffn 512, shared "
                    "512, linear-attention-freq 4, conv 4, linear key/value head dim 128, 16 key / 32 value heads, "
                    "vocab 248320, attention output gate)"),
        ),
        ModelSpec(
            # Released with fp8 weights; MLA caches a 512-dim latent plus a 64-dim rope key.
            name="deepseek-v3", params_total=671e9, params_active=37e9, n_layers=61,
            hidden_size=7168, n_heads=128, n_kv_heads=128, head_dim=192, v_head_dim=128,
            attention="mla", kv_lora_rank=512, qk_rope_head_dim=64, n_experts=256,
            experts_per_token=8, vocab_size=129280, bytes_per_weight=1.0,
            source=f"deepseek-ai/DeepSeek-V3 {_HF}; technical report (671B total, 37B active)",
        ),
    )
}

GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(
            name="h100-sxm", aliases=("h100", "h100-80gb", "h100-sxm5"),
            hbm_bandwidth_Bps=3.35e12, hbm_bytes=80e9, bf16_dense_flops=989e12,
            nvlink_bandwidth_Bps=900e9, pcie_bandwidth_Bps=64e9,
            source="NVIDIA H100 datasheet (SXM5): 3.35 TB/s HBM3, 989 TFLOPS bf16 dense, NVLink 900 GB/s, PCIe Gen5",
        ),
        GPUSpec(
            name="h200", aliases=("h200-sxm", "h200-141gb"),
            hbm_bandwidth_Bps=4.8e12, hbm_bytes=141e9, bf16_dense_flops=989e12,
            nvlink_bandwidth_Bps=900e9, pcie_bandwidth_Bps=64e9,
            source="NVIDIA H200 datasheet (SXM): 4.8 TB/s HBM3e, 989 TFLOPS bf16 dense, NVLink 900 GB/s, PCIe Gen5",
        ),
        GPUSpec(
            name="a100-80gb", aliases=("a100", "a100-sxm", "a100-80gb-sxm"),
            hbm_bandwidth_Bps=2.039e12, hbm_bytes=80e9, bf16_dense_flops=312e12,
            nvlink_bandwidth_Bps=600e9, pcie_bandwidth_Bps=32e9,
            source="NVIDIA A100 datasheet (80GB SXM): 2,039 GB/s HBM2e, 312 TFLOPS bf16 dense, NVLink 600 GB/s, PCIe Gen4",
        ),
    )
}


def normalize_name(name: str) -> str:
    """Lower-case with runs of spaces, underscores and dashes folded to one dash."""
    return re.sub(r"[\s_\-]+", "-", name.strip().lower())


Spec = TypeVar("Spec", ModelSpec, GPUSpec)


def _lookup(name: str, catalog: dict[str, Spec], what: str) -> Spec:
    key = normalize_name(name)
    for spec in catalog.values():
        if key == spec.name or key in spec.aliases:
            return spec
    raise UnknownSpecError(f"unknown {what} {name!r}; known: {', '.join(sorted(catalog))} (or a YAML/JSON spec file)")


def load_spec_file(path: str | Path, kind: type[Spec]) -> Spec:
    """Read a :class:`ModelSpec` or :class:`GPUSpec` from a YAML or JSON file.

    Raises :class:`SpecFileError` naming the file and the offending field.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # YAML is a superset of JSON
    except (OSError, yaml.YAMLError) as exc:
        raise SpecFileError(f"{path}: cannot read {kind.__name__}: {exc}") from exc
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise SpecFileError(f"{path}: invalid {kind.__name__} field {field!r}: {first['msg']}") from exc


def _resolve(spec: str | Path | Spec, catalog: dict[str, Spec], kind: type[Spec], what: str) -> Spec:
    if isinstance(spec, kind):
        return spec
    text = str(spec)
    if text.endswith((".yaml", ".yml", ".json")) or Path(text).is_file():
        if not Path(text).is_file():
            raise UnknownSpecError(f"{what} spec file {text!r} does not exist")
        return load_spec_file(text, kind)
    return _lookup(text, catalog, what)


def resolve_model(spec: str | Path | ModelSpec) -> ModelSpec:
    """A built-in model by name, a spec file path, or a :class:`ModelSpec` as given."""
    return _resolve(spec, MODELS, ModelSpec, "model")


def resolve_gpu(spec: str | Path | GPUSpec) -> GPUSpec:
    """A built-in GPU by name, a spec file path, or a :class:`GPUSpec` as given."""
    return _resolve(spec, GPUS, GPUSpec, "GPU")

