from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from cdbench.harness.config_io import (
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
    assert str(err.value) == "config: unknown key 'workload.rte' (value 3); allowed keys here: corpus, rate"


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
