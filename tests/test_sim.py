"""The simulated executor (``executor: {name: sim}``): the executor is the only thing that
changes (a replayed real run schedules exactly the same steps), 10,000 requests complete with
nothing lost, calibration writes a profile the sim accepts, and a profile for another model,
dtype is refused naming both (the device is the profile's, whatever this machine has)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from corellm_plugins.bench.engine_driver import drive_engine, run_engine
from corellm_plugins.bench.targets import RunOptions, Target
from corellm_plugins.bench.workload import build_workload
from corellm.clock import WALL_CLOCK, Clock
from corellm_plugins.bench.costmodel import FittedCostModel
from corellm_plugins.bench.model_shape import ModelShape, model_fingerprint
from corellm_plugins.bench.profile import Profile
from corellm.engine.llm import LLM
from corellm.errors import ConfigError
from corellm.model_config import checkpoint_name, load_arch_config
from tests.conftest import assert_pool_whole, engine_config


def make_profile(path: Path, out: Path, *, dtype: str = "float32", device: str = "cpu",
                 base: float = 2e-3, per_token: float = 2e-5) -> Path:
    """A measured-kind profile for the checkpoint at ``path`` with chosen coefficients."""
    arch = load_arch_config(path)
    shape = ModelShape.from_arch(arch)
    model = FittedCostModel(base=base, per_req=1e-5, knots=[1, 4096],
                            knot_values=[per_token, per_token * 4096], a_prefill=1e-9,
                            a_prefill_kv=1e-8, a_decode=2e-8, per_sample=1e-5)
    Profile(kind="measured",
            model={"name": checkpoint_name(str(path)), "architecture": arch.architectures[0],
                   "fingerprint": model_fingerprint(arch)},
            dtype=dtype, device={"kind": device, "name": f"test {device}"}, block_size=16,
            kv_bytes_per_block=shape.kv_bytes_per_token(4) * 16, cost_model=model).save(out)
    return out


def sim_config(path: Path, profile: Path, **sections) -> dict:
    cfg = engine_config(path, **sections)
    cfg["executor"] = {"name": "sim", "profile": str(profile), **sections.get("executor", {})}
    return cfg


# ----------------------------------------------------------------------------- replay
class RecordingClock(Clock):
    """The wall clock, every reading kept in order."""

    def __init__(self) -> None:
        self.readings: list[tuple[str, float]] = []

    def time(self) -> float:
        v = WALL_CLOCK.time()
        self.readings.append(("time", v))
        return v

    def monotonic(self) -> float:
        v = WALL_CLOCK.monotonic()
        self.readings.append(("monotonic", v))
        return v


class ReplayClock(Clock):
    """Gives back a recorded run's readings, in order; sleeping takes no time."""

    def __init__(self, readings: list[tuple[str, float]]) -> None:
        self.readings = readings
        self.i = 0

    def _next(self, kind: str) -> float:
        assert self.i < len(self.readings), f"reading {self.i}: the real run read the clock " \
                                            f"only {len(self.readings)} times"
        got_kind, v = self.readings[self.i]
        assert got_kind == kind, f"reading {self.i}: the real run asked for {got_kind}, this " \
                                 f"one for {kind}"
        self.i += 1
        return v

    def time(self) -> float:
        return self._next("time")

    def monotonic(self) -> float:
        return self._next("monotonic")

    def sleep(self, seconds: float) -> None:
        pass


