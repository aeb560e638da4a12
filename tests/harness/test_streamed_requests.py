"""A model run whose requests are not held: generated as they enter, kept in slots reused as they end.

It must be the run of the same requests held (the eager path), field by field, and hold state bounded by
the requests in flight, not by the run's length.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import SPEC

from cdbench.backends.vocab import load_vocab
from cdbench.harness import scheduler as scheduler_module
from cdbench.harness import step_cost, tallies
from cdbench.harness.config import RunConfig
from cdbench.harness.costs import cost_tables
from cdbench.harness.costs.gpu import FixedGpuCosts
from cdbench.harness.costs.grammar_profile import GrammarProfile
from cdbench.harness.costs.spec_profile import base_spec_id
from cdbench.harness.executors.model import FixedGrammarCosts, ModelExecutor
from cdbench.harness.metrics import LogHistogram
from cdbench.harness.policies import policy
from cdbench.harness.records import STEP_COLUMNS, StepLog
from cdbench.harness.run import simulate
from cdbench.harness.scheduler import Scheduler
from cdbench.workloads.generator import generate, original_of_copy
from cdbench.workloads.instances import spec_hash
from cdbench.workloads.request import Request
from cdbench.workloads.trace import replay, write_trace

DEFAULT = yaml.safe_load(open("cdbench/configs/default.yaml"))  # the built-in default run
WORKLOADS = {
    "default": dict(DEFAULT["workload"], num_requests=400),
    "JSON corpus, reasoning": dict(num_requests=300, seed=5, kinds=["json_schema"],
                                   reasoning={"fraction": 0.4, "think_len": {"dist": "fixed", "value": 20},
                                              "thinking_budget": 12}),
    "zipf, drafts": dict(num_requests=300, seed=2, spec_reuse={"mode": "zipf"}, spec_decode={"k": 3, "alpha": 0.6},
                         arrival={"process": "poisson", "rate": 40.0}),
}


def _run(config: RunConfig, requests, count: int | None = None):
    """``config``'s model run of ``requests`` (held, or read once with ``count``), as ``cdbench run`` builds it."""
    spec_decode = config.workload.spec_decode
    scheduler = config.scheduler_config(spec_tokens=spec_decode.k, spec_drafter=spec_decode.drafter)
    source = requests if count is None else (lambda: iter(requests))
    costs = config.costs.grammar_costs(config.backend.name, config.seed, config.backend.options, requests=source,
                                       vocab=config.vocab)
    return simulate(requests if count is None else iter(requests), scheduler, ModelExecutor(costs, spec_decode.alpha),
                    config.costs.gpu_costs(), seed=config.seed,
                    max_concurrency=config.workload.max_concurrency, slo=config.slo, trace_steps=0, count=count)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_run_of_requests_not_held_is_the_run_of_them_held(name, monkeypatch):
    config = RunConfig.model_validate({**DEFAULT, "mode": "model", "workload": WORKLOADS[name]})
    vocab = load_vocab(config.vocab)
    held = generate(config.workload, vocab, progress=False)
    streamed = generate(config.workload, vocab, progress=False, held=False)
    eager = _run(config, held.requests)
    monkeypatch.setattr(scheduler_module, "_SLOTS", 8)  # slots reused from the 9th request on, and grown
    monkeypatch.setattr(scheduler_module, "_AHEAD", 3)  # entered 3 at a time (the last chunk shorter)
    lazy = _run(config, list(streamed.iter_requests()), count=len(held.requests))
    pd.testing.assert_frame_equal(lazy.requests, eager.requests)
    pd.testing.assert_frame_equal(lazy.steps, eager.steps)
    assert lazy.summary == eager.summary
    assert lazy.compile_errors == eager.compile_errors


def test_a_replayed_trace_of_a_streamed_workload_is_the_same_run(tmp_path, monkeypatch):
    config = RunConfig.model_validate({**DEFAULT, "mode": "model", "workload": WORKLOADS["default"]})
    vocab = load_vocab(config.vocab)
    streamed = generate(config.workload, vocab, progress=False, held=False)
    write_trace(streamed, tmp_path / "t.jsonl")  # (from the streamed workload's requests)
    replayed = replay(config.workload.model_copy(update={"trace": str(tmp_path / "t.jsonl")}), vocab)
    eager = _run(config, replayed.requests)
    monkeypatch.setattr(scheduler_module, "_SLOTS", 8)
    monkeypatch.setattr(scheduler_module, "_AHEAD", 3)
    lazy = _run(config, list(streamed.iter_requests()), count=len(replayed.requests))
    pd.testing.assert_frame_equal(lazy.requests, eager.requests)
    assert lazy.summary == eager.summary


