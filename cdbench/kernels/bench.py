"""``cdbench kernels``: time the mask kernels against xgrammar, torch and the byte floor.

For every (vocabulary, batch, dtype, mask density) the command checks each
variant's result against the torch reference on fresh inputs, then times it
on rotating input sets (see :mod:`cdbench.kernels.timing`); for small batches
it also times CUDA-graph replays. It measures the device-to-device copy
bandwidth (the byte floor's denominator) and host-to-device bitmask copies,
writes CSV + markdown + a plot, and a :class:`~cdbench.kernels.cost_table.MaskCostTable`.

Without CUDA the same sweep runs on the CPU with host-clock timings of the CPU
paths (torch reference, xgrammar's CPU kernel); those are labelled ``cpu`` and
never written as a GPU cost table.

Example::

    cdbench kernels --quick --out runs/kernels-smoke
    cdbench kernels --out runs/kernels-h100 --cost-table auto    # full sweep on a GPU (an --out holding
                                                                 # results needs --overwrite)
"""

from __future__ import annotations

import datetime as dt
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cdbench.kernels import reference
from cdbench.kernels.bitmask import apply_bitmask
from cdbench.kernels.sampling import masked_argmax
from cdbench.kernels.timing import (
    MiB,
    Rotation,
    Timing,
    event_time,
    graph_time,
    h2d_time,
    rotation_count,
    wall_time,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DENSITIES = ("sparse", "dense")
FULL_VOCABS = (129280, 151936, 248320)
FULL_BATCHES = (1, 8, 64, 256, 1024)
QUICK_VOCABS = (1000,)
QUICK_BATCHES = (1, 4)


@dataclass
class InputSet:
    """One set of benchmark inputs; ``dst`` is the copy variant's destination."""

    logits: torch.Tensor
    bitmask: torch.Tensor
    half_rows: torch.Tensor
    dst: torch.Tensor | None = None


@dataclass(frozen=True)
class Variant:
    """A timed implementation. ``kind`` picks the correctness oracle and the report table."""

    name: str
    kind: str  # apply | apply-idx | argmax | sample | copy
    run: Callable[[InputSet], object]
    graph_safe: bool = True


@dataclass(frozen=True)
class Case:
    vocab: int
    batch: int
    dtype: str
    density: str

    @property
    def words(self) -> int:
        return (self.vocab + 31) // 32

    @property
    def elem(self) -> int:
        return torch.finfo(DTYPES[self.dtype]).bits // 8

    @property
    def floor_bytes(self) -> int:
        """Read the bitmask once, read and write the logits once."""
        return self.batch * (4 * self.words + 2 * self.vocab * self.elem)


@dataclass
class KernelResult:
    """One variant at one case with one timing method (``event``, ``graph`` or ``wall``)."""

    vocab: int
    batch: int
    dtype: str
    density: str
    variant: str
    kind: str
    timing: str
    median_us: float | None
    q20_us: float | None
    q80_us: float | None
    floor_us: float
    exact: bool | None
    error: str = ""
    gpu_temp_c: float | None = None
    sm_mhz: float | None = None
    throttle: str = ""


@dataclass
class CopyResult:
    bytes: int
    pinned: bool
    median_us: float
    q20_us: float
    q80_us: float


@dataclass
class BenchEnv:
    device: str
    gpu: str
    copy_gbs: float
    versions: dict[str, str]
    command: str
    date: str
    seed: int
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- variants


def _naive(s: InputSet) -> None:
    shifts = torch.arange(32, dtype=torch.int32, device=s.bitmask.device)
    bits = ((s.bitmask.unsqueeze(-1) >> shifts) & 1).view(s.bitmask.shape[0], -1)[:, : s.logits.shape[1]]
    s.logits.masked_fill_(bits == 0, float("-inf"))


def _apply_then_argmax(s: InputSet) -> torch.Tensor:
    apply_bitmask(s.logits, s.bitmask)
    return s.logits.argmax(dim=-1)


def _apply_then_sample(s: InputSet) -> torch.Tensor:
    # The exponential-race sampler vLLM uses: argmax(p / Exp(1)) ~ Categorical(p).
    apply_bitmask(s.logits, s.bitmask)
    probs = torch.softmax(s.logits.float(), dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _xgrammar_variants(device: str, wanted: set[str]) -> tuple[list[Variant], list[str]]:
    """xgrammar's backends that load here, and a note for each that does not."""
    notes: list[str] = []
    try:
        import xgrammar
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measured", with the reason
        return [], [f"xgrammar not importable: {exc!r}"]
    backends = {"xgr-cpu": "cpu"} if device == "cpu" else {
        "xgr-triton": "triton", "xgr-cuda": "cuda", "xgr-torch-native": "torch_native",
        "xgr-torch-compile": "torch_compile"}
    variants = []
    for name, backend in backends.items():
        if name not in wanted:
            continue
        if backend == "cuda":
            try:  # JIT-builds the extension with nvcc on first import
                import xgrammar.kernels.apply_token_bitmask_inplace_cuda  # noqa: F401
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name} unavailable: {exc!r}"[:300])
                continue

        def run(s: InputSet, backend=backend) -> None:
            xgrammar.apply_token_bitmask_inplace(s.logits, s.bitmask, backend=backend)

        def run_idx(s: InputSet, backend=backend) -> None:
            xgrammar.apply_token_bitmask_inplace(s.logits, s.bitmask, indices=s.half_rows, backend=backend)

        variants.append(Variant(name, "apply", run, graph_safe=backend in ("triton", "cuda")))
        if backend in ("triton", "cuda") and f"{name}-idx" in wanted:
            variants.append(Variant(f"{name}-idx", "apply-idx", run_idx))
    return variants, notes


def build_variants(device: str, wanted: Sequence[str] | None = None) -> tuple[list[Variant], list[str]]:
    """Every known variant (or those named in ``wanted``) that can run on ``device``."""
    ours = [
        Variant("copy", "copy", lambda s: s.dst.copy_(s.logits)),
        Variant("naive", "apply", _naive, graph_safe=True),
        Variant("cdbench", "apply", lambda s: apply_bitmask(s.logits, s.bitmask)),
        Variant("cdbench-adaptive", "apply", lambda s: apply_bitmask(s.logits, s.bitmask, mode="adaptive")),
        Variant("cdbench-skip", "apply", lambda s: apply_bitmask(s.logits, s.bitmask, mode="skip")),
        Variant("cdbench-rmw", "apply", lambda s: apply_bitmask(s.logits, s.bitmask, mode="rmw")),
        Variant("cdbench-store", "apply", lambda s: apply_bitmask(s.logits, s.bitmask, mode="store")),
        Variant("cdbench-idx", "apply-idx", lambda s: apply_bitmask(s.logits, s.bitmask, s.half_rows)),
        Variant("cdbench-argmax", "argmax", lambda s: masked_argmax(s.logits, s.bitmask)),
        Variant("apply+argmax", "argmax", _apply_then_argmax),
        Variant("cdbench-sample", "sample", lambda s: masked_argmax(s.logits, s.bitmask, temperature=1.0, seed=1)),
        Variant("apply+sample", "sample", _apply_then_sample, graph_safe=True),
    ]
    xgr_names = {"xgr-cpu", "xgr-triton", "xgr-cuda", "xgr-torch-native", "xgr-torch-compile",
                 "xgr-triton-idx", "xgr-cuda-idx"}
    default_off = {"xgr-torch-compile"}  # recompiles for every shape: minutes per sweep
    wanted_set = set(wanted) if wanted else {v.name for v in ours} | (xgr_names - default_off)
    unknown = wanted_set - {v.name for v in ours} - xgr_names
    if unknown:
        raise ValueError(f"unknown variants: {', '.join(sorted(unknown))}")
    xgr, notes = _xgrammar_variants(device, wanted_set)
    return [v for v in ours if v.name in wanted_set] + xgr, notes


# ----------------------------------------------------------------------------- inputs and checks


def make_inputs(case: Case, n_sets: int, rng: np.random.Generator, device: str, with_dst: bool) -> list[InputSet]:
    """Random logits and bitmasks: sparse rows allow U(1 %, 10 %) of tokens, dense rows 95 %."""
    gen = torch.Generator(device=device).manual_seed(int(rng.integers(2**62)))
    sets = []
    for _ in range(n_sets):
        if case.density == "sparse":
            frac = torch.from_numpy(rng.uniform(0.01, 0.10, case.batch)).float().to(device)
        else:
            frac = torch.full((case.batch,), 0.95, device=device)
        allowed = torch.rand(case.batch, case.vocab, generator=gen, device=device) < frac[:, None]
        logits = torch.randn(case.batch, case.vocab, generator=gen, device=device).to(DTYPES[case.dtype])
        sets.append(InputSet(logits, reference.pack_bitmask(allowed), torch.arange(0, case.batch, 2, device=device, dtype=torch.int32),
                             torch.empty_like(logits) if with_dst else None))
    return sets


def check_variant(variant: Variant, fresh: InputSet) -> bool:
    """Run ``variant`` once on ``fresh`` inputs and compare with the torch reference exactly."""
    original = fresh.logits.clone()
    expected = fresh.logits.clone()
    if variant.kind == "copy":
        variant.run(fresh)
        return bool(torch.equal(fresh.dst, original))
    if variant.kind in ("apply", "apply-idx"):
        reference.apply_bitmask_ref(expected, fresh.bitmask, fresh.half_rows if variant.kind == "apply-idx" else None)
        variant.run(fresh)
        return bool(torch.equal(fresh.logits, expected))
    got = variant.run(fresh)
    if variant.kind == "argmax":
        reference.apply_bitmask_ref(expected, fresh.bitmask)
        return bool(torch.equal(got, expected.argmax(dim=-1)))
    # Samples: our kernel must equal the reference draw; the torch sampler draws other noise,
    # so it is only checked to pick allowed tokens.
    allowed = reference.unpack_bitmask(fresh.bitmask, original.shape[1])
    picked_allowed = bool(allowed.gather(1, got.view(-1, 1).clamp(min=0)).all())
    if not variant.name.startswith("cdbench"):
        return picked_allowed
    rows = torch.arange(min(4, original.shape[0]), device=original.device)
    temps = torch.ones(len(rows), dtype=torch.float32, device=original.device)
    ref = reference.masked_argmax_ref(original, fresh.bitmask, rows, temps, seed=1, offset=0)
    return picked_allowed and bool(torch.equal(got[: len(rows)], ref))


# ----------------------------------------------------------------------------- the sweep


def run_sweep(
    cases: Sequence[Case],
    variants: Sequence[Variant],
    device: str,
    seed: int,
    graph_max_batch: int = 8,
    rotate_bytes: int = 512 * MiB,
    warmup_ms: float = 10,
    rep_ms: float = 40,
    copy_gbs: float = 0.0,
    progress: Callable[[str], None] | None = None,
    on_case: Callable[[list[KernelResult]], None] | None = None,
) -> list[KernelResult]:
    """Check and time every variant on every case; a failure is recorded and the sweep goes on.

    ``progress`` gets a label before each case, ``on_case`` the results so far after each one.
    """
    rng = np.random.default_rng(seed)
    results: list[KernelResult] = []
    for case in cases:
        if progress:
            progress(f"V={case.vocab} B={case.batch} {case.dtype} {case.density}")
        floor_us = case.floor_bytes / (copy_gbs * 1e3) if copy_gbs else float("nan")
        state = gpu_state() if device == "cuda" else {}
        set_bytes = case.batch * case.vocab * case.elem
        n_sets = rotation_count(set_bytes, rotate_bytes, hi=512 if device == "cuda" else 4)
        sets = make_inputs(case, n_sets, rng, device, with_dst=any(v.kind == "copy" for v in variants))
        rotation = Rotation(sets)
        for variant in variants:
            base = dict(vocab=case.vocab, batch=case.batch, dtype=case.dtype, density=case.density,
                        variant=variant.name, kind=variant.kind, floor_us=floor_us, **state)
            try:
                exact = check_variant(variant, make_inputs(case, 1, rng, device, variant.kind == "copy")[0])
                timing = _time(variant, rotation, device, warmup_ms, rep_ms)
                results.append(KernelResult(**base, timing="event" if device == "cuda" else "wall",
                                            median_us=timing.median_us, q20_us=timing.q20_us,
                                            q80_us=timing.q80_us, exact=exact))
            except Exception as exc:  # noqa: BLE001 - recorded in the results, the sweep continues
                results.append(KernelResult(**base, timing="event", median_us=None, q20_us=None, q80_us=None,
                                            exact=None, error=_short(exc)))
                continue
            if device == "cuda" and case.batch == 1:
                per_call = _dispatch_us(variant, rotation)
                results.append(KernelResult(**base, timing="dispatch", median_us=per_call, q20_us=None,
                                            q80_us=None, exact=exact))
            if device == "cuda" and case.batch <= graph_max_batch and variant.graph_safe:
                try:
                    timing = graph_time(variant.run, Rotation(sets[: min(len(sets), 256)]))
                    results.append(KernelResult(**base, timing="graph", median_us=timing.median_us,
                                                q20_us=timing.q20_us, q80_us=timing.q80_us, exact=exact))
                except Exception as exc:  # noqa: BLE001
                    results.append(KernelResult(**base, timing="graph", median_us=None, q20_us=None,
                                                q80_us=None, exact=exact, error=_short(exc)))
        del sets, rotation
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_case:
            on_case(results)
    return results


def _time(variant: Variant, rotation: Rotation[InputSet], device: str, warmup_ms: float, rep_ms: float) -> Timing:
    if device == "cuda":
        return event_time(variant.run, rotation, warmup_ms, rep_ms)
    return wall_time(lambda: variant.run(rotation.next()), reps=10)


def gpu_state() -> dict[str, object]:
    """Temperature, SM clock and active clock-slowdown reasons (NVML), to flag throttled rows."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        # Idle and application-clock settings are not slowdowns.
        reasons &= ~(pynvml.nvmlClocksThrottleReasonGpuIdle | pynvml.nvmlClocksThrottleReasonApplicationsClocksSetting)
        return {"gpu_temp_c": float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                "sm_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                "throttle": hex(reasons) if reasons else ""}
    except Exception:  # noqa: BLE001 - NVML is optional; the columns stay empty without it
        return {}


def _dispatch_us(variant: Variant, rotation: Rotation[InputSet], calls: int = 200) -> float:
    """Host µs per call: ``calls`` calls enqueued back to back, no synchronization in between."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        variant.run(rotation.next())
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def h2d_sizes(vocabs: Sequence[int], batches: Sequence[int]) -> list[int]:
    """Bitmask payload sizes of the swept shapes plus a log-spaced range from 4 KiB to 256 MiB."""
    sizes = {b * ((v + 31) // 32) * 4 for v in vocabs for b in batches}
    sizes |= {4096 << (2 * i) for i in range(0, 9)}
    return sorted(sizes)


def run_h2d(sizes: Sequence[int]) -> list[CopyResult]:
    out = []
    for nbytes in sizes:
        for pinned in (True, False):
            t = h2d_time(nbytes, pinned, reps=10 if nbytes >= 64 * MiB else 30)
            out.append(CopyResult(nbytes, pinned, t.median_us, t.q20_us, t.q80_us))
    return out


def environment(device: str, seed: int, copy_gbs: float, notes: list[str]) -> BenchEnv:
    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    from importlib.metadata import PackageNotFoundError, version

    try:
        versions["xgrammar"] = version("xgrammar")
    except PackageNotFoundError:
        versions["xgrammar"] = "not installed"
    if device == "cuda":
        versions["cuda"] = str(torch.version.cuda)
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        gpu = f"none (CPU: {platform.processor() or platform.machine()})"
    return BenchEnv(device=device, gpu=gpu, copy_gbs=copy_gbs, versions=versions,
                    command=" ".join(shlex.quote(a) for a in ["cdbench", *sys.argv[1:]]),
                    date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), seed=seed, notes=notes)


def gpu_short_name(name: str) -> str:
    """File stem for a GPU's cost table: ``'NVIDIA H100 80GB HBM3'`` → ``'h100'``.

    >>> gpu_short_name("NVIDIA H100 80GB HBM3"), gpu_short_name("NVIDIA H200"), gpu_short_name("Tesla T4")
    ('h100', 'h200', 't4')
    """
    import re

    match = re.search(r"\b([A-Z]{1,2}\d{1,4}[A-Z]?)\b", name.upper())
    return match.group(1).lower() if match else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_copy_gbs() -> float:
    src = torch.randn(16 * MiB // 4)
    dst = torch.empty_like(src)
    t = wall_time(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() * 4 / (t.median_us * 1e-6) / 1e9

