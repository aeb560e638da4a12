"""Cost models: what a step costs on the GPU and what grammar work costs on the CPU.

- :mod:`.hardware`: built-in model and GPU specs (:data:`MODELS`, :data:`GPUS`), custom specs from YAML/JSON.
- :mod:`.forward`: :class:`ForwardCostModel`, the roofline price of a continuous-batching step.
- :mod:`.mask`: :class:`MaskCost`, bitmask apply / host-to-device copy / sampling times from measured tables.
- :mod:`.grammar_profile`: :class:`GrammarProfile`, a backend's measured grammar costs, and its
  seeded vectorized :class:`ProfileSampler` for ``model`` mode.
"""

from cdbench.harness.costs.forward import (
    ForwardConfig,
    ForwardCostModel,
    StepCost,
    attention_pairs,
)
from cdbench.harness.costs.grammar_profile import (
    KIND_CODES,
    CompileMeasurement,
    Distribution,
    GrammarProfile,
    KindProfile,
    ProfileError,
    ProfileSampler,
    WalkMeasurement,
)
from cdbench.harness.costs.hardware import (
    GPUS,
    MODELS,
    GPUSpec,
    ModelSpec,
    SpecFileError,
    UnknownSpecError,
    load_spec_file,
    resolve_gpu,
    resolve_model,
)
from cdbench.harness.costs.mask import MaskCost, bitmask_bytes

__all__ = [
    "GPUS", "KIND_CODES", "MODELS", "CompileMeasurement", "Distribution", "ForwardConfig", "ForwardCostModel",
    "GPUSpec", "GrammarProfile", "KindProfile", "MaskCost", "ModelSpec", "ProfileError", "ProfileSampler",
    "SpecFileError", "StepCost", "UnknownSpecError", "WalkMeasurement", "attention_pairs", "bitmask_bytes",
    "load_spec_file", "resolve_gpu", "resolve_model",
]
