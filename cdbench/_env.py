"""Keep every cache inside the project and never reach for the network.

Imported first by ``cdbench/__init__``. Values the user already set win, so a
GPU host can point the caches elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The folder all caches live in: ``$CDBENCH_CACHE_DIR``, else ``.cache`` at the repo root."""
    explicit = os.environ.get("CDBENCH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().parent.parent / ".cache"


def configure() -> None:
    root = cache_dir()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HOME", str(root / "huggingface"))
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(root / "tiktoken"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "torchinductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ.setdefault("XDG_CACHE_HOME", str(root / "xdg"))
    os.environ.setdefault("MPLCONFIGDIR", str(root / "matplotlib"))
