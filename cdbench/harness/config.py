"""The configuration of a whole run, as one pydantic model (YAML / CLI).

Every section forbids unknown keys, so a misspelt key is an error that names
it. Example (YAML)::

    mode: model                 # or hybrid (default), or live (a CUDA host)
    seed: 0
    vocab: qwen3.6
    backend: {name: xgrammar, options: {}}
    policy: {name: sglang, host_cpus: 32}
    scheduler: {poll_interval_s: 0.001, ranks: 2}   # overrides of the policy preset
    costs: {model: qwen3-8b, gpu: h100-sxm}         # + grammar_profile / fixed_grammar / fixed_gpu
    workload: {num_requests: 200, arrival: {...}, ...}   # cdbench.workloads.config.WorkloadConfig
    slo: {ttft_ms: 2000, tpot_ms: 100}

>>> cfg = RunConfig.model_validate({"policy": {"name": "vllm"}, "scheduler": {"compile_threads": 4}})
>>> cfg.scheduler_config().compile_threads, cfg.scheduler_config().name
(4, 'vllm')
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from cdbench.backends.reasoner import ReasonerBackend
from cdbench.backends.registry import available_backends
from cdbench.harness.costs.forward import ForwardConfig
from cdbench.harness.costs.gpu import FixedGpuCosts, GpuCosts, RooflineGpuCosts
from cdbench.harness.costs.grammar_profile import (
    GrammarProfile,
    ProfileError,
    is_profile_file,
)
from cdbench.harness.costs.hardware import (
    SpecFileError,
    UnknownSpecError,
    resolve_model,
)
from cdbench.harness.costs.mask import MaskCost
from cdbench.harness.costs.spec_costs import Progress, SpecCostSettings, price_specs
from cdbench.harness.costs.spec_store import backend_version
from cdbench.harness.executors.model import (
    FixedGrammarCosts,
    GrammarCosts,
    ProfileGrammarCosts,
)
from cdbench.harness.metrics import SLO
from cdbench.harness.policies import PRESETS, SchedulerConfig, policy
from cdbench.workloads.config import WorkloadConfig

if TYPE_CHECKING:
    import torch

    from cdbench.harness.live.step import LiveStep
    from cdbench.workloads.request import Request

_REASONER_PARAMS = inspect.signature(ReasonerBackend).parameters
_REASONER_INNER = _REASONER_PARAMS["inner"].default


class BackendConfig(BaseModel):
    """The grammar backend: a registry name and its constructor options."""

    model_config = ConfigDict(extra="forbid")
    name: str = "xgrammar"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        # Checked here, not when the backend is built, so a typo fails before any run of a sweep or comparison.
        if name not in available_backends():
            raise ValueError(f"not a registered backend; registered: {', '.join(available_backends())}")
        return name


class PolicyConfig(BaseModel):
    """The scheduler preset, and the engine host's CPU count its defaults derive from."""

    model_config = ConfigDict(extra="forbid")
    name: Literal[tuple(PRESETS)] = "sglang"  # type: ignore[valid-type]
    host_cpus: int = Field(32, ge=1, description="CPUs of the simulated engine host (compile and fill pools)")


SchedulerOverrides = create_model(
    "SchedulerOverrides",
    __config__=ConfigDict(extra="forbid"),
    __doc__="Overrides of the policy preset: any :class:`SchedulerConfig` field; unset fields keep the preset.",
    **{name: (Optional[field.annotation], None)  # noqa: UP045 (create_model needs a runtime type)
       for name, field in SchedulerConfig.model_fields.items() if name != "name"},
)