def test_a_long_run_holds_the_requests_in_flight_only(monkeypatch):
    """Copies of one spec (unique reuse) each their own key: the scheduler's slots, spec keys, compile
    cache and cost tables stay bounded by the requests in flight (and those entered ahead of their issue) over
    3,000 requests."""
    monkeypatch.setattr(scheduler_module, "_SLOTS", 16)
    monkeypatch.setattr(scheduler_module, "_AHEAD", 4)
    n = 3000
    requests = (Request(i, i * 0.05, 64, 6, SPEC, f"item#copy{i}") for i in range(n))  # one in flight at a time
    executor = ModelExecutor(FixedGrammarCosts(compile_time_s=0.001))
    sched = Scheduler(policy("vllm", overlap=False), requests, executor, FixedGpuCosts(forward_base_s=0.001),
                      count=n)
    sched.run()
    frame = sched.requests_frame()
    assert frame["request_id"].tolist() == list(range(n)) and frame["spec_key"].tolist() == list(range(n))
    assert (frame["finish_s"] > frame["arrival_s"]).all()
    assert len(sched.rec.finish_s) == 16  # never grown: every slot was reused
    assert not sched.keys.texts and not sched.cache._entries and not sched._outcomes
    assert len(executor.tables.base) == 16


def test_failed_copies_errors_are_held_by_item_not_by_copy():
    """Copies that fail to compile (about 1 % of the default workload's) keep their errors compactly: each
    item's text and each reason once, over 200 or 800 requests (a text and a reason a copy grew a run of ten
    million requests by about 25 MB); read back, the errors of every failed copy in key order."""
    held = {}
    for n in (200, 800):
        failing = [f"item#copy{i}" for i in range(0, n, 2)]
        requests = (Request(i, i * 0.05, 64, 6, SPEC, f"item#copy{i}") for i in range(n))
        executor = ModelExecutor(FixedGrammarCosts(compile_time_s=0.001, failing_keys=failing))
        sched = Scheduler(policy("vllm", overlap=False), requests, executor, FixedGpuCosts(forward_base_s=0.001),
                          count=n)
        sched.run()
        errors = sched.compile_errors
        assert list(errors.items()) == [(f"{SPEC.kind}:{k}", "invalid: listed in failing_keys") for k in failing]
        held[n] = len(sched._errors._stem_index), len(sched._errors._reason_index)
    assert held[200] == held[800] == (1, 1)


def test_failed_specs_are_listed_once_a_content_with_their_copies_counted():
    """The spec pricing lists a failed spec once per content with its copies' count (a listing of every copy
    grew ``summary.json`` by about 0.5 byte a request), the same whether the run holds its requests (priced key
    by key) or reads them as they are built (copies priced by their item)."""
    config = RunConfig.model_validate({**DEFAULT, "mode": "model",
                                       "workload": dict(DEFAULT["workload"], num_requests=1600)})
    requests = generate(config.workload, load_vocab(config.vocab), progress=False).requests
    profile = GrammarProfile.builtin(config.backend.name)
    by_content = {content: key for key, content in reversed(profile.spec_contents.items())}
    # counted apart: the run's spec keys whose content the profile has failed, by content, named by the first
    failing: dict[str, list] = {}
    for r in requests:
        if r.spec is None:
            continue
        found = profile.specs.get(by_content.get(spec_hash(original_of_copy(r.spec)), ""))
        if found is not None and found.status not in (None, "ok"):
            keys = failing.setdefault(spec_hash(original_of_copy(r.spec)), [base_spec_id(r.spec_id), set()])[1]
            keys.add(r.spec_id)
    listed = {}
    for source in (requests, lambda: iter(requests)):
        coverage = config.costs.grammar_costs(config.backend.name, config.seed, config.backend.options,
                                              requests=source, vocab=config.vocab).coverage
        listed[callable(source)] = [(f.label, f.copies) for f in coverage.failed]
    assert listed[True] == listed[False]
    assert sorted(listed[True]) == sorted((label, len(keys)) for label, keys in failing.values())
    assert sum(copies for _, copies in listed[True]) > 2 * len(listed[True]) > 0  # copies counted, not listed


