"""Shared launch helpers: when to run Triton, input checks, and grid shapes."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Run the Triton kernel (CUDA tensors, or any tensors under the interpreter); else the reference."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return interpret_mode() or next(iter(devices)).type == "cuda"


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_wanted(device: torch.device) -> int:
    """Enough programs to keep every SM busy with several in flight (1 under the interpreter)."""
    if device.type != "cuda":
        return 1
    return 8 * sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pick_block(n_rows: int, n_cols: int, device: torch.device, largest: int = 8192, smallest: int = 1024) -> int:
    """Largest power-of-two column block that still yields enough programs to fill the GPU."""
    block = largest
    while block > smallest and n_rows * -(-n_cols // block) < programs_wanted(device):
        block //= 2
    # Tiny rows (tests, the interpreter): no wider than the row, rounded up to a power of two.
    return max(32, min(block, 1 << max(n_cols - 1, 1).bit_length()))


def check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous (stride 1 along the vocabulary)")


def check_bitmask(bitmask: torch.Tensor, n_rows: int | None = None) -> None:
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32 [batch, words], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.stride(1) != 1:
        raise ValueError("bitmask rows must be contiguous")
    if n_rows is not None and bitmask.shape[0] != n_rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows but logits have {n_rows}")


def as_index_tensor(
    values: torch.Tensor | Sequence[int] | None, limit: int, device: torch.device, what: str
) -> torch.Tensor | None:
    """Int32 tensor of row or token ids on ``device``; ids are range-checked when on the host.

    Ids already on a GPU are not checked (that would synchronize the stream).
    """
    if values is None:
        return None
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.int64)
    if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise TypeError(f"{what} must be a 1-D integer tensor or sequence, got {tensor.dtype} {tuple(tensor.shape)}")
    if tensor.device.type == "cpu" and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise IndexError(f"{what} contains {bad}, outside [0, {limit})")
    return tensor.to(device=device, dtype=torch.int32)
