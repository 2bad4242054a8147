"""The simulated executor (``executor: {name: sim}``): the executor is the only thing that
changes (a replayed real run schedules exactly the same steps), 10,000 requests complete with
nothing lost, overlapped steps (scheduler.async_scheduling) cost max(host, device), calibration
writes a profile the sim accepts (with each step's host/device split), and a profile for another
model, dtype is refused naming both (the device is the profile's, whatever this machine has)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from corellm_plugins.bench.engine_driver import drive_engine, run_engine
from corellm_plugins.bench.targets import RunOptions, Target
from corellm_plugins.bench.workload import build_workload
from corellm.clock import WALL_CLOCK, Clock
from corellm_plugins.bench.costmodel import FittedCostModel, HostCostModel, StepShape
from corellm_plugins.bench.model_shape import ModelShape, model_fingerprint
from corellm_plugins.bench.profile import Profile
from corellm.engine.llm import LLM
from corellm.errors import ConfigError
from corellm.checkpoint.reader import checkpoint_name, load_arch_config
from tests.conftest import assert_pool_whole, engine_config


def make_profile(path: Path, out: Path, *, dtype: str = "float32", device: str = "cpu",
                 base: float = 2e-3, per_token: float = 2e-5,
                 host: HostCostModel | None = None) -> Path:
    """A measured-kind profile for the checkpoint at ``path`` with chosen coefficients (and
    the host part of a step, ``host``: None is a profile without the split)."""
    arch = load_arch_config(path)
    shape = ModelShape.from_arch(arch)
    model = FittedCostModel(base=base, per_req=1e-5, knots=[1, 4096],
                            knot_values=[per_token, per_token * 4096], a_prefill=1e-9,
                            a_prefill_kv=1e-8, a_decode=2e-8, per_sample=1e-5)
    Profile(kind="measured",
            model={"name": checkpoint_name(str(path)), "architecture": arch.architectures[0],
                   "fingerprint": model_fingerprint(arch)},
            dtype=dtype, device={"kind": device, "name": f"test {device}"}, block_size=16,
            kv_bytes_per_block=shape.kv_bytes_per_token(4) * 16, cost_model=model,
            host_model=host).save(out)
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


# ----------------------------------------------------------------------------- overlap
# The host part of a step of make_profile's default step model: over half of a decode
# batch's step (host-bound), under half of a long prefill's (device-bound).
HOST = HostCostModel(base=1.2e-3, per_req=1e-5, per_token=2e-6, per_sample=1e-6)


@pytest.mark.parametrize("device, asked, want", [
    ("cpu", None, 1), ("cpu", True, 2), ("cpu", False, 1),
    ("cuda", None, 2), ("cuda", False, 1), ("cuda", True, 2)])
def test_max_concurrent_batches_follows_the_config(llama_path, tmp_path, device, asked, want):
    """scheduler.async_scheduling on: 2 steps at once; off: 1; left out: the profiled
    device's way (a GPU overlaps, a CPU does not)."""
    profile = make_profile(llama_path, tmp_path / "p.json", device=device, host=HOST)
    sched = {} if asked is None else {"async_scheduling": asked}
    llm = LLM(sim_config(llama_path, profile, scheduler=sched), skip_tokenizer_init=True)
    try:
        ex = llm.engine.executor
        assert ex.max_concurrent_batches == want and ex.overlap == (want == 2)
        for shape in (StepShape.from_lists([1] * 6, [40] * 6, 6),
                      StepShape.from_lists([128], [0], 1)):
            sync = ex.step_model.predict(shape)
            if want == 2:
                h = HOST.predict(shape)
                assert 0 < h < sync
                assert ex.cost_model.predict(shape) == pytest.approx(max(h, sync - h))
            else:
                assert ex.cost_model.predict(shape) == sync
    finally:
        llm.shutdown()


def _one_request(llama_path, profile, **scheduler):
    llm = LLM(sim_config(llama_path, profile, scheduler=scheduler), skip_tokenizer_init=True)
    try:
        wl = build_workload({"name": "one", "seed": 0, "num_requests": 1,
                             "requests": {"input_len": 50, "output_len": 4},
                             "arrivals": "all_at_once"}, vocab_size=200, exclude_ids={0})
        records, duration = drive_engine(llm, wl, RunOptions(progress=False), salt="one")
        # The steps the engine planned while the one before ran (where it counts them).
        overlapped = getattr(llm.engine, "num_overlapped_steps", None)
        return records[0], duration, llm.engine.executor, overlapped
    finally:
        llm.shutdown()


