from __future__ import annotations

import os
from pathlib import Path

import pytest

from cdbench.backends.vocab import load_vocab
from cdbench.workloads.instances import PoolCache


def shared_corpora() -> Path | None:
    shared = Path(os.environ.get("CDBENCH_SHARED", Path(__file__).resolve().parents[3] / "shared"))
    folder = shared / "corpora"
    return folder if folder.is_dir() else None


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    folder = shared_corpora()
    if folder is None:
        pytest.skip("shared corpora folder is absent")
    return folder


@pytest.fixture(scope="session")
def vocab():
    return load_vocab("cl100k")


@pytest.fixture
def pool_cache(tmp_path) -> PoolCache:
    return PoolCache(tmp_path / "pools")
