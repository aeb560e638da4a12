"""A run configuration checked before anything runs: :func:`validate_run_config`.

Beyond the configuration's own checks it refuses a ``model`` run without a grammar-cost source and one too
large for this machine, and resolves what a live run or a probe measured: ``costs.host_costs=live-run:<ref>``
into the live run's host costs (:mod:`cdbench.results.live_loop_costs`), ``costs.rank_costs=live-run:<ref>``
into its ranks' prices (:mod:`cdbench.results.live_rank_costs`), ``costs.forward_speed=live-run:<ref>`` into
its forward speed (:mod:`cdbench.results.live_forward_speed`), ``costs.forward_speed=probe:<file>`` into
the probe's, ``costs.spec_host_scale=probe:<file>`` into that spec-cost probe's scales, and
``costs.spec_host_scale=live-run:<ref>`` into the run's compile speed against the spec-cost store
(:mod:`cdbench.results.live_compile_speed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cdbench.results.config_files import ConfigError, validate_config
from cdbench.results.errors import ResultsError

if TYPE_CHECKING:
    from cdbench.harness.config import RunConfig


def validate_run_config(tree: Mapping[str, Any], source: str = "config") -> RunConfig:
    """A :class:`RunConfig` from a mapping, or a one-line :class:`ConfigError`.

    Beyond the model's own checks, a ``model``-mode run must have a grammar-cost
    source: constants, a profile file, or the profile shipped for its backend,
    measured with the run's backend, engine version and vocabulary unless
    ``costs.allow_mismatched_profile`` (checked here, so that a command refuses
    it before it claims its folder); and its estimated memory must fit in what this machine has available
    (:func:`cdbench.harness.footprint.refusal`), so an absurd request count is
    refused in a second instead of exhausting the machine.
    """
    from cdbench.harness import footprint
    from cdbench.harness.config import RunConfig
    from cdbench.harness.costs.grammar_profile import (
        ProfileError,
        is_profile_file,
        shipped_profiles,
    )

    config = validate_config(RunConfig, tree, source)
    if config.costs.host_costs != "preset":
        config = _with_live_loop_costs(config, source)
    if config.costs.rank_costs != "preset":
        config = _with_live_rank_costs(config, source)
    if isinstance(config.costs.forward_speed, str):
        config = _with_forward_speed(config, source)
    if config.costs.speed_sigma():
        config = _with_speed_drawn(config, source)
    if isinstance(config.costs.spec_host_scale, str):
        config = _with_spec_host_scale(config, source)
    if config.mode == "model" and config.costs.fixed_grammar is None:
        key, name = ("costs.grammar_profile", config.costs.grammar_profile) if config.costs.grammar_profile else (
            "backend.name", config.backend.name)
        if is_profile_file(name):
            if not Path(name).is_file():
                raise ConfigError(f"{source}: {key} = {name!r}: no such grammar profile file")
        elif name not in shipped_profiles():
            shipped = ", ".join(shipped_profiles())
            raise ConfigError(f"{source}: {key} = {name!r}: model mode needs a grammar profile and none is shipped "
                              f"for it (shipped: {shipped}); set costs.grammar_profile or costs.fixed_grammar")
        try:  # the profile read as the run reads it (not priced: that needs the workload)
            config.costs.grammar_costs(config.backend.name, config.seed, config.backend.options, vocab=config.vocab)
        except ProfileError as err:
            raise ConfigError(f"{source}: {err}") from None
    too_big = footprint.refusal(config)
    if too_big is not None:
        raise ConfigError(f"{source}: {too_big}")
    return config


def _refuse_live(config: RunConfig, source: str, field: str, what: str) -> None:
    """A live run measures what ``costs.<field>`` takes from another live run: :class:`ConfigError` when
    ``config`` is one."""
    if config.mode == "live":
        raise ConfigError(f"{source}: costs.{field} prices a model or hybrid run with {what}; a live run "
                          "measures its own (leave it 'preset')")


def _with_scheduler_values(config: RunConfig, values: Mapping[str, Any]) -> RunConfig:
    """``config`` with ``values`` in its scheduler fields, in place of the preset's and any set in the config."""
    overrides = {**config.scheduler.model_dump(exclude_unset=True), **values}
    return config.model_copy(update={"scheduler": type(config.scheduler).model_validate(overrides)})


def _with_live_loop_costs(config: RunConfig, source: str) -> RunConfig:
    """``config`` with the host-cost fields of the live run its ``costs.host_costs`` names
    (:mod:`cdbench.results.live_loop_costs`)."""
    from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX, live_loop_costs

    _refuse_live(config, source, "host_costs", "a live run's host costs")
    try:
        costs = live_loop_costs(config.costs.host_costs.removeprefix(LIVE_RUN_PREFIX))
    except ResultsError as err:
        raise ConfigError(f"{source}: costs.host_costs: {err}") from None
    return _with_scheduler_values(config, costs.values)


