"""Live decode steps against a minimal reference forward of the same shapes and the weight-bytes floor.

For a model, at decode shapes (rows x cached context; by default the calibration's decode rows 1-256 at
512, 2048 and 8192 cached tokens, rows x context at most 2^18 tokens), on one device:

- ``live_ms``: the live forward's decode step as ``cdbench calibrate`` times it
  (:func:`cdbench.harness.live.measure.measure_grid`, per-row decode attention: the paged KV cache, the
  fused rotary + KV write, the paged decode-attention kernel, the fused add + RMSNorm and SiLU-and-multiply;
  a CUDA graph's replays on a GPU);
- ``reference_ms``: a minimal forward of the same shapes (:class:`ReferenceForward`): random bf16 weights,
  a fused QKV projection, torch's ``scaled_dot_product_attention`` (flash attention on a Hopper GPU) over a
  contiguous cache of every row's keys, no rotary, no cache write, no q/k norm, the live forward's fused
  add + RMSNorm and SiLU-and-multiply (:mod:`cdbench.kernels.layer_ops`); a MoE's tokens go to the
  experts uniform routing would touch, assigned once (no router, no sort: the grouped GEMMs and one gather
  and scatter); timed the same way;
- ``floor_ms``: the bytes of the weights the step reads (every layer's projections and the LM head; a
  MoE's experts that uniform routing touches; not the embedding table, of which a step reads a row a token)
  over the device's measured copy bandwidth (bytes read plus written, a 1 GiB device-to-device copy on a
  GPU), the limit no forward beats; ``floor_kv_ms`` adds the KV cache's bytes the rows attend to.

One CSV row a shape and a markdown table (ratios live/reference, live/floor). Refuses hybrid models (their
linear-attention layers have no minimal form here). ``--device cpu`` with a tiny model's spec file runs the
same steps eagerly (``tests/test_reference_forward.py``)::

    python benchmarks/reference_forward.py --model llama-3.1-8b --out reports/calibration/reference_llama.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from cdbench.harness.costs.hardware import ModelSpec, intermediate_size, resolve_model
from cdbench.harness.live.measure import StepShape, measure_grid, time_repetitions
from cdbench.kernels.layer_ops import add_rms_norm, silu_and_mul

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV = (512, 2048, 8192)
MAX_TOKENS = 2**18
NORM_EPS = 1e-6
COLUMNS = ["model", "device", "rows", "kv", "live_ms", "reference_ms", "floor_ms", "floor_kv_ms", "weight_gb",
           "kv_gb", "copy_gbs", "live_over_reference", "live_over_floor", "reference_over_floor"]


def experts_touched(spec: ModelSpec, rows: int) -> int:
    """Experts ``rows`` tokens reach under uniform routing (rounded to whole experts, at least ``k``)."""
    e, k = spec.n_experts, spec.experts_per_token
    return max(k, min(e, round(e * (1 - (1 - k / e) ** rows))))


class ReferenceForward:
    """The minimal decode forward of ``spec`` (see the module doc): :meth:`step` runs one decode step of the
    rows of a cache from :meth:`cache`."""

    def __init__(self, spec: ModelSpec, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
        if spec.is_hybrid:
            raise ValueError(f"{spec.name}: the reference forward has no linear-attention layers (hybrid model)")
        if spec.attention != "gqa":
            raise ValueError(f"{spec.name}: the reference forward builds GQA models only")
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=self.device) * 0.02).to(dtype)

        h, d = spec.hidden_size, spec.head_dim
        self.q_width, self.kv_width = spec.n_heads * d, spec.n_kv_heads * d
        self.embed = weight(spec.vocab_size, h)
        self.lm_head = weight(h, spec.vocab_size)
        self.norm = torch.ones(h, device=self.device, dtype=dtype)
        self.layers = []
        for _ in range(spec.n_layers):
            layer = {"qkv": weight(h, self.q_width + 2 * self.kv_width), "o": weight(self.q_width, h)}
            if spec.is_moe:
                w, s = spec.moe_intermediate_size, spec.shared_expert_intermediate_size
                layer |= {"gate_up": weight(spec.n_experts, h, 2 * w), "down": weight(spec.n_experts, w, h)}
                if s:
                    layer |= {"shared_gate_up": weight(h, 2 * s), "shared_down": weight(s, h)}
            else:
                width = intermediate_size(spec)
                layer |= {"gate_up": weight(h, 2 * width), "down": weight(width, h)}
            self.layers.append(layer)

    def weight_bytes(self, rows: int) -> int:
        """Bytes of the weights a decode step of ``rows`` reads (the embedding table's rows aside)."""
        experts = experts_touched(self.spec, rows) if self.spec.is_moe else None
        total = self.lm_head.numel()
        for layer in self.layers:
            for name, t in layer.items():
                routed = experts is not None and name in ("gate_up", "down")
                total += t[0].numel() * experts if routed else t.numel()
        return total * torch.finfo(self.dtype).bits // 8

    def kv_bytes(self, rows: int, kv: int) -> int:
        """Bytes of the keys and values ``rows`` rows of ``kv`` cached tokens attend to, every layer."""
        return 2 * rows * kv * self.kv_width * self.spec.n_layers * torch.finfo(self.dtype).bits // 8

    def cache(self, rows: int, kv: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the keys and values ``[rows, kv_heads, kv, head_dim]`` (contiguous, one block a row)."""
        shape = (rows, self.spec.n_kv_heads, kv, self.spec.head_dim)
        return [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                 torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in self.layers]

    def routing(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A MoE's fixed assignment: each token's ``k`` experts spread over the touched ones, as the
        (token of each sorted pair, experts' block ends) the grouped GEMMs read; None for a dense model."""
        if not self.spec.is_moe:
            return None
        k, touched = self.spec.experts_per_token, experts_touched(self.spec, rows)
        pairs = sorted(((t * k + j) % touched, t) for t in range(rows) for j in range(k))
        token_of = torch.tensor([t for _, t in pairs], device=self.device)
        counts = torch.zeros(self.spec.n_experts, dtype=torch.int64)
        for e, _ in pairs:
            counts[e] += 1
        return token_of, counts.cumsum(0).to(torch.int32).to(self.device)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]],
             routing: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        spec, rows = self.spec, tokens.shape[0]
        group = spec.n_heads // spec.n_kv_heads
        # the residual stream: each sublayer's output added and the sum normalized in one kernel
        residual = F.embedding(tokens, self.embed)
        normed, _ = add_rms_norm(residual, self.norm, NORM_EPS)
        for layer, (keys, values) in zip(self.layers, cache, strict=True):
            q, _, _ = (normed @ layer["qkv"]).split([self.q_width, self.kv_width, self.kv_width], dim=-1)
            # the G query heads sharing a KV head as its G query positions (one read of its keys)
            q = q.reshape(rows, spec.n_kv_heads, group, spec.head_dim)
            o = F.scaled_dot_product_attention(q, keys, values)
            normed, residual = add_rms_norm(residual, self.norm, NORM_EPS, o.reshape(rows, self.q_width) @ layer["o"])
            if routing is None:
                ffn = silu_and_mul(normed @ layer["gate_up"]) @ layer["down"]
            else:
                token_of, ends = routing
                y = F.grouped_mm(silu_and_mul(F.grouped_mm(normed[token_of], layer["gate_up"], offs=ends)),
                                 layer["down"], offs=ends)
                ffn = torch.zeros_like(normed).index_add_(0, token_of, y)
                if "shared_gate_up" in layer:
                    ffn += silu_and_mul(normed @ layer["shared_gate_up"]) @ layer["shared_down"]
            normed, residual = add_rms_norm(residual, self.norm, NORM_EPS, ffn)
        return normed @ self.lm_head


