import pytest

from cdbench.results.config_files import ConfigError
from cdbench.results.sweep import SweepSpec, expand_grid, load_sweep, point_config


def test_grid_is_the_product_in_file_order_with_readable_unique_names():
    spec = SweepSpec(grid={"workload.rate": [1, 2], "scheduler.overlap": [True, False], "a.name": ["x"], "b.name": ["y"]})
    points = expand_grid(spec)
    assert len(points) == 4
    assert points[0].name == "rate=1,overlap=True,a.name=x,b.name=y"
    assert len({p.name for p in points}) == 4
    assert [p.index for p in points] == [0, 1, 2, 3]
    assert point_config({"workload": {"rate": 9, "seed": 1}}, points[3]) == {
        "workload": {"rate": 2, "seed": 1}, "scheduler": {"overlap": False}, "a": {"name": "x"}, "b": {"name": "y"},
    }


def test_folder_names_are_safe():
    spec = SweepSpec(grid={"backend.name": ["a/b c"]})
    assert expand_grid(spec)[0].name == "name=a_b_c"


def test_sweep_file_errors_name_the_problem(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("grid: {}\n")
    with pytest.raises(ConfigError, match="at least one parameter"):
        load_sweep(path)
    path.write_text("grid: {workload.rate: [1]}\ngrdi: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'grdi'"):
        load_sweep(path)


def test_base_relative_to_the_sweep_file_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("workload: {rate: 1}\nseed: 3\n")
    path = tmp_path / "s.yaml"
    path.write_text("base: base.yaml\noverrides: {seed: 4, workload.requests: 10}\ngrid: {workload.rate: [1, 2]}\n")
    spec, base = load_sweep(path)
    assert base == {"workload": {"rate": 1, "requests": 10}, "seed": 4}
    assert [p.values for p in expand_grid(spec)] == [{"workload.rate": 1}, {"workload.rate": 2}]


def test_parameters_that_cannot_change_the_results_are_named():
    from cdbench.harness.config import RunConfig
    from cdbench.results.sweep import ineffective_parameters

    spec = SweepSpec(grid={"backend.name": ["xgrammar", "llguidance"], "workload.arrival.rate": [1, 2]})

    def configs(**tree):
        return [RunConfig.model_validate({**tree, "backend": {"name": b}}) for b in spec.grid["backend.name"]]

    fixed = configs(mode="model", costs={"fixed_grammar": {"compile_time_s": 0.05}})
    assert ineffective_parameters(spec, fixed) == [
        "grid parameter backend.name has no effect here (model mode with costs.fixed_grammar: grammar costs are "
        "those constants whatever the backend); its points differ only in name"]
    assert "costs.grammar_profile: that profile" in ineffective_parameters(
        spec, configs(mode="model", costs={"grammar_profile": "xgrammar"}))[0]
    assert ineffective_parameters(spec, configs(mode="model")) == []  # each backend's own profile
    assert ineffective_parameters(spec, configs(mode="hybrid", costs={"fixed_grammar": {}})) == []  # real backend
    profiles = SweepSpec(grid={"costs.grammar_profile": ["xgrammar", "outlines"]})
    assert "matter in model mode only" in ineffective_parameters(profiles, [RunConfig(mode="hybrid")])[0]