def _with_live_rank_costs(config: RunConfig, source: str) -> RunConfig:
    """``config`` with the rank prices of the live run its ``costs.rank_costs`` names
    (:mod:`cdbench.results.live_rank_costs`), which must have run as many tensor-parallel ranks."""
    from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX
    from cdbench.results.live_rank_costs import live_rank_costs

    _refuse_live(config, source, "rank_costs", "a live run's ranks")
    ref = config.costs.rank_costs.removeprefix(LIVE_RUN_PREFIX)
    try:
        costs = live_rank_costs(ref)
    except ResultsError as err:
        raise ConfigError(f"{source}: costs.rank_costs: {err}") from None
    ranks = config.scheduler_config()
    if ranks.ranks != costs.ranks or ranks.parallel != "tp":
        raise ConfigError(f"{source}: costs.rank_costs: {ref} ran {costs.ranks} tensor-parallel ranks; this run has "
                          f"{ranks.ranks} {ranks.parallel} rank(s) (set scheduler.ranks={costs.ranks} and "
                          "scheduler.parallel=tp)")
    return _with_scheduler_values(config, costs.values)


def _with_forward_speed(config: RunConfig, source: str) -> RunConfig:
    """``config`` with its ``costs.forward_speed`` source (a live run, a probe file) fitted into a
    :class:`~cdbench.harness.costs.forward_speed.ForwardSpeed` that names it (its config.yaml then reruns
    without the source)."""
    from cdbench.harness.costs.forward_speed import (
        PROBE_PREFIX,
        ForwardSpeedError,
        read_probe,
    )
    from cdbench.results.live_forward_speed import live_forward_speed
    from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX

    value = config.costs.forward_speed
    if config.mode == "live":
        raise ConfigError(f"{source}: costs.forward_speed prices a model or hybrid run's forward; a live run "
                          "runs its own (leave it 1)")
    try:
        if value.startswith(PROBE_PREFIX):
            forward = config.costs.model_copy(update={"forward_speed": 1.0}).build()
            speed = read_probe(value.removeprefix(PROBE_PREFIX), (forward.model.name, forward.gpu.name, forward.tp))
        else:
            speed = live_forward_speed(value.removeprefix(LIVE_RUN_PREFIX), config.costs)
    except (ResultsError, ForwardSpeedError) as err:
        raise ConfigError(f"{source}: costs.forward_speed: {err}") from None
    costs = config.costs.model_copy(update={"forward_speed": speed})
    return config.model_copy(update={"costs": costs})


def _with_speed_drawn(config: RunConfig, source: str) -> RunConfig:
    """``config`` with its forward speed times a lognormal factor of ``costs.forward_speed_sigma`` drawn from the
    run's seed (:class:`~cdbench.harness.costs.forward.ForwardConfig`), the draw named in the speed's source and
    the sigma then 0 (its config.yaml reruns the same speed).

    >>> from cdbench.harness.config import RunConfig
    >>> tree = {"mode": "model", "seed": 3, "costs": {"forward_speed": 1.02, "forward_speed_sigma": 0.01}}
    >>> drawn = _with_speed_drawn(RunConfig.model_validate(tree), "x").costs
    >>> drawn.speed().describe(), drawn.forward_speed_sigma
    ('1.01 (given, x0.9900 drawn: sigma 0.01, seed 3)', 0.0)
    """
    if config.mode == "live":
        raise ConfigError(f"{source}: costs.forward_speed_sigma draws a model or hybrid run's forward speed; a live "
                          "run runs its own (leave it 0)")
    sigma = config.costs.speed_sigma()
    factor = float(np.exp(sigma * np.random.default_rng([config.seed, _SPEED_STREAM]).standard_normal()))
    speed = config.costs.speed().scaled(factor, f"x{factor:.4f} drawn: sigma {sigma:g}, seed {config.seed}")
    costs = config.costs.model_copy(update={"forward_speed": speed, "forward_speed_sigma": 0.0})
    return config.model_copy(update={"costs": costs})


_SPEED_STREAM = 0x5EED  # the run speed's own random stream, apart from the run's other draws


def _with_spec_host_scale(config: RunConfig, source: str) -> RunConfig:
    """``config`` with its ``costs.spec_host_scale`` source (a probe file, a live or hybrid run) read into a
    :class:`~cdbench.harness.costs.spec_probe.SpecHostScale` that names it (its config.yaml then reruns
    without the source)."""
    from cdbench.harness.costs.spec_probe import (
        PROBE_PREFIX,
        SpecProbeError,
        read_probe,
    )
    from cdbench.results.live_compile_speed import live_compile_scale
    from cdbench.results.live_loop_costs import LIVE_RUN_PREFIX

    if config.mode != "model":
        raise ConfigError(f"{source}: costs.spec_host_scale prices a model run's specs; a {config.mode} run times "
                          "its grammar work itself (leave it unset)")
    value = config.costs.spec_host_scale
    by_size = {"auto": None, "by_size": True, "median": False}[config.costs.spec_probe_compile]
    try:
        if value.startswith(LIVE_RUN_PREFIX):
            scale = live_compile_scale(value.removeprefix(LIVE_RUN_PREFIX), config.costs, config.backend.name,
                                       config.vocab, config.backend.options, by_size is not False)
        else:
            scale = read_probe(value.removeprefix(PROBE_PREFIX), by_size=by_size)
    except (SpecProbeError, ResultsError) as err:
        raise ConfigError(f"{source}: costs.spec_host_scale: {err}") from None
    return config.model_copy(update={"costs": config.costs.model_copy(update={"spec_host_scale": scale})})


__all__ = ["validate_run_config"]