def time_reference(ref: ReferenceForward, rows: int, kv: int, min_reps: int, min_time_s: float) -> float:
    """Median seconds of a reference decode step (a CUDA graph's replays on a GPU, eager on a CPU)."""
    cache = ref.cache(rows, kv)
    tokens = torch.arange(rows, device=ref.device) * 7919 % ref.spec.vocab_size
    routing = ref.routing(rows)
    cuda = ref.device.type == "cuda"
    if cuda:
        stream = torch.cuda.Stream(ref.device)
        stream.wait_stream(torch.cuda.current_stream(ref.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                ref.step(tokens, cache, routing)
        torch.cuda.current_stream(ref.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ref.step(tokens, cache, routing)
        run = graph.replay
    else:
        def run():
            return ref.step(tokens, cache, routing)
    times = time_repetitions(run, cuda, min_reps, min_time_s)
    return statistics.median(times)


def copy_gbs(device: str) -> float:
    if device.startswith("cuda"):
        from cdbench.kernels.timing import copy_bandwidth_gbs

        return copy_bandwidth_gbs()
    from cdbench.kernels.bench import cpu_copy_gbs

    return cpu_copy_gbs()


def measure(spec: ModelSpec, shapes: list[StepShape], device: str, min_reps: int, min_time_s: float) -> list[dict]:
    """Every shape's live, reference and floor times (one dict a shape; the two forwards built in turn, so
    only one model's weights and cache are in memory at a time)."""
    live = measure_grid(spec, shapes, device, per_row=True, min_reps=min_reps, min_time_s=min_time_s)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    gbs = copy_gbs(device)
    ref = ReferenceForward(spec, device)
    rows = []
    for shape, measured in zip(shapes, live, strict=True):
        reference = time_reference(ref, shape.rows, shape.kv, min_reps, min_time_s)
        weights, kv = ref.weight_bytes(shape.rows), ref.kv_bytes(shape.rows, shape.kv)
        live_ms, ref_ms = measured.median_s * 1e3, reference * 1e3
        floor_ms, floor_kv_ms = weights / (gbs * 1e9) * 1e3, (weights + kv) / (gbs * 1e9) * 1e3
        rows.append(dict(model=spec.name, device=measured.gpu_device, rows=shape.rows, kv=shape.kv, live_ms=live_ms,
                         reference_ms=ref_ms, floor_ms=floor_ms, floor_kv_ms=floor_kv_ms, weight_gb=weights / 1e9,
                         kv_gb=kv / 1e9, copy_gbs=gbs, live_over_reference=live_ms / ref_ms,
                         live_over_floor=live_ms / floor_ms, reference_over_floor=ref_ms / floor_ms))
        print(f"{spec.name} decode {shape.rows}x{shape.kv}: live {live_ms:.3f} ms, reference {ref_ms:.3f} ms, "
              f"floor {floor_ms:.3f} ms (+KV {floor_kv_ms:.3f})", flush=True)
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"`{command}`", "", f"device: {rows[0]['device']}, copy bandwidth {rows[0]['copy_gbs']:.0f} GB/s "
             "(read + write)", "",
             "| model | rows | cached | live ms | reference ms | floor ms | floor + KV ms | live / reference "
             "| live / floor |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['rows']} | {r['kv']} | {r['live_ms']:.3f} | {r['reference_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['floor_kv_ms']:.3f} | {r['live_over_reference']:.3f} | "
                     f"{r['live_over_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a built-in model or a spec file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--kv", type=int, nargs="+", default=list(KV))
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="largest rows x cached context")
    parser.add_argument("--min-reps", type=int, default=10)
    parser.add_argument("--min-time", type=float, default=0.25, help="seconds of repetitions a shape, at least")
    parser.add_argument("--out", type=Path, required=True, help="the CSV; the markdown table beside it (.md)")
    args = parser.parse_args(argv)
    try:
        spec = resolve_model(args.model)
        if spec.is_hybrid:
            raise ValueError(f"{spec.name}: the reference forward has no linear-attention layers (hybrid model)")
    except ValueError as error:
        parser.error(str(error))
    shapes = [StepShape(rows=r, kv=kv) for kv in args.kv for r in args.rows if r * kv <= args.max_tokens]
    if not shapes:
        parser.error(f"no shape of --rows x --kv is within --max-tokens {args.max_tokens}")
    rows = measure(spec, shapes, args.device, args.min_reps, args.min_time)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    command = "python benchmarks/reference_forward.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
