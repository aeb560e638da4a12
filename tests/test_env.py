"""Importing cdbench keeps every cache inside the project and turns the network off.

Each check runs in a fresh interpreter, since the variables are set once, at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cdbench._env as env

VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "TIKTOKEN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
             "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "MPLCONFIGDIR", "CDBENCH_CACHE_DIR")
PROBE = """
import json, os
import cdbench
import huggingface_hub.constants as hf
print(json.dumps({"env": {k: os.environ.get(k) for k in %r}, "hf_offline": hf.HF_HUB_OFFLINE}))
""" % (VARIABLES,)


def _import_cdbench(**set_env: str) -> dict:
    """The variables and huggingface_hub's offline flag after ``import cdbench`` with only ``set_env`` set."""
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    result = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **set_env}, capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout)


def test_caches_live_in_the_cache_folder_and_the_hub_is_offline(tmp_path):
    seen = _import_cdbench(CDBENCH_CACHE_DIR=str(tmp_path))
    found = seen["env"]
    assert found["HF_HUB_OFFLINE"] == "1" and found["TRANSFORMERS_OFFLINE"] == "1"
    assert seen["hf_offline"] is True, "huggingface_hub would reach for the network"
    for name, folder in (("HF_HOME", "huggingface"), ("TIKTOKEN_CACHE_DIR", "tiktoken"),
                         ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("TRITON_CACHE_DIR", "triton"),
                         ("XDG_CACHE_HOME", "xdg"), ("MPLCONFIGDIR", "matplotlib")):
        assert found[name] == str(tmp_path / folder), name


def test_without_a_cache_variable_the_folder_is_dot_cache_at_the_repo_root():
    repo = Path(env.__file__).resolve().parent.parent
    found = _import_cdbench()["env"]
    assert found["TIKTOKEN_CACHE_DIR"] == str(repo / ".cache" / "tiktoken")
    assert found["TORCHINDUCTOR_CACHE_DIR"] == str(repo / ".cache" / "torchinductor")


def test_values_the_user_set_win(tmp_path):
    mine = str(tmp_path / "my-tiktoken")
    found = _import_cdbench(CDBENCH_CACHE_DIR=str(tmp_path / "cache"), TIKTOKEN_CACHE_DIR=mine, HF_HUB_OFFLINE="0")
    assert found["env"]["TIKTOKEN_CACHE_DIR"] == mine and found["env"]["HF_HUB_OFFLINE"] == "0"
    assert found["hf_offline"] is False
    assert found["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "torchinductor")


@pytest.mark.parametrize("value", ["", None])
def test_cache_dir_follows_the_variable(monkeypatch, tmp_path, value):
    if value is None:
        monkeypatch.delenv("CDBENCH_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("CDBENCH_CACHE_DIR", value)
    assert env.cache_dir() == Path(env.__file__).resolve().parent.parent / ".cache"
    monkeypatch.setenv("CDBENCH_CACHE_DIR", str(tmp_path))
    assert env.cache_dir() == tmp_path