def test_slots_grow_when_the_requests_in_flight_need_more(monkeypatch):
    n = 200
    requests = [Request(i, 0.0, 64, 50 + i, SPEC, f"item#copy{i}") for i in range(n)]  # all at once
    held = simulate(requests, policy("vllm", overlap=False), ModelExecutor(FixedGrammarCosts()),
                    FixedGpuCosts(forward_base_s=0.001), trace_steps=0)  # (a slot a request: fewer than _SLOTS)
    monkeypatch.setattr(scheduler_module, "_SLOTS", 4)
    monkeypatch.setattr(scheduler_module, "_AHEAD", 3)
    sched = Scheduler(policy("vllm", overlap=False), iter(requests), ModelExecutor(FixedGrammarCosts()),
                      FixedGpuCosts(forward_base_s=0.001), count=n)
    sched.run()
    assert len(sched.rec.finish_s) >= n  # (every request was in flight at once)
    pd.testing.assert_frame_equal(sched.requests_frame(), held.requests)


# --- runs of identical decode steps taken at once (Scheduler._decode_run) --------------------------------------

DECODE_RUNS = {  # (overrides of the default run, workload)
    "default": ({}, WORKLOADS["default"]),
    "default, no overlap": ({"scheduler": {"overlap": False}}, WORKLOADS["default"]),
    "closed loop": ({}, dict(WORKLOADS["default"], arrival={"process": "closed_loop", "max_concurrency": 6})),
    "vllm, KV cache short": ({"policy": {"name": "vllm"}, "scheduler": {"kv_tokens": 6000}},
                             dict(WORKLOADS["default"], arrival={"process": "poisson", "rate": 40.0})),
    "sglang, KV cache short, 2 host CPUs": ({"policy": {"name": "sglang", "host_cpus": 2},
                                            "scheduler": {"kv_tokens": 6000}},
                                           dict(WORKLOADS["default"], arrival={"process": "poisson", "rate": 40.0})),
    "JSON corpus, reasoning": ({}, WORKLOADS["JSON corpus, reasoning"]),
    "zipf, drafts": ({}, WORKLOADS["zipf, drafts"]),
    "fixed costs (the CI run)": (yaml.safe_load(open("cdbench/configs/ci.yaml")), {}),
    # compiles of 50 ms polled every 2 ms, given up after 12 polls that did not see them: runs through the
    # polls that see nothing, stopped before the one that sees a compile done or gives up on one
    "fixed costs, polls given up": (dict(yaml.safe_load(open("cdbench/configs/ci.yaml")),
                                         scheduler={"poll_interval_s": 0.002, "max_poll_iterations": 12}), {}),
}


def overrides_of(name: str) -> dict:
    return DECODE_RUNS[name][0]


def _counting_runs(monkeypatch) -> tuple[list[int], list[int]]:
    """The steps of each decode run taken, and of each taken while compiles were polled (appended as they are)."""
    taken: list[int] = []
    polled: list[int] = []
    run = Scheduler._decode_run

    def counted(self, t):
        queued = bool(self.grammar_queue)
        out = run(self, t)
        if out is not None:
            taken.append(out[1])
            if queued:
                polled.append(out[1])
        return out

    monkeypatch.setattr(Scheduler, "_decode_run", counted)
    return taken, polled


def _runs_past_finishes(monkeypatch) -> list[int]:
    """For each decode run taken, its steps after its first row's last token (appended as they are)."""
    past: list[int] = []
    run = Scheduler._decode_run

    def counted(self, t):
        first = int(self.batch.gen_left.min()) if len(self.batch) else 0
        out = run(self, t)
        if out is not None:
            past.append(max(out[1] - first, 0))
        return out

    monkeypatch.setattr(Scheduler, "_decode_run", counted)
    return past


def _at_once_as_one_by_one(config: RunConfig, requests, monkeypatch):
    """``config``'s run of ``requests`` with decode runs taken at once, checked to be the run of its steps one by
    one (no run long enough); the latter."""
    at_once = _run(config, requests)
    monkeypatch.setattr(scheduler_module, "_MIN_RUN", 1 << 30)
    one_by_one = _run(config, requests)
    pd.testing.assert_frame_equal(at_once.requests, one_by_one.requests)
    pd.testing.assert_frame_equal(at_once.steps, one_by_one.steps)
    assert at_once.summary == one_by_one.summary
    return one_by_one