def test_an_overlapped_step_costs_the_longer_of_host_and_device(llama_path, tmp_path):
    """A hand-made profile (step model and host model chosen): with async_scheduling each
    step that the engine planned the next one under advances the clock by max(host, step -
    host), exactly, and the last (nothing planned under it) by the whole step; without, every
    step by the step model, as before; and a profile with no split (format version 1) prices
    both alike."""
    # Its prefill step is device-bound (6.5 of 60 ms host), its decode steps host-bound
    # (6 of 11 ms).
    host = HostCostModel(base=6e-3, per_req=0, per_token=1e-5, per_sample=0)
    profile = make_profile(llama_path, tmp_path / "p.json", base=0.01, per_token=0.001,
                           host=host)
    step = Profile.load(profile).cost_model
    shapes = [StepShape.from_lists([50], [0], 1),
              *(StepShape.from_lists([1], [50 + k], 1) for k in range(3))]
    sync_steps = [step.predict(s) for s in shapes]
    over_steps = [max(host.predict(s), step.predict(s) - host.predict(s)) for s in shapes]
    assert over_steps[0] == sync_steps[0] - host.predict(shapes[0])
    assert over_steps[1] == host.predict(shapes[1]) > sync_steps[1] / 2

    r, duration, ex, overlapped = _one_request(llama_path, profile, async_scheduling=False)
    assert ex.max_concurrent_batches == 1 and not overlapped
    assert r.ttft == pytest.approx(sync_steps[0], abs=1e-9)
    assert duration == pytest.approx(sum(sync_steps), abs=1e-9)

    r, duration, ex, overlapped = _one_request(llama_path, profile, async_scheduling=True)
    assert ex.max_concurrent_batches == 2 and ex.num_steps == 4
    assert overlapped is None or overlapped >= 3          # the engine did overlap them
    # The first three had the next step planned under them; the last, nothing.
    steps = [*over_steps[:3], sync_steps[3]]
    assert ex.num_overlapped_steps == 3
    assert ex.simulated_s == pytest.approx(sum(steps), abs=1e-9)
    assert duration == pytest.approx(sum(steps), abs=1e-9)
    assert sum(steps) < sum(sync_steps)
    assert r.e2el == pytest.approx(sum(steps), abs=1e-9)
    # Its first token comes at the end of the prefill step, though the engine launched the
    # next step before it took the prefill's output: a step's time passes when the engine
    # waits for it, as a device's would.
    assert r.ttft == pytest.approx(over_steps[0], abs=1e-9)
    assert r.chunk_times_s == pytest.approx(list(itertools.accumulate(steps)), abs=1e-9)

    no_split = make_profile(llama_path, tmp_path / "v1.json", base=0.01, per_token=0.001)
    _, duration, ex, _ = _one_request(llama_path, no_split, async_scheduling=True)
    assert ex.max_concurrent_batches == 2
    assert duration == pytest.approx(sum(sync_steps), abs=1e-9)


def test_an_overlapped_step_passes_its_time_when_waited_for(llama_path, tmp_path):
    """Overlapped, execute_model hands out a Future of the step, decided at once, whose time
    passes on the clock at the first result() only: max(host, device) when another step was
    launched before it was waited for, else the whole step. One step at a time, the output
    itself, the time passed."""
    from concurrent.futures import Future

    from corellm import SamplingParams
    from corellm.request import EngineCoreRequest

    profile = make_profile(llama_path, tmp_path / "p.json", host=HOST)
    for overlap in (True, False):
        llm = LLM(sim_config(llama_path, profile, scheduler={"async_scheduling": overlap}),
                  skip_tokenizer_init=True)
        try:
            engine, ex = llm.engine, llm.engine.executor
            sched, clock = engine.scheduler, ex.clock
            engine.add_request(EngineCoreRequest(
                request_id="a", prompt_token_ids=[5] * 30,
                sampling_params=SamplingParams(max_tokens=3), eos_token_id=2,
                arrival_time=0.0))
            plan = sched.schedule()
            shape = StepShape.from_plan(plan)
            whole, h = ex.step_model.predict(shape), HOST.predict(shape)
            t0 = clock.monotonic()
            got = ex.execute_model(plan)
            if not overlap:
                assert not isinstance(got, Future)
                assert clock.monotonic() - t0 == pytest.approx(whole, abs=1e-12)
                sched.update_from_output(plan, got)
            else:
                assert isinstance(got, Future) and got.done() and "pending" in repr(got)
                # The next step (the first decode, its token not yet known) planned and
                # launched while the prefill runs: the prefill's host part is hidden.
                plan2 = sched.schedule()
                assert plan2.num_scheduled_tokens == {"a": 1}
                got2 = ex.execute_model(plan2)
                assert clock.monotonic() == t0
                out = got.result()
                assert got.result() is out and got.exception() is None   # once only
                assert clock.monotonic() - t0 == pytest.approx(max(h, whole - h), abs=1e-12)
                assert out.timings["forward"] == pytest.approx(max(h, whole - h))
                assert out.req_ids == ["a"] and out.sampled_token_ids == [ex.token_id]
                sched.update_from_output(plan, out)
                # Nothing launched after the decode: it costs the whole step.
                t1 = clock.monotonic()
                sched.update_from_output(plan2, got2.result())
                assert clock.monotonic() - t1 == pytest.approx(
                    ex.step_model.predict(StepShape.from_plan(plan2)), abs=1e-12)
                assert ex.num_overlapped_steps == 1
            engine.abort_requests(["a"])
            assert_pool_whole(llm)
        finally:
            llm.shutdown()