class PlanLog:
    """Stands in front of an engine's executor and keeps every step plan's content."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.plans: list[tuple] = []

    # Every step's plan is logged, so the engine runs one step per call (no decode runs).
    fixed_token_id = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute_model(self, plan) -> None:
        self.plans.append((tuple(plan.num_scheduled_tokens.items()),
                           tuple(plan.num_computed_tokens.items()),
                           tuple(plan.sampling_req_ids), tuple(sorted(plan.preempted_req_ids)),
                           tuple(sorted(plan.finished_req_ids)),
                           tuple(r.req_id for r in plan.scheduled_new_reqs)))
        return self.inner.execute_model(plan)


WORKLOADS = {
    # Poisson arrivals, two priority classes, prompts long enough to chunk and to run the
    # small pool out of blocks (preemption).
    "poisson": {"name": "poisson", "seed": 3, "num_requests": 24,
                "requests": {"input_len": {"dist": "uniform", "low": 8, "high": 120},
                             "output_len": {"dist": "uniform", "low": 4, "high": 24}},
                "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 2}],
                "arrivals": {"pattern": "poisson", "rate": 300}},
    # Multi-turn sessions: follow-ups timed from their previous turn's end, prefix-cache hits.
    "sessions": {"name": "sessions", "seed": 5,
                 "requests": {"input_len": {"dist": "uniform", "low": 16, "high": 64},
                              "output_len": {"dist": "uniform", "low": 4, "high": 12}},
                 "sessions": {"num_sessions": 5, "turns": 3,
                              "message_len": {"dist": "uniform", "low": 4, "high": 16},
                              "think_time_s": {"dist": "exponential", "mean": 0.01}},
                 "arrivals": {"pattern": "poisson", "rate": 200}},
}


def _run_logged(cfg: dict, workload, clock: Clock) -> tuple[list[tuple], list]:
    llm = LLM(cfg)
    try:
        engine = llm.engine
        engine.set_clock(clock)
        log = PlanLog(engine.executor)
        engine.executor = log
        records, _ = drive_engine(llm, workload, RunOptions(progress=False), salt="replay")
        engine.executor = log.inner
        assert_pool_whole(llm)
        return log.plans, records
    finally:
        llm.shutdown()


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_a_replayed_real_run_schedules_exactly_the_same_steps(llama_path, tmp_path, scheduler,
                                                               workload):
    """The real run's clock readings replayed into a sim run: every step plan (requests,
    tokens, context, sampled rows, preemptions, finishes, admissions) is the same, step by
    step, because the executor is the only thing that changed."""
    sections = {"scheduler": {"name": scheduler, "max_num_seqs": 6,
                              "max_num_batched_tokens": 64},
                "kv_cache": {"num_blocks": 16, "block_size": 16},
                "model": {"max_model_len": 200}}
    wl = build_workload(WORKLOADS[workload], vocab_size=200, exclude_ids={0})
    real_clock = RecordingClock()
    real_plans, real_records = _run_logged(engine_config(llama_path, **sections), wl, real_clock)
    profile = make_profile(llama_path, tmp_path / "p.json")
    replay = ReplayClock(list(real_clock.readings))
    sim_plans, sim_records = _run_logged(sim_config(llama_path, profile, **sections), wl, replay)

    assert all(r.ok for r in real_records) and all(r.ok for r in sim_records)
    assert len(real_plans) == len(sim_plans) > 10
    for i, (a, b) in enumerate(zip(real_plans, sim_plans)):
        assert a == b, f"step {i + 1} differs"
    assert replay.i == len(real_clock.readings)
    if workload == "poisson":       # the pool is small enough that requests were preempted
        assert any(p[3] for p in real_plans)
    assert [r.output_tokens for r in real_records] == [r.output_tokens for r in sim_records]


def test_the_plan_carries_what_the_runner_computes(llama_path):
    """num_computed_tokens and sampling_req_ids agree with the model runner's own state, for
    chunked prefills, decodes and prefix-cache hits."""
    llm = LLM(engine_config(llama_path, scheduler={"max_num_batched_tokens": 48}))
    runner = llm.engine.executor.worker.runner
    seen = []
    inner_execute, inner_sample = runner.execute_model, runner.sample_tokens

    def execute(plan):
        inner_execute(plan)
        for rid in plan.num_scheduled_tokens:
            assert plan.num_computed_tokens[rid] == runner.requests[rid].num_computed_tokens
        seen.append(plan)

    def sample(plan):
        out = inner_sample(plan)
        assert sorted(out.req_ids) == sorted(plan.sampling_req_ids)     # the runner reorders
        return out

    runner.execute_model, runner.sample_tokens = execute, sample
    try:
        from corellm import SamplingParams
        prompts = [{"prompt_token_ids": [5 + i % 7] * 40 + [9] * i} for i in range(6)]
        llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
        llm.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    finally:
        llm.shutdown()
    assert any(len(p.sampling_req_ids) < len(p.num_scheduled_tokens) for p in seen)  # chunks
    assert any(0 < c for p in seen for c in p.num_computed_tokens.values())


# ----------------------------------------------------------------------------- at scale
def test_ten_thousand_requests_complete_with_nothing_lost(llama_path, tmp_path):
    """10,000 requests of a synthetic Poisson workload through corellm bench's runner on the
    sim executor: every one finishes with its tokens, the pool is whole, and the run's virtual
    duration is what the cost model says, not the wall time it took."""
    profile = make_profile(llama_path, tmp_path / "p.json")
    cfg = sim_config(llama_path, profile, scheduler={"max_num_seqs": 128,
                                                     "max_num_batched_tokens": 2048},
                     kv_cache={"num_blocks": 4096, "block_size": 16})
    wl = build_workload({"name": "10k", "seed": 1, "num_requests": 10_000,
                         "requests": {"input_len": {"dist": "uniform", "low": 16, "high": 128},
                                      "output_len": {"dist": "uniform", "low": 8, "high": 32}},
                         "arrivals": {"pattern": "poisson", "rate": 400}},
                        vocab_size=200, exclude_ids={0})
    t0 = time.perf_counter()
    result = run_engine(Target("sim", config=cfg), wl, RunOptions(progress=False))
    wall = time.perf_counter() - t0
    assert len(result.records) == 10_000 and all(r.ok for r in result.records)
    assert sum(r.output_tokens for r in result.records) == sum(r.output_len for r in wl.requests)
    summary = result.summary()
    assert summary["completed"] == 10_000
    # Virtual time: the arrivals alone span ~25 s; the run takes at least that.
    assert result.duration > 20
    print(f"10,000 simulated requests: {wall:.1f} s wall, {result.duration:.1f} s simulated")


def test_virtual_time_prices_each_step(llama_path, tmp_path):
    """One request alone: its TTFT is the predicted prefill step, its TPOT the predicted
    decode step, to the microsecond, whatever the wall clock did."""
    profile = make_profile(llama_path, tmp_path / "p.json", base=0.01, per_token=0.001)
    llm = LLM(sim_config(llama_path, profile))
    try:
        wl = build_workload({"name": "one", "seed": 0, "num_requests": 1,
                             "requests": {"input_len": 50, "output_len": 4},
                             "arrivals": "all_at_once"}, vocab_size=200, exclude_ids={0})
        records, duration = drive_engine(llm, wl, RunOptions(progress=False), salt="one")
        model = llm.engine.executor.cost_model
    finally:
        llm.shutdown()
    from corellm_plugins.bench.costmodel import StepShape
    prefill = model.predict(StepShape.from_lists([50], [0], 1))
    decodes = [model.predict(StepShape.from_lists([1], [50 + k], 1)) for k in range(3)]
    r = records[0]
    assert r.ttft == pytest.approx(prefill, abs=1e-9)
    assert r.e2el == pytest.approx(prefill + sum(decodes), abs=1e-9)
    assert duration == pytest.approx(prefill + sum(decodes), abs=1e-9)


# ----------------------------------------------------------------------------- calibration
def test_calibrate_writes_a_profile_the_sim_runs_on(llama_path, tmp_path):
    from corellm.cli import main
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(engine_config(llama_path, scheduler={"max_num_seqs": 8,
                                                                  "max_num_batched_tokens": 128})))
    out = tmp_path / "prof.json"
    assert main(["bench", "calibrate", "--config", str(cfg), "-o", str(out), "--quick",
                 "--no-progress", "--plot", str(tmp_path / "fit.png")]) == 0
    profile = Profile.load(out)
    assert profile.kind == "measured" and profile.dtype == "float32"
    assert profile.device["kind"] == "cpu" and profile.model["name"] == llama_path.name
    assert len(profile.samples) >= 30 and (tmp_path / "fit.png").stat().st_size > 0
    shapes, seconds = profile.sample_data()
    assert any(s.num_decodes == s.num_reqs > 1 for s in shapes)              # decode batches
    assert any(s.num_decodes == 0 and s.num_prefill_tokens > 64 for s in shapes)   # prefills
    assert any(0 < s.num_decodes < s.num_reqs for s in shapes)                # mixed steps
    assert profile.cost_model.diagnostics["n_samples"] == len(shapes)
    # The profile prices the model it was measured on: a sim run with it goes through.
    llm = LLM(sim_config(llama_path, out, scheduler={"max_num_seqs": 8}))
    try:
        from corellm import SamplingParams
        outs = llm.generate([{"prompt_token_ids": [3] * 20}] * 3, SamplingParams(max_tokens=6),
                            use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
        assert outs[0].metrics.time_to_first_token > 0
    finally:
        llm.shutdown()


def test_a_profile_for_another_model_or_dtype_is_refused(llama_path, make_checkpoint,
                                                                 tmp_path):
    other = make_checkpoint("qwen3")
    profile = make_profile(other, tmp_path / "other.json")
    with pytest.raises(ConfigError) as err:
        LLM(sim_config(llama_path, profile))
    msg = str(err.value)
    assert "executor.profile" in msg and other.name in msg and llama_path.name in msg

    bf16 = make_profile(llama_path, tmp_path / "bf16.json", dtype="bfloat16")
    with pytest.raises(ConfigError, match="profile is for dtype bfloat16 but model.dtype is "
                                          "float32"):
        LLM(sim_config(llama_path, bf16))

    # The simulated device is the profile's, whatever platform this machine has: a profile
    # measured on a GPU is simulated here (a CPU machine).
    gpu = make_profile(llama_path, tmp_path / "gpu.json", device="cuda")
    llm = LLM(sim_config(llama_path, gpu))
    try:
        assert llm.engine.executor.profile.device["kind"] == "cuda"
        assert llm.config.platform.name == "cpu"
    finally:
        llm.shutdown()

    with pytest.raises(ConfigError, match="executor.profile"):
        LLM(sim_config(llama_path, tmp_path / "missing.json"))


def test_a_virtual_clock_cannot_serve_from_another_process(llama_path, tmp_path):
    from corellm.engine.ipc import EngineStartupError
    profile = make_profile(llama_path, tmp_path / "p.json")
    with pytest.raises(EngineStartupError, match="virtual clock.*executor.clock: real"):
        LLM(sim_config(llama_path, profile), engine_process=True)
    # A real clock serves: each step sleeps its predicted time.
    llm = LLM(sim_config(llama_path, profile, executor={"clock": "real"}), engine_process=True)
    try:
        from corellm import SamplingParams
        out = llm.generate([{"prompt_token_ids": [3] * 8}], SamplingParams(max_tokens=3),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_idle_waits_on_a_virtual_clock_end(llama_path, tmp_path):
    """Regression: an idle wait until the next arrival on a virtual clock far from zero (after
    a warm-up) once slept the rounding error of t0 + (due - t0) forever."""
    import threading
    profile = make_profile(llama_path, tmp_path / "p.json")
    llm = LLM(sim_config(llama_path, profile))
    try:
        llm.engine.clock.advance(45.712345678901)
        wl = build_workload({"name": "sparse", "seed": 2, "num_requests": 200,
                             "requests": {"input_len": 8, "output_len": 2},
                             "arrivals": {"pattern": "poisson", "rate": 3}},
                            vocab_size=200, exclude_ids={0})
        done = []
        t = threading.Thread(target=lambda: done.append(
            drive_engine(llm, wl, RunOptions(progress=False), salt="sparse")), daemon=True)
        t.start()
        t.join(60)
        assert done, "drive_engine did not return"
        records, duration = done[0]
        assert all(r.ok for r in records) and duration > 30
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- decode runs
DECODE_RUN_CASES = {
    # A pool small enough to preempt, chunked prompts, two priority classes.
    "preempting": ({"scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 96},
                    "kv_cache": {"num_blocks": 24, "block_size": 16}},
                   {"name": "p", "seed": 3, "num_requests": 120,
                    "requests": {"input_len": {"dist": "uniform", "low": 8, "high": 150},
                                 "output_len": {"dist": "uniform", "low": 1, "high": 60}},
                    "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 2}],
                    "arrivals": {"pattern": "poisson", "rate": 150}}, {}),
    # Shared prefixes: blocks completed inside runs are registered as the steps would have.
    "prefix": ({"kv_cache": {"block_size": 16}},
               {"name": "x", "seed": 4, "num_requests": 150,
                "requests": {"input_len": {"dist": "uniform", "low": 8, "high": 100},
                             "output_len": {"dist": "uniform", "low": 1, "high": 70},
                             "shared_prefix": {"num_groups": 3, "length": 40}},
                "arrivals": {"pattern": "poisson", "rate": 100}}, {}),
    # Sessions (follow-ups due at a previous turn's end plus think time) under a
    # concurrency limit, on the priority scheduler.
    "sessions": ({"scheduler": {"name": "priority"}, "kv_cache": {"block_size": 16}},
                 {"name": "s", "seed": 5,
                  "requests": {"input_len": {"dist": "uniform", "low": 16, "high": 64},
                               "output_len": {"dist": "uniform", "low": 2, "high": 50}},
                  "sessions": {"num_sessions": 30, "turns": 3, "message_len": 12,
                               "think_time_s": {"dist": "exponential", "mean": 0.02}},
                  "arrivals": {"pattern": "poisson", "rate": 60}}, {"max_concurrency": 6}),
}


@pytest.mark.parametrize("case", sorted(DECODE_RUN_CASES))
def test_decode_runs_change_nothing_but_the_number_of_calls(llama_path, tmp_path, monkeypatch,
                                                             case):
    """A simulated run advances pure-decode stretches several steps per call
    (``EngineCore.step_decode_run``); every record (each token's time included), the engine's
    counters and the run's duration are those of one step per call, and runs did happen."""
    from corellm.engine.core import EngineCore

    sections, spec, options = DECODE_RUN_CASES[case]
    cfg = sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"),
                     model={"max_model_len": 256}, **sections)
    wl = build_workload(spec, vocab_size=200, exclude_ids={0})
    original = EngineCore.step_decode_run
    runs: list[int] = []

    def counted(self, keep_going):
        out = original(self, keep_going)
        if out is not None:
            runs.append(len(out[0]))
        return out

    # The scheduler's round count (policies see it as SchedulingContext.step), read when the
    # runner takes the engine's statistics after the run.
    rounds: list[int] = []
    original_stats = EngineCore.get_stats

    def get_stats(self):
        rounds.append(self.scheduler.num_schedules)
        return original_stats(self)

    monkeypatch.setattr(EngineCore, "get_stats", get_stats)
    results = {}
    for mode, method in (("runs", counted), ("steps", lambda self, keep_going: None)):
        monkeypatch.setattr(EngineCore, "step_decode_run", method)
        results[mode] = run_engine(Target("sim", config=cfg), wl,
                                   RunOptions(progress=False, keep_outputs=True, **options))
    fast, slow = results["runs"], results["steps"]
    assert runs and max(runs) > 1, runs
    assert rounds[1] == rounds[3] > 0, rounds            # after each run (before: 0 and 0)
    assert all(r.ok for r in slow.records)
    assert fast.duration == slow.duration
    assert fast.counters == slow.counters
    assert [vars(r) for r in fast.records] == [vars(r) for r in slow.records]