def _decode_run_config(name: str) -> RunConfig:
    overrides, workload = DECODE_RUNS[name]
    data = {**DEFAULT, "mode": "model", **overrides}
    data["workload"] = {**overrides.get("workload", {}), **workload} if workload else overrides["workload"]
    return RunConfig.model_validate(data)


@pytest.mark.parametrize("name", list(DECODE_RUNS))
def test_decode_runs_taken_at_once_are_the_steps_one_by_one(name, monkeypatch):
    config = _decode_run_config(name)
    monkeypatch.setattr(LogHistogram, "BUFFER", 100)  # binned (and summed) a few rows at a time: within runs too
    monkeypatch.setattr(tallies, "ROWS", 50)
    requests = generate(config.workload, load_vocab(config.vocab), progress=False).requests
    taken, polled = _counting_runs(monkeypatch)
    past = _runs_past_finishes(monkeypatch)
    at_once = _run(config, requests)
    monkeypatch.setattr(scheduler_module, "_MIN_RUN", 1 << 30)  # no run is long enough: every step alone
    monkeypatch.setattr(scheduler_module, "_FEW_QUEUED", 0)  # and every poll through arrays
    one_by_one = _run(config, requests)
    pd.testing.assert_frame_equal(at_once.requests, one_by_one.requests)
    pd.testing.assert_frame_equal(at_once.steps, one_by_one.steps)
    assert at_once.summary == one_by_one.summary
    assert at_once.compile_errors == one_by_one.compile_errors
    if config.workload.spec_decode.k:
        assert not taken  # drafts vary a step's tokens: never taken at once
    else:
        assert taken
        if not overrides_of(name):  # the default run at its rate: mostly plain decode, mostly in runs
            assert sum(taken) > 0.5 * len(one_by_one.steps) and max(taken) > 8
    if name in ("default", "fixed costs (the CI run)", "fixed costs, polls given up"):  # (SGLang's polls)
        assert sum(polled) > 0.1 * ((one_by_one.steps["poll_s"] > 0) & (one_by_one.steps["kind"] == "decode")).sum()
    if name == "fixed costs, polls given up":
        assert (at_once.requests["abort_reason"] == "grammar_timeout").any()
    if name in ("default", "sglang, KV cache short, 2 host CPUs"):  # runs go on past rows' last tokens
        assert sum(past) > 0.1 * sum(taken)
    if name == "closed loop":  # (a finish issues the next request: the run ends there)
        assert not any(past)


@pytest.mark.parametrize("name, scheduler, table_rows", [("sglang", {}, None), ("sglang", {}, 1),
                                                         ("sglang", {"schedule_s": 0.03}, None),
                                                         ("vllm-0.10", {}, None)])
def test_decode_runs_past_a_finish_are_the_steps_one_by_one(name, scheduler, table_rows, monkeypatch):
    """A third of the default workload's requests unconstrained (and longer): runs go on past rows' last
    tokens, the batch and its grammar rows shrinking (and stop where no grammar row is left: a step without
    one is timed otherwise, as a loop slower than the forward shows), where the bitmask is pinned (SGLang);
    not where its copy waits for the forward (vLLM 0.10's pageable bitmask). Either way, the steps one by one; and
    so with the segments' parts built a segment at a time (``table_rows``: as for runs of more rows than the
    pricer's tables hold)."""
    if table_rows is not None:
        monkeypatch.setattr(step_cost, "_TABLE_ROWS", table_rows)
    config = RunConfig.model_validate({**DEFAULT, "mode": "model", "policy": {"name": name}, "scheduler": scheduler,
                                       "workload": dict(WORKLOADS["default"], arrival={"process": "poisson",
                                                                                      "rate": 5.0})})
    monkeypatch.setattr(LogHistogram, "BUFFER", 100)
    monkeypatch.setattr(tallies, "ROWS", 50)
    requests = [dataclasses.replace(r, spec=None, spec_id=None, output_tokens=None, output_len=r.output_len + 100)
                if i % 3 == 0 else r  # (longer: the grammar rows often leave first)
                for i, r in enumerate(generate(config.workload, load_vocab(config.vocab), progress=False).requests)]
    past = _runs_past_finishes(monkeypatch)
    _at_once_as_one_by_one(config, requests, monkeypatch)
    assert past and (any(past) if name == "sglang" else not any(past))