class CostConfig(ForwardConfig, SpecCostSettings):
    """Cost models: the forward roofline (model, GPU, TP, calibration), mask and grammar costs.

    ``fixed_gpu`` replaces the roofline and mask tables with constants;
    ``grammar_profile`` (``model`` mode) is a profile file (``.parquet`` or
    ``.json``) or a backend name whose shipped profile to use (default: the
    run's backend); a profile measured with another backend, engine version
    or vocabulary than the run's is refused unless ``allow_mismatched_profile``
    (then ``summary.json``'s ``spec_costs.profile_mismatch`` says how it differs);
    ``fixed_grammar`` replaces the profile with constants. How ``model`` mode
    prices each spec of the run (``spec_costs``, ``host``, ``spec_store``,
    ...) is :class:`~cdbench.harness.costs.spec_costs.SpecCostSettings`.
    """

    mask_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    live_gpu: bool = Field(False, description="hybrid mode: run each step's forward, mask copy, apply and "
                           "sampling on this machine's GPU and use the measured times (needs CUDA)")
    live_kv_tokens: int | None = Field(None, ge=1, description="live mode and live_gpu: KV-cache capacity in "
                                       "tokens (default: live mode sizes it as an engine does, the policy's "
                                       "kv_memory_fraction of the GPU's memory less the weights, a profiled "
                                       "largest step's activation peak and the CUDA graphs; live_gpu 2^18)")
    fixed_gpu: FixedGpuCosts | None = None
    grammar_profile: str | None = None
    allow_mismatched_profile: bool = Field(False, description="model mode: use a grammar profile measured with "
                                           "another backend, engine version or vocabulary than the run's")
    fixed_grammar: FixedGrammarCosts | None = None
    grammar_fill_scale: float = Field(
        1.0, gt=0, description="model mode: every fill the grammar profile prices times this, for an engine that "
        "ran another release of the backend than the profile measured (its fills over the profile release's on the "
        "same schemas: scripts/engine_costs/measure_grammar_accept.py --fills); accepts and compiles as measured")
    host_costs: str = Field(
        "preset", description="the loop's host costs: preset (the policy's, measured from the engines' code), or "
        "live-run:<run folder or PACK::RUN>: a live run's own loop (the host costs it spun, from its config, and its "
        "launch fitted from its steps), replacing those scheduler fields, to compare a model run with that live run")

    rank_costs: str = Field(
        "preset", description="tensor-parallel ranks' prices: preset (the scheduler's all_gather_s, rank_jitter and "
        "rank_fill_jitter), or live-run:<run folder or PACK::RUN>: what a live tp run's rank processes measured "
        "(cdbench.results.live_rank_costs), replacing those scheduler fields")

    @field_validator("host_costs", "rank_costs")
    @classmethod
    def _host_costs_source(cls, value: str) -> str:
        if value != "preset" and not (value.startswith("live-run:") and value.removeprefix("live-run:")):
            raise ValueError("expected 'preset' or 'live-run:<run folder or PACK::RUN>'")
        return value

    def logits_width(self) -> int:
        """The width of a logits row, and so of the bitmask the GPU copies and applies and of the rows it
        samples: the model's vocabulary, not the tokenizer's. Engines size their bitmask to the model config's
        ``vocab_size`` (vLLM's ``StructuredOutputManager`` allocates ``allocate_token_bitmask(max_num_seqs,
        model_config.get_vocab_size())``; the model runner scatters it into an array as wide as the logits),
        padding tokens the tokenizer lacks as disallowed; the grammar's fill walks the tokenizer's tokens and
        stays priced by the backend."""
        return resolve_model(self.model).vocab_size

    def gpu_costs(self) -> GpuCosts:
        if self.fixed_gpu is not None:
            return self.fixed_gpu
        vocab_size = self.logits_width()
        if self.live_gpu:
            import torch

            from cdbench.harness.live.gpu import LiveGpuCosts

            if not torch.cuda.is_available():
                raise ValueError("costs.live_gpu needs a CUDA device; this machine has none")
            dtype = self.logits_dtype()
            return LiveGpuCosts(resolve_model(self.model), vocab_size, "cuda", self.live_kv_tokens or 2**18,
                                logits_dtype=dtype)
        return RooflineGpuCosts(self.build(), MaskCost.for_gpu(self.gpu, vocab_size, dtype=self.mask_dtype))

    def logits_dtype(self) -> torch.dtype:
        """``mask_dtype`` as a torch dtype: the live runs' logits."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.mask_dtype]

    def live_step(self, max_len: int, graph_sizes: Sequence[int] = (), block_size: int = 16,
                  max_requests: int | None = None, mtp_drafts: int = 0, *, memory_fraction: float,
                  max_tokens: int, spec_tokens: int) -> LiveStep:
        """``live`` mode's step runner: the configured model's forward on this machine's GPU, decode
        steps replaying graphs captured at ``graph_sizes`` (the policy's ``cuda_graph_sizes``), a paged
        KV cache of ``block_size`` tokens a block for ``max_requests`` running requests (the policy's
        ``kv_block_size`` and ``max_running_requests``), the model's MTP head drafting ``mtp_drafts``
        tokens after each step with decode rows (0: none). Without ``live_kv_tokens`` the cache is sized
        from ``memory_fraction`` of the GPU's memory (the policy's ``kv_memory_fraction``) after a profile of
        the largest step of ``max_tokens`` tokens and ``spec_tokens`` drafts a row (the policy's
        ``max_batched_tokens``, the run's speculative tokens)."""
        import torch

        from cdbench.harness.live.step import LiveStep

        if not torch.cuda.is_available():
            raise ValueError("mode 'live' runs every step on a CUDA GPU; this machine has none "
                             "(hybrid mode runs the same grammar work with the GPU modelled)")
        dtype = self.logits_dtype()
        return LiveStep(resolve_model(self.model), self.logits_width(), max_len, "cuda", self.live_kv_tokens,
                        logits_dtype=dtype, graph_sizes=graph_sizes, block_size=block_size,
                        max_requests=max_requests, mtp_drafts=mtp_drafts, memory_fraction=memory_fraction,
                        max_tokens=max_tokens, spec_tokens=spec_tokens)

    def grammar_costs(self, backend: str, seed: int, options: Mapping[str, Any] | None = None,
                      requests: Sequence[Request] | Callable[[], Iterable[Request]] | None = None,
                      vocab: str | None = None,
                      progress: Progress | None = None) -> GrammarCosts:
        """The ``model``-mode grammar costs of ``backend`` (built with ``options``).

        The ``reasoner`` backend's grammar work is its inner backend's (thinking
        adds only token filters, which the scheduler costs itself), so it draws
        from the inner backend's profile. Given the run's ``requests`` and
        ``vocab`` (or a function building the requests anew each time it is called), every spec of them
        is priced from a measurement (:func:`~cdbench.harness.costs.spec_costs.price_specs`: found, measured
        now or predicted), and the costs' ``coverage`` says from which.
        """
        if self.fixed_grammar is not None:
            return self.fixed_grammar
        options = dict(options or {})
        configured = backend
        if backend == "reasoner":
            inner = options.get("inner", _REASONER_INNER)
            if not isinstance(inner, str):
                raise ValueError(f"reasoner option inner={inner!r}: model mode needs the inner backend's name")
            # what is not the wrapper's own parameter builds the inner backend
            backend, options = inner, {k: v for k, v in options.items() if k not in _REASONER_PARAMS}
        source = self.grammar_profile or backend
        named = is_profile_file(source)
        profile = GrammarProfile.load(source) if named else GrammarProfile.builtin(source)
        # a reasoner run's own profile (a hybrid run of it: its thinking accepts too) fits it, as its inner's does
        measured = configured if profile.backend == configured else backend
        mismatch = profile.mismatch(measured, vocab, backend_version(measured)) if vocab is not None else None
        if mismatch is not None:
            which = f"grammar profile {source}" if named else f"the shipped {source} grammar profile"
            mismatch = f"{which} was {mismatch}"
            if not self.allow_mismatched_profile:
                raise ProfileError(f"{mismatch}; refused (set costs.allow_mismatched_profile=true to use it anyway)")
        coverage = None
        if requests is not None and vocab is not None and backend != "none":
            profile, coverage = price_specs(profile, backend, options, vocab, requests, self,
                                            named_profile=named, progress=progress)
            coverage.profile_mismatch = mismatch
        return ProfileGrammarCosts(profile, seed, coverage, requests=requests if callable(requests) else None,
                                   fill_scale=self.grammar_fill_scale)


class RunConfig(BaseModel):
    """One run: what arrives, which engine model schedules it, and where costs come from."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["model", "hybrid", "live"] = "hybrid"
    seed: int = 0
    vocab: str = "qwen3.6"
    backend: BackendConfig = Field(default_factory=BackendConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    scheduler: SchedulerOverrides = Field(default_factory=SchedulerOverrides)  # type: ignore[valid-type]
    costs: CostConfig = Field(default_factory=CostConfig)
    workload: WorkloadConfig = Field(default_factory=lambda: WorkloadConfig(num_requests=200))
    slo: SLO | None = None
    trace_steps: int = Field(2000, ge=0, description="iterations whose spans go to the Chrome trace")

    @model_validator(mode="after")
    def _real_collectives_in_hybrid(self) -> RunConfig:
        if self.mode == "model" and (backend := self.scheduler_config().collectives) != "model":
            raise ValueError(f"scheduler.collectives {backend!r} runs real collectives in hybrid mode; "
                             "model mode prices them (collectives: model) to stay deterministic")
        if self.mode != "hybrid" and self.costs.live_gpu:
            raise ValueError(f"costs.live_gpu measures the GPU parts in hybrid mode; {self.mode} mode "
                             + ("prices them" if self.mode == "model" else "runs whole steps on the GPU"))
        if self.mode == "live" and self.scheduler_config().mask_apply != "batched":
            raise ValueError("scheduler.mask_apply 'per_row' is priced in model and hybrid mode; live mode runs "
                             "the batched copy and apply")
        if (self.mode == "live" or self.costs.live_gpu) and (self.scheduler_config().sampler_host
                                                              or self.scheduler_config().row_launch_s):
            raise ValueError("scheduler.sample_prep_s / sample_prep_row_s / sample_launch_s / sample_launch_row_s / "
                             "row_launch_s price V0's sampler and row launches; a measured step (live mode, "
                             "costs.live_gpu) runs its own: set them to 0")
        if self.mode != "model" and self.scheduler_config().accept_parallel:
            raise ValueError(f"scheduler.accept_parallel is priced in model mode; {self.mode} mode accepts row by "
                             "row on this host")
        if self.mode == "live" and self.costs.fixed_gpu is not None:
            raise ValueError("costs.fixed_gpu prices the GPU; live mode runs every step on it")
        if self.workload.spec_decode.drafter == "mtp":
            if self.costs.live_gpu:
                raise ValueError("workload.spec_decode.drafter 'mtp': costs.live_gpu's GPU steps run no MTP head; "
                                 "live mode runs it (one GPU), model and hybrid mode price it")
            if self.mode == "live" and self.scheduler_config().ranks > 1:
                raise ValueError("workload.spec_decode.drafter 'mtp': live mode runs the MTP head on one GPU; "
                                 "several ranks do not draft with it yet")
            if self.costs.fixed_gpu is None:
                try:
                    model = resolve_model(self.costs.model)
                except (UnknownSpecError, SpecFileError):  # (building the forward model names it)
                    return self
                if not model.mtp_layers:
                    raise ValueError(f"workload.spec_decode.drafter 'mtp': {model.name} has no MTP layer "
                                     "(mtp_layers = 0)")
        return self

    @model_serializer(mode="wrap")
    def _resolved(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dump ``scheduler`` resolved (the preset with its overrides, every field set), so a dumped
        config reloads to the same run instead of reading unset overrides as ``null``."""
        data = handler(self)
        spec_decode = self.workload.spec_decode
        data["scheduler"] = self.scheduler_config(spec_decode.k, spec_decode.drafter).model_dump(
            mode="json", exclude={"name"})
        return data

    def scheduler_config(self, spec_tokens: int | None = None, spec_drafter: str | None = None) -> SchedulerConfig:
        """The policy preset with the overrides applied (``spec_tokens`` and ``spec_drafter`` from the
        workload unless overridden)."""
        overrides = self.scheduler.model_dump(exclude_unset=True)
        if spec_tokens is not None:
            overrides.setdefault("spec_tokens", spec_tokens)
        if spec_drafter is not None:
            overrides.setdefault("spec_drafter", spec_drafter)
        return policy(self.policy.name, self.policy.host_cpus, **overrides)