def test_a_decode_run_stops_where_a_step_would_differ(llama_path, tmp_path):
    """``schedule_decode_run`` plans a run only of pure decodes with nothing waiting, and no
    longer than the first length limit or block boundary; a token that would stop a request
    (its EOS, a stop token) allows none."""
    from corellm import SamplingParams
    from corellm.request import EngineCoreRequest

    cfg = sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"),
                     kv_cache={"block_size": 16})
    llm = LLM(cfg)
    try:
        engine = llm.engine
        sched = engine.scheduler
        token = engine.executor.fixed_token_id
        assert token is not None

        def add(rid, n_prompt, max_tokens, eos=2, **kw):
            engine.add_request(EngineCoreRequest(
                request_id=rid, prompt_token_ids=[5] * n_prompt,
                sampling_params=SamplingParams(max_tokens=max_tokens, **kw),
                eos_token_id=eos, arrival_time=0.0))

        add("a", 10, 40)
        assert sched.schedule_decode_run(token) is None            # "a" waits
        engine.step()                                               # its prefill
        plan, steps = sched.schedule_decode_run(token)
        # 10 tokens computed, one block of 16 held: 6 steps before the next block is needed
        # (39 tokens before its length limit).
        assert plan.num_scheduled_tokens == {"a": 1} and steps == 16 - 10
        sched.update_from_decode_run(plan, steps, token)
        assert sched.requests["a"].num_computed_tokens == 16
        add("b", 5, 3)
        assert sched.schedule_decode_run(token) is None            # "b" waits
        engine.step()
        plan, steps = sched.schedule_decode_run(token)
        assert steps == 2                                           # "b" ends in 2 steps
        out = {o.request_id: o for o in sched.update_from_decode_run(plan, steps, token)}
        assert out["b"].finish_reason == "length" and len(out["b"].new_token_ids) == 2
        assert out["a"].finish_reason is None
        add("c", 4, 10, stop_token_ids=[token], min_tokens=5)
        engine.step()
        assert sched.schedule_decode_run(token) is None            # its token will stop "c"
        engine.abort_requests(["c"])
        add("d", 4, 10, eos=token, min_tokens=5)
        engine.step()
        assert sched.schedule_decode_run(token) is None            # its EOS is the token
        engine.abort_requests(["d"])
        add("e", 4, 10, eos=token, min_tokens=5, ignore_eos=True)
        engine.step()
        assert sched.schedule_decode_run(token) is not None        # ...unless it ignores EOS
        engine.abort_requests(["a", "e"])
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


