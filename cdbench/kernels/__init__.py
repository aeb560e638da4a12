"""GPU kernels (Triton) with torch references, and the mask kernels' measured cost tables.

Public kernels: :func:`apply_bitmask`, :func:`apply_bool_mask`,
:func:`set_token_filter`, :func:`masked_argmax` (grammar masks), and
:func:`cdbench.kernels.decode_attention.decode_attention` (the live forward's
decode rows over its paged KV cache; imported from its module, whose name it shares),
:func:`rotary_kv_write` (the live forward's fused rotary and KV-cache write), :func:`add_rms_norm` and
:func:`silu_and_mul` (its fused residual add + RMSNorm and SiLU-and-multiply). CPU tensors run the torch
reference (:mod:`cdbench.kernels.reference`) unless ``TRITON_INTERPRET=1``.
They are imported lazily, so reading a cost table does not import Triton.
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "add_rms_norm": "cdbench.kernels.layer_ops",
    "apply_bitmask": "cdbench.kernels.bitmask",
    "apply_bool_mask": "cdbench.kernels.bitmask",
    "masked_argmax": "cdbench.kernels.sampling",
    "rotary_kv_write": "cdbench.kernels.rotary_kv",
    "set_token_filter": "cdbench.kernels.token_filter",
    "silu_and_mul": "cdbench.kernels.layer_ops",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