def test_accept_rows_and_curves_drawn_as_requests_enter_are_those_drawn_as_they_arrive(monkeypatch):
    """New cost specs' accept rows and replayed texts' curves drawn together as their requests enter (entered a
    few at a time, slots reused, the curves' width growing meanwhile; the curves only as far as their answers
    read them, a text taken again by a longer answer written whole; a text's curve kept once drawn, drawn
    again only wider or longer) give the run whose rows and curves are each drawn as its request arrives (at the
    whole width)."""
    config = RunConfig.model_validate({**DEFAULT, "mode": "model", "workload": WORKLOADS["default"]})
    streamed = generate(config.workload, load_vocab(config.vocab), progress=False, held=False)
    requests = list(streamed.iter_requests())
    for i in range(0, len(requests) - 1, 3):  # the next request replays the same text, reading 40 positions further
        r = requests[i]
        if r.output_tokens is not None:
            requests[i + 1] = dataclasses.replace(requests[i + 1], spec=r.spec, spec_id=r.spec_id,
                                                  output_tokens=r.output_tokens, output_len=r.output_len + 40,
                                                  instance_index=r.instance_index, random_walk=None)
    monkeypatch.setattr(scheduler_module, "_SLOTS", 8)
    monkeypatch.setattr(scheduler_module, "_AHEAD", 5)
    monkeypatch.setattr(cost_tables, "_DRAWN_TOGETHER", 2)
    drawn = []
    draw_ahead = cost_tables.ProfileTables._draw_ahead
    monkeypatch.setattr(cost_tables.ProfileTables, "_draw_ahead",
                        lambda self, specs: (drawn.append(len(specs)), draw_ahead(self, specs))[1])
    written, write_curve = [], cost_tables.ProfileTables._write_curve
    monkeypatch.setattr(cost_tables.ProfileTables, "_write_curve", lambda self, slot, item, reach: (
        written.append(item[0] == "text" and self._drawn_curves.get(item[1], (0,))[0] == self.width),
        retaken.append(self._curves.refs.get(item, 0) > 1),  # (its slot held: written again, longer)
        write_curve(self, slot, item, reach), narrow.append(self._curve_len[slot] < self.width))[1])
    retaken = []
    narrow: list[bool] = []
    kept, redrawn = [], []  # texts entering whose kept curve is taken again; curves drawn again no longer
    curves_ahead = cost_tables.ProfileTables._curves_ahead

    def tracked(self, texts, out_len):
        before = dict(self._drawn_curves)
        curves_ahead(self, texts, out_len)
        for text, (width, curve) in self._drawn_curves.items():
            old = before.get(text)
            if old is not None and old[1] is not curve and old[0] == width and len(curve) <= len(old[1]):
                redrawn.append(text)
        kept.extend(text for text in texts if text in before and before[text] is self._drawn_curves.get(text))

    monkeypatch.setattr(cost_tables.ProfileTables, "_curves_ahead", tracked)
    ahead = _run(config, requests, count=len(requests))
    assert sum(drawn) == len(requests)
    assert not redrawn and len(kept) >= 10, (redrawn, len(kept))  # (a text's curve drawn once a width, then kept)
    assert sum(written) > 0.5 * len(requests)  # (most curves taken as drawn ahead)
    assert sum(narrow) > 0.5 * len(requests) and sum(retaken) > 10  # (most of them narrower than the width)
    monkeypatch.setattr(cost_tables, "_DRAWN_AHEAD", 0)  # none drawn ahead
    alone = _run(config, requests, count=len(requests))
    pd.testing.assert_frame_equal(ahead.requests, alone.requests)
    pd.testing.assert_frame_equal(ahead.steps, alone.steps)
    assert ahead.summary == alone.summary
    pools = np.random.default_rng(4).lognormal(-11.0, 1.5, size=(5, cost_tables.SPAN))
    pools[2] = 0.0  # (a row whose mean is 0 is not scaled)
    means = np.array([1e-5, 3e-6, 1e-5, 0.0, 2.5e-4])
    rows = cost_tables._rows(pools, means)
    for pool, mean, row in zip(pools, means.tolist(), rows):
        assert row.tolist() == cost_tables._row(pool, mean).tolist()


@pytest.mark.parametrize("name", ["default", "vllm, KV cache short", "JSON corpus, reasoning", "zipf, drafts",
                                  "fixed costs (the CI run)"])