def test_a_decode_run_ends_at_the_context_limit(llama_path, tmp_path):
    """A run's last step is the one where a request reaches ``max_model_len``; applied, the
    request ends by length with the tokens one step per call would give it."""
    from corellm import SamplingParams
    from corellm.request import EngineCoreRequest

    cfg = sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"),
                     kv_cache={"block_size": 64, "num_blocks": 8}, model={"max_model_len": 40})
    llm = LLM(cfg)
    try:
        engine, sched = llm.engine, llm.engine.scheduler
        engine.add_request(EngineCoreRequest(
            request_id="a", prompt_token_ids=[5] * 20,
            sampling_params=SamplingParams(max_tokens=100), eos_token_id=2, arrival_time=0.0))
        engine.step()                                               # 21 tokens after it
        plan, steps = sched.schedule_decode_run(engine.executor.fixed_token_id)
        assert steps == 40 - 21
        (out,) = sched.update_from_decode_run(plan, steps, engine.executor.fixed_token_id)
        assert out.finish_reason == "length" and len(out.new_token_ids) == 19
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


_IMPORT_WATCH = """
import runpy, sys
sys.argv = ["corellm", *sys.argv[1:]]
try:
    runpy.run_module("corellm.cli", run_name="__main__")
finally:
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers"})
    print("HEAVY IMPORTS:", heavy, file=sys.stderr)
"""