def test_an_overlapped_run_is_faster_where_the_host_part_is_large(llama_path, tmp_path):
    """A Poisson workload with chunked prompts, preemption and two priority classes, on a
    profile whose decode steps are host-bound: the overlapped run is complete, with the same
    tokens, and shorter. (Each step costs no more overlapped, but a whole run may: the
    overlapped engine plans differently, seats and cached prefixes freed a step later.)"""
    profile = make_profile(llama_path, tmp_path / "p.json", host=HOST)
    sections = {"kv_cache": {"num_blocks": 16, "block_size": 16},
                "model": {"max_model_len": 200}}
    wl = build_workload(WORKLOADS["poisson"], vocab_size=200, exclude_ids={0})
    runs = {}
    for overlap in (False, True):
        cfg = sim_config(llama_path, profile, scheduler={
            "name": "priority", "max_num_seqs": 6, "max_num_batched_tokens": 64,
            "async_scheduling": overlap}, **sections)
        runs[overlap] = run_engine(Target(f"sim-{overlap}", config=cfg), wl,
                                   RunOptions(progress=False))
    for res in runs.values():
        assert len(res.records) == 24 and all(r.ok for r in res.records)
    assert [r.output_tokens for r in runs[True].records] == \
        [r.output_tokens for r in runs[False].records]
    assert runs[True].duration < runs[False].duration


# ----------------------------------------------------------------------------- calibration
def test_calibrate_writes_a_profile_the_sim_runs_on(llama_path, tmp_path):
    from corellm.cli.commands import main
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
    # Each step's phases, and the host part (the time less prepare_inputs, forward and sample)
    # fitted: measured synchronously, every host part is shorter than its step.
    assert profile.engine["async_scheduling"] is False
    assert len(profile.sample_phases) == len(shapes) and profile.phases[2] == "forward"
    assert all(row[2] > 0 for row in profile.sample_phases)           # forward, every step
    _, host = profile.host_data()
    assert all(0 < h < t for h, t in zip(host, seconds))
    assert isinstance(profile.host_model, HostCostModel)
    assert profile.host_model.diagnostics["n_samples"] == len(shapes)
    # The profile prices the model it was measured on: a sim run with it goes through,
    # synchronous or overlapped. The prompts share no prefix, so both engines plan the same
    # steps (overlapped, a shared prefix is registered a step later and the plans differ),
    # and the overlapped steps cost no more.
    ends = {}
    for overlap in (False, True):
        llm = LLM(sim_config(llama_path, out, scheduler={"max_num_seqs": 8,
                                                         "async_scheduling": overlap}))
        try:
            from corellm import SamplingParams
            outs = llm.generate([{"prompt_token_ids": [3 + i] * 20} for i in range(3)],
                                SamplingParams(max_tokens=6), use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6, 6]
            assert outs[0].metrics.time_to_first_token > 0
            ex = llm.engine.executor
            ends[overlap] = (ex.num_steps, ex.simulated_s)
        finally:
            llm.shutdown()
    assert ends[True][0] == ends[False][0] == 6
    assert 0 < ends[True][1] <= ends[False][1]


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


_IMPORT_WATCH = """
import runpy, sys
sys.argv = ["corellm", *sys.argv[1:]]
try:
    runpy.run_module("corellm.cli.commands", run_name="__main__")
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