def test_a_lone_rows_step_in_scalars_is_the_step_of_arrays(name, monkeypatch):
    """A lone row's step in Python scalars (a prompt's first token, run alone) gives the run of arrays."""
    from cdbench.harness.executors import model as model_module

    config = _decode_run_config(name)
    requests = generate(config.workload, load_vocab(config.vocab), progress=False).requests
    lone, step = [], ModelExecutor._lone_step
    monkeypatch.setattr(ModelExecutor, "_lone_step", lambda self, *args: (lone.append(args), step(self, *args))[1])
    scalars = _run(config, requests)
    monkeypatch.setattr(model_module, "_LONE", 0)  # no step taken in scalars
    arrays = _run(config, requests)
    pd.testing.assert_frame_equal(scalars.requests, arrays.requests)
    pd.testing.assert_frame_equal(scalars.steps, arrays.steps)
    assert scalars.summary == arrays.summary
    assert lone
    if name == "default":  # (SGLang runs each prompt alone)
        assert len(lone) > 0.5 * len(requests) and any(grammar for _, _, grammar in lone)


@pytest.mark.parametrize("name", ["default", "closed loop", "sglang, KV cache short, 2 host CPUs",
                                  "JSON corpus, reasoning", "fixed costs (the CI run)"])
def test_a_lone_prompts_batch_formed_in_fewer_calls_is_forms_batch(name, monkeypatch):
    """The batch of one waiting prompt alone (SGLang's batches without decode rows), formed in fewer calls
    (:meth:`BatchFormer.form_lone`) and its step taken in Python scalars (:meth:`Scheduler._lone_prompt`), gives
    the run whose batches are all formed by :meth:`BatchFormer.form` and stepped as arrays: with a KV cache short
    enough to refuse admissions, retract and recompute too."""
    from cdbench.harness.admission import BatchFormer

    config = _decode_run_config(name)
    requests = generate(config.workload, load_vocab(config.vocab), progress=False).requests
    formed, form_lone = [], BatchFormer.form_lone
    monkeypatch.setattr(BatchFormer, "form_lone",
                        lambda self, *args: (lambda plan: (formed.append(plan is not None), plan)[1])(
                            form_lone(self, *args)))
    lone = _run(config, requests)
    monkeypatch.setattr(BatchFormer, "form_lone", lambda self, *args: None)  # every batch formed by form
    whole = _run(config, requests)
    pd.testing.assert_frame_equal(lone.requests, whole.requests)
    pd.testing.assert_frame_equal(lone.steps, whole.steps)
    assert lone.summary == whole.summary
    if name.startswith("sglang, KV cache short"):  # (at its rate, prompts mostly wait several at a time)
        assert any(formed) and (whole.requests["preemptions"] > 0).any()
    elif name != "JSON corpus, reasoning":  # (mixed batches)
        assert sum(formed) > 0.5 * len(requests)


def test_streams_seeded_together_are_those_numpy_seeds_one_by_one():
    """Streams seeded as arrays (and advanced past the fills' uniforms) are numpy's own, draw for draw."""
    rng = np.random.default_rng(7)
    for length in (1, 3, 4, 5, 8):
        words = rng.integers(0, 2**32, size=(20, length), dtype=np.uint64).astype(np.uint32)
        for jump, skip in ((cost_tables._lcg_jump(0), 0), (cost_tables._SKIP_FILLS, cost_tables.SPAN)):
            bits = np.random.Generator(np.random.PCG64(0))
            for row, (state, inc) in zip(words, cost_tables._stream_states(words, jump)):
                own = np.random.default_rng(row)
                own.bit_generator.advance(skip)
                bits.bit_generator.state = {"bit_generator": "PCG64", "state": {"state": state, "inc": inc},
                                            "has_uint32": 0, "uinteger": 0}
                assert bits.random(5).tolist() == own.random(5).tolist()
    entropy = [3, 0x6772, 2, 0x1234_5678_9ABC_DEF0_1122]  # (an integer of three words)
    assert cost_tables._words(entropy) == [3, 0x6772, 2, 0xDEF0_1122, 0x5678_9ABC, 0x1234]
    assert cost_tables._seeded(entropy).random(3).tolist() == np.random.default_rng(entropy).random(3).tolist()