def test_a_simulated_bench_imports_neither_torch_nor_transformers(llama_path, tmp_path):
    """``corellm bench`` on the simulator, the whole command in a fresh process, imports
    neither torch nor transformers (seconds of start-up for a run that executes no model): the
    platform's block size comes from its spec, CUDA is ruled out from torch's build info, no
    attention backend is resolved, the prompts' token space is read with the Rust tokenizer
    and the engine loads no tokenizer."""
    import subprocess
    import sys

    from corellm_plugins.platform_cuda.probe import _build_info

    sections = {}
    info = _build_info()
    if info is None or info["cuda"] is not None:
        # Whether a CUDA build of torch sees a GPU takes importing it: name the platform.
        sections["platform"] = {"name": "cpu"}
    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps(sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json"),
                                         **sections)))
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_WATCH, "bench", "--config", f"sim={cfg}",
         "--num-prompts", "20", "--random-input-len", "16", "--random-output-len", "4",
         "--request-rate", "50", "--seed", "1", "--disable-tqdm"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'sim' #1: 20/20 ok" in proc.stderr, proc.stderr[-3000:]
    assert "HEAVY IMPORTS: []" in proc.stderr, proc.stderr[-3000:]


def test_an_engine_that_runs_no_model_resolves_no_device(llama_path, tmp_path):
    """The sim executor's spec says it runs no model: the engine's setup names no device type
    and no attention backend, and the checkpoint's dtype."""
    llm = LLM(sim_config(llama_path, make_profile(llama_path, tmp_path / "p.json")),
              skip_tokenizer_init=True)
    try:
        setup = llm.engine.setup
        assert setup.device_type == "none" and setup.attention_candidates == ()
        assert setup.dtype == "float32" and setup.platform == llm.config.platform.name
        assert llm.tokenizer is None
    finally:
        llm.shutdown()
