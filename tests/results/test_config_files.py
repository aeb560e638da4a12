import os
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.config import RunConfig
from cdbench.results.config_files import (
    ConfigError,
    apply_overrides,
    builtin_config_path,
    read_yaml_mapping,
    set_dotted,
    validate_config,
)


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rate: float = Field(1.0, gt=0)
    corpus: str = "embedded"


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: Literal["sglang", "vllm"] = "sglang"
    workload: Inner = Inner()
    name: str


def test_unknown_key_names_the_key_the_value_and_the_allowed_keys():
    with pytest.raises(ConfigError) as err:
        validate_config(Outer, {"name": "x", "workload": {"rte": 3}})
    assert str(err.value) == ("config: unknown key 'workload.rte' (value 3); allowed keys here: corpus, rate; "
                              "did you mean 'rate'?")


def test_bad_value_names_the_key_the_value_and_what_is_allowed():
    with pytest.raises(ConfigError) as err:
        validate_config(Outer, {"name": "x", "policy": "trtllm"}, source="run.yaml")
    assert str(err.value) == "run.yaml: policy = 'trtllm': Input should be 'sglang' or 'vllm'"
    with pytest.raises(ConfigError, match=r"workload.rate = -1: Input should be greater than 0"):
        validate_config(Outer, {"name": "x", "workload": {"rate": -1}})
    with pytest.raises(ConfigError, match="name is required but missing"):
        validate_config(Outer, {})


def test_overrides_set_nested_keys_without_touching_the_original():
    base = {"workload": {"rate": 1.0}}
    out = apply_overrides(base, {"workload.rate": 4.0, "workload.corpus": None, "policy": "vllm"})
    assert out == {"workload": {"rate": 4.0}, "policy": "vllm"}
    assert base == {"workload": {"rate": 1.0}}
    with pytest.raises(ConfigError, match="workload.rate is a value"):
        set_dotted(out, "workload.rate.x", 1)


def test_yaml_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_yaml_mapping(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\nb: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line"):
        read_yaml_mapping(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_yaml_mapping(listy)
    with pytest.raises(ConfigError, match="no built-in config"):
        builtin_config_path("nope")


def _run_config_error(workload: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(RunConfig, {"workload": {"num_requests": 3, **workload}}, source="run.yaml")
    return str(err.value)


def test_unknown_key_inside_a_tagged_section_names_the_real_path_and_the_keys_of_that_kind():
    message = _run_config_error({"arrival": {"process": "poisson", "rte": 3}})
    # One line: the typo explains the "rate is required" pydantic also reports, so that line is dropped.
    assert message == ("run.yaml: unknown key 'workload.arrival.rte' (value 3); allowed keys here (process: poisson): "
                       "closed_loop, process, rate; did you mean 'rate'?")
    gamma = _run_config_error({"arrival": {"process": "gamma", "rate": 3}})
    assert gamma == "run.yaml: workload.arrival.burstiness is required but missing"
    lengths = _run_config_error({"output_len": {"dist": "lognormal", "median": 3, "sigma": 1, "mx": 9}})
    assert lengths.startswith("run.yaml: unknown key 'workload.output_len.mx' (value 9); allowed keys here "
                              "(dist: lognormal): dist, max, median, min, sigma")


def test_a_tagged_section_without_or_with_a_wrong_tag_lists_the_kinds():
    kinds = "poisson, gamma, constant, closed_loop, replay"
    assert _run_config_error({"arrival": {"rate": 3}}) == (
        f"run.yaml: workload.arrival needs 'process' to say which kind it is (one of: {kinds}); given {{rate}}")
    assert _run_config_error({"arrival": {"process": "bursty", "rate": 3}}) == (
        f"run.yaml: workload.arrival.process = 'bursty': must be one of {kinds}")


@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(
    lambda k: k not in ("closed_loop", "process", "rate")))
def test_any_unknown_arrival_key_is_named_at_its_path_never_with_the_tag(key):
    message = _run_config_error({"arrival": {"process": "poisson", "rate": 1, key: 1}})
    assert message.startswith(f"run.yaml: unknown key 'workload.arrival.{key}' (value 1); allowed keys here")
    assert "poisson." not in message and "\n" not in message


def test_a_directory_or_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        read_yaml_mapping(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        read_yaml_mapping(binary)


def test_a_file_without_read_permission_is_a_config_error(tmp_path):
    locked = tmp_path / "locked.yaml"
    locked.write_text("mode: model\n")
    locked.chmod(0)
    if os.access(locked, os.R_OK):
        pytest.skip("running as root: permissions do not stop reads")
    with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
        read_yaml_mapping(locked)