def test_segments_forwards_priced_together_are_each_segment_priced_alone():
    """A run's segments priced at once: each step's forward as padded_decode pads its segment's rows."""
    from cdbench.harness.policies import padded_decode
    from cdbench.harness.step_cost import StepPricer

    config = RunConfig.model_validate({**DEFAULT, "mode": "model"})
    gpu = config.costs.gpu_costs()
    sizes = policy("sglang").cuda_graph_sizes
    pricer = StepPricer(policy("sglang"), gpu, None, lambda: None)
    for segments in ([(4, 3), (3, 5)], [(9, 2), (5, 4), (3, 1), (2, 6), (1, 3)], [(7, 1), (6, 2)]):
        rows = np.array([n for n, length in segments for _ in range(length)])
        lengths = [length for _, length in segments]
        kv = 1_000 + np.cumsum(rows)  # (over a page's end)
        steps = len(rows)
        cost = pricer.price_decode_run(rows, rows, lengths, np.full(steps, 1e-4), 0.0, np.full(steps, 1e-5),
                                       np.full(steps, 2e-5), kv, False, True, 1.0)
        alone = [gpu.forward_s(np.zeros(0), np.zeros(0), *padded_decode(sizes, n, c))
                 for n, c in zip(rows.tolist(), kv.tolist())]
        assert cost.forward_s.tolist() == alone


def test_a_step_logs_blocks_are_its_rows_appended_one_by_one():
    """Blocks of columns (arrays, or one value for the block) among rows appended as tuples: the frame of the
    rows appended one by one, in order and of the same column types (a column of integers in the blocks
    and floats in the rows is floats)."""
    rng = np.random.default_rng(1)

    def block(k: int, ints: bool) -> tuple:
        return tuple(("decode" if name == "kind" else rng.integers(0, 9, k) if ints and i % 2 else
                      int(rng.integers(0, 9)) if ints else rng.random(k) if i % 3 else float(rng.random()))
                     for i, name in enumerate(STEP_COLUMNS))

    def row(kind: str) -> tuple:
        return tuple(kind if name == "kind" else float(rng.random()) if i % 5 == 1 else int(rng.integers(0, 9))
                     for i, name in enumerate(STEP_COLUMNS))

    parts = [row("prefill"), block(3, True), block(1, False), row("idle"), row("mixed"), block(4, False),
             block(2, True)]
    for first in (0, 1):  # (blocks alone, and after rows)
        log, tuples = StepLog(), StepLog()
        for part in parts[first:]:
            if isinstance(part[0], np.ndarray) or isinstance(part[1], np.ndarray) or part[2] == "decode":
                k = max(len(v) for v in part if isinstance(v, np.ndarray))
                log.add_block(k, part)
                tuples.rows.extend(zip(*(v.tolist() if isinstance(v, np.ndarray) else [v] * k for v in part)))
            else:
                log.rows.append(part)
                tuples.rows.append(part)
        assert len(log) == len(tuples.rows)
        pd.testing.assert_frame_equal(log.take(), tuples.to_frame())
        assert len(log) == 0 and log.taken == len(tuples.rows)


def test_steps_of_varying_rows_are_binned_where_the_steps_one_by_one_are(monkeypatch):
    monkeypatch.setattr(LogHistogram, "BUFFER", 7)
    rng = np.random.default_rng(2)
    counts = rng.integers(1, 6, 40)
    values = rng.lognormal(-6.0, 2.0, int(counts.sum()))
    together, alone = LogHistogram(), LogHistogram()
    together.add_steps(values, counts)
    at = 0
    for k in counts.tolist():
        alone.add(values[at:at + k])
        at += k
    together._flush()
    alone._flush()
    assert (together.counts == alone.counts).all()
    assert (together.total, together.sq_total, together.weight) == (alone.total, alone.sq_total, alone.weight)


def test_decode_runs_of_a_replayed_trace_are_the_steps_one_by_one(tmp_path, monkeypatch):
    config = _decode_run_config("default")
    vocab = load_vocab(config.vocab)
    write_trace(generate(config.workload, vocab, progress=False), tmp_path / "t.jsonl")
    requests = replay(config.workload.model_copy(update={"trace": str(tmp_path / "t.jsonl")}), vocab).requests
    taken, polled = _counting_runs(monkeypatch)
    one_by_one = _at_once_as_one_by_one(config, requests, monkeypatch)
    assert sum(taken) > 0.5 * len(one_by_one.steps)


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-30b-a3b", "qwen3.5-35b-a3b"])
def test_forwards_priced_at_once_are_each_priced_alone(model):
    costs = RunConfig.model_validate({"costs": {"model": model, "gpu": "h100-sxm"}}).costs
    together, alone = costs.gpu_costs(), costs.gpu_costs()  # (each its own memo of priced steps)
    context = np.arange(0, 400_000, 997)
    for rows in (1, 3, 8, 47, 300):
        each = [alone.forward.step_s(0.0, 0.0, rows, c, 0) for c in context.tolist()]
        assert together.forward.decode_step_s(rows, context).tolist() == each
        assert together.decode_forward_s(rows, context[::2]).tolist() == each[::2]  # half of them remembered
        assert together.decode_forward_s(rows, context).tolist() == each
        assert [alone.forward_s(np.zeros(0), np.zeros(0), rows, c) for c in context.tolist()] == each  # (paged)
        run = 4_000 + rows * np.arange(64)  # a run's contexts, over a page's end
        assert together.decode_forward_s(rows, run).tolist() == [alone.forward.step_s(0.0, 0.0, rows, c, 0)
                                                                 for c in run.tolist()]
    fixed = FixedGpuCosts(forward_base_s=0.003, decode_row_s=1e-5, kv_token_s=3e-9)
    assert fixed.decode_forward_s(5, context).tolist() == \
        [fixed.forward_s(np.zeros(0), np.zeros(0), 5, c) for c in context.tolist()]


def test_a_blocks_row_sums_are_each_rows_sum_alone():
    """What a decode run's fill and processing sums rely on (numpy's pairwise sums, from 9 values on)."""
    rng = np.random.default_rng(0)
    for width in (1, 5, 8, 9, 47, 130, 300):
        block = rng.lognormal(-11.0, 1.5, size=(64, width))
        assert np.add.reduce(block, axis=1).tolist() == [float(np.add.reduce(row)) for row in block]


_COSTS = st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False) | st.floats(1e-9, 1e-1) | st.sampled_from(
    [1e16, -1e16, 1.0, 3.0e-7])  # (seconds, and magnitudes far apart, where the order of the adds shows)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(_COSTS, min_size=7, max_size=7), min_size=1, max_size=64), st.integers(1, 7),
       st.lists(st.integers(0, 64), min_size=7, max_size=7))
def test_fewer_than_8_values_numpy_sums_left_to_right(block, width, left):
    """The condition a decode run's sums in Python floats would need (issue 32, "Python floats for small runs"):
    numpy's reduction of fewer than 8 values, alone or a C-ordered block's rows, is Python's ``sum`` of them
    (left to right, from 0.0), and its running sum (``np.add.accumulate``) Python's running adds. So a run's
    rows summed with the rows gone as 0.0 are the rows still there summed alone (``Scheduler._decode_run``'s
    segments of fewer than ``_SUMMED_IN_TURN`` grammar rows)."""
    values = np.array(block)[:, :width]
    rows = [row[:width] for row in block]
    assert np.add.reduce(values, axis=1).tolist() == [sum(row) for row in rows]
    alive = np.array(left[:width]) > np.arange(len(block))[:, None]  # (a row of g tokens left leaves after step g)
    assert np.add.reduce(np.where(alive, values, 0.0), axis=1).tolist() == \
        [sum(value for value, there in zip(row, step) if there) for row, step in zip(rows, alive.tolist())]
    assert [float(np.add.reduce(np.array(row))) for row in rows] == [sum(row) for row in rows]
    column = np.array([row[0] for row in block])
    running, total = [], 0.0
    for value in column.tolist():
        total += value
        running.append(total)
    assert np.add.accumulate(column).tolist()[1:] == running[1:]  # (the first is the value, 0.0 + value but for -0.0)


def test_from_8_values_numpy_sums_pairwise():
    """... and from 8 values on it does not (``_SUMMED_IN_TURN``): its pairwise sum (8 running partial sums) differs
    from the sum left to right, so a sum with zeros among the values, or in Python floats, is the array's only on
    fewer rows."""
    n = scheduler_module._SUMMED_IN_TURN
    values = [1e16] + [1.0] * (n - 1)  # (each 1.0 lost added to 1e16 alone; 2.0 and more are not)
    assert float(np.add.reduce(np.array(values[:n - 1]))) == sum(values[:n - 1])
    assert float(np.add.reduce(np.array(values))) != sum(values)
