"""The example scheduling policies examples/corellm-residual-sjf and examples/corellm-fair-share.

Each test registers the example modules in-process (as tests/test_example_plugin.py does for the
SPF example), drives the engine step by step on a small seeded workload, and checks the effect the
policy is for: residual SJF puts requests with a long cached prefix first and bounds every wait
with aging; fair share splits the tokens served evenly (or by weight) across tenants and gives a
tenant returning from idleness no burst. Every run also checks that every request finishes with
its tokens and that every KV block returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from corellm.interfaces import CachedPrefix
from corellm.request import EngineCoreRequest, Request
from corellm.sampling_params import SamplingParams
from corellm.scheduling import SchedulingContext, WaitingQueue
from tests.conftest import assert_pool_whole, engine_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {   # module -> (folder, entry-point name in its pyproject.toml)
    "corellm_rsjf": (REPO / "examples" / "corellm-residual-sjf", "scheduler_rsjf"),
    "corellm_fairshare": (REPO / "examples" / "corellm-fair-share", "scheduler_fairshare"),
}
T0 = 1_700_000_000.0          # synthetic arrival clock: tests set arrival times explicitly


@pytest.fixture
def examples(monkeypatch) -> dict[str, ModuleType]:
    """Both example modules, imported from the source tree, not from an installed copy."""
    saved = {name: sys.modules.pop(name, None) for name in EXAMPLES}
    modules = {}
    for name, (folder, _) in EXAMPLES.items():
        monkeypatch.syspath_prepend(str(folder))
        modules[name] = importlib.import_module(name)
        assert Path(modules[name].__file__).resolve().is_relative_to(folder)
    yield modules
    for name, module in saved.items():
        sys.modules.pop(name, None)
        if module is not None:
            sys.modules[name] = module


def make_llm(examples, path, **sections):
    """An LLM with both examples registered in-process. Their entry points are disabled in case
    the packages are also installed, which would register each module twice."""
    from corellm import LLM

    disable = [entry_point for _, entry_point in EXAMPLES.values()]
    cfg = engine_config(path, plugins={"disable": disable}, **sections)
    return LLM(cfg, plugins=list(examples.values()))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


class Driver:
    """Submits requests straight to the engine core and steps it, recording each step's plan."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.scheduler = llm.engine.scheduler
        self.plans: list[dict[str, int]] = []       # per step: request id -> tokens computed
        self.first_step: dict[str, int] = {}        # request id -> step of its first admission
        self.user: dict[str, str | None] = {}
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        schedule = self.scheduler.schedule

        def spy():
            plan = schedule()
            self.plans.append(dict(plan.num_scheduled_tokens))
            for new in plan.scheduled_new_reqs:
                self.first_step.setdefault(new.req_id, len(self.plans) - 1)
            return plan
        self.scheduler.schedule = spy

    def submit(self, rid: str, prompt: list[int], *, user: str | None = None,
               max_tokens: int = 4, arrival: float | None = None) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        _, core = self.llm.processor.process(rid, {"prompt_token_ids": prompt}, params,
                                             user=user)
        if arrival is not None:
            core.arrival_time = arrival
        self.engine.add_request(core)
        self.user[rid], self.max_tokens[rid], self.outputs[rid] = user, max_tokens, []

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs[out.request_id] += out.new_token_ids

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        assert not self.engine.has_unfinished_requests()

    def admission_order(self) -> list[str]:
        return sorted(self.first_step, key=lambda rid: (self.first_step[rid], rid))

    def served(self, steps: range) -> dict[str | None, int]:
        """Tokens computed per tenant over ``steps``."""
        out: dict[str | None, int] = {}
        for i in steps:
            for rid, n in self.plans[i].items():
                out[self.user[rid]] = out.get(self.user[rid], 0) + n
        return out

    def check_complete(self) -> None:
        """Every request finished with all its tokens, and the KV pool is whole."""
        assert {rid: len(t) for rid, t in self.outputs.items()} == self.max_tokens
        assert_pool_whole(self.llm)


# =========================================================================== residual SJF
PREFIX = tokens(random.Random(7), 48)        # three 16-token blocks


def test_rsjf_cached_prefix_goes_before_longer_uncached(examples, llama_path):
    """After a warm-up request fills the cache with PREFIX, two requests that start with it (56
    tokens, 8 uncached) are admitted before two requests of 40 fresh tokens that arrived earlier:
    by uncached tokens, not by arrival (FCFS) nor by prompt length (SPF would run the 40s
    first). One request runs at a time, so the running request of each step shows the order."""
    rng = random.Random(1)
    fresh = {"a1": tokens(rng, 40), "a2": tokens(rng, 40)}
    shared = {"b1": PREFIX + tokens(rng, 8), "b2": PREFIX + tokens(rng, 8)}

    def run(name: str) -> tuple[list[str], list[str | None]]:
        with make_llm(examples, llama_path, scheduler={"name": name, "max_num_seqs": 1}) as llm:
            d = Driver(llm)
            d.submit("warm", PREFIX + tokens(random.Random(2), 8), arrival=T0)
            d.run()
            for i, (rid, prompt) in enumerate([*fresh.items(), *shared.items()]):
                d.submit(rid, prompt, arrival=T0 + 1 + i * 1e-3)
            warm_steps = len(d.plans)
            d.run()
            per_step = [",".join(plan) for plan in d.plans[warm_steps:]]
            d.check_complete()
            if name == "residual_sjf":
                assert d.llm.get_stats().prefix_cache_hits >= 2 * len(PREFIX)
            return d.admission_order()[1:], per_step

    order, per_step = run("residual_sjf")
    assert order == ["b1", "b2", "a1", "a2"]
    # Step by step: each request holds the only seat until its 4 tokens are out (a prefill step
    # that samples the first, then 3 decodes).
    assert per_step == ["b1"] * 4 + ["b2"] * 4 + ["a1"] * 4 + ["a2"] * 4
    assert run("fcfs")[0] == ["a1", "a2", "b1", "b2"]


def test_rsjf_reranks_with_the_cache_as_it_is_at_admission(examples, llama_path):
    """A request's cached prefix grows while it waits; the live re-rank sees it.

    'warm' computes PREFIX 16 tokens a step. 'c' (PREFIX + 8) arrives after the first chunk, with
    16 cached tokens: residual 40. 'd' (30 fresh tokens) arrives with it: residual 30, so the heap
    ranks 'd' first. By the time the seat frees, PREFIX is cached and 'c' has 8 left: it goes
    first."""
    rng = random.Random(3)
    sched = {"name": "residual_sjf", "max_num_seqs": 1, "max_num_batched_tokens": 16}
    with make_llm(examples, llama_path, scheduler=sched) as llm:
        d = Driver(llm)
        d.submit("warm", PREFIX + tokens(rng, 8), arrival=T0)
        d.step()
        d.submit("c", PREFIX + tokens(rng, 8), arrival=T0 + 1)
        d.submit("d", tokens(rng, 30), arrival=T0 + 1)
        policy = d.scheduler.policy
        assert d.scheduler.waiting.first().request_id == "d"      # the key taken at enqueue
        keys = {r.request_id: policy.waiting_key(r, d.scheduler._context())
                for r in d.scheduler.waiting}
        assert keys["c"] - keys["d"] == pytest.approx(40 - 30)
        d.run()
        assert d.admission_order() == ["warm", "c", "d"]
        d.check_complete()


@pytest.mark.parametrize("aging, max_ahead", [(10.0, 4), (0.0, 12)])
def test_rsjf_aging_bounds_the_wait_of_a_long_request(examples, llama_path, aging, max_ahead):
    """A 45-token request waits while a stream of 8-token requests arrives, one a second (on
    the synthetic clock) and one per engine step. With aging of 10 tokens/s, a short one that
    arrives more than (45 - 8) / 10 = 3.7 s after the long one ranks behind it: 4 shorts go
    first (arrived at 0..3 s), so the long request's wait is bounded in steps. Without aging it
    waits for the whole stream."""
    rng = random.Random(4)
    sched = {"name": "residual_sjf", "max_num_seqs": 1, "aging_tokens_per_s": aging}
    with make_llm(examples, llama_path, scheduler=sched) as llm:
        d = Driver(llm)
        d.submit("long", tokens(rng, 45), arrival=T0, max_tokens=2)
        for i in range(12):
            d.submit(f"s{i:02d}", tokens(rng, 8), arrival=T0 + i, max_tokens=2)
            d.step()
        d.run()
        order = d.admission_order()
        ahead = order.index("long")
        assert ahead == max_ahead, order
        assert order[:ahead] == [f"s{i:02d}" for i in range(ahead)]
        if aging:
            # Each short holds the seat for 2 steps (prefill + 1 decode), so 'long' waits at
            # most 4 * 2 steps after the first step.
            assert d.first_step["long"] <= 1 + 2 * 4
        d.check_complete()


class FakeKV:
    """The one KV-cache manager method SchedulingContext uses, answering from a dict, and
    counting the lookups."""

    block_size = 16
    num_free_blocks = 0

    def __init__(self, cached: dict[str, int]) -> None:
        self.cached = cached
        self.lookups: list[str] = []

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        self.lookups.append(request.request_id)
        return CachedPrefix((), self.cached.get(request.request_id, 0))


def fake_ctx(cached: dict[str, int], now: float = T0 + 100, running=(), waiting=None,
             ) -> tuple[SchedulingContext, FakeKV]:
    """A context over a stand-in for the scheduler: the attributes SchedulingContext reads."""
    kv = FakeKV(cached)
    scheduler = SimpleNamespace(running=list(running), waiting=waiting or WaitingQueue(), kv=kv,
                                max_num_batched_tokens=2048)
    return SchedulingContext(now, 1, scheduler), kv


def make_request(rid: str, n: int, arrival: float = T0, user: str | None = None) -> Request:
    core = EngineCoreRequest(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=4), None,
                             arrival, user=user)
    return Request(core, max_model_len=512)


def test_rsjf_select_reranks_a_bounded_window_with_the_live_cache(examples):
    """Unit test of waiting_key and select with a context whose cache changes after enqueue."""
    policy = examples["corellm_rsjf"].ResidualSJFPolicy(aging_tokens_per_s=0, rerank_window=3)
    reqs = {rid: make_request(rid, n) for rid, n in
            [("p", 40), ("q", 50), ("r", 56), ("s", 60), ("t", 64)]}
    queue = WaitingQueue()
    ctx, _ = fake_ctx({"t": 32})                            # t: 64 - 32 = 32 at enqueue
    for r in reqs.values():
        queue.push(r, policy.waiting_key(r, ctx))
    assert [r.request_id for r in queue.best(5)] == ["t", "p", "q", "r", "s"]

    # Later: t's blocks were evicted (32 -> 0), r's prefix got cached (56 -> 8 uncached), and so
    # did s's, but s is outside the window of 3 static keys (t, p, q... r is 4th).
    ctx, kv = fake_ctx({"r": 48, "s": 56})
    assert policy.select(queue, ctx).request_id == "p"      # r, s unseen: window t, p, q
    assert sorted(kv.lookups) == ["p", "q", "t"]           # only the window was looked up
    policy.rerank_window = 4
    ctx, kv = fake_ctx({"r": 48, "s": 56})
    assert policy.select(queue, ctx).request_id == "r"
    policy.rerank_window = 5
    ctx, _ = fake_ctx({"r": 48, "s": 56})
    assert policy.select(queue, ctx).request_id == "s"      # 60 - 56 = 4 < 8

    # Aging: the waiting time it is worth is static in the key, so an old long request ranks
    # ahead of a newer short one once the age difference exceeds the size difference.
    aged = examples["corellm_rsjf"].ResidualSJFPolicy(aging_tokens_per_s=10, rerank_window=8)
    old, new = make_request("old", 100, arrival=T0), make_request("new", 10, arrival=T0 + 9.5)
    ctx, _ = fake_ctx({})
    assert aged.waiting_key(old, ctx) < aged.waiting_key(new, ctx)     # 100 < 10 + 95
    assert aged.choose_victim((old, new), ctx) is new                  # ranked last, evicted first


# =========================================================================== fair share
def flood_and_light(d: Driver, rng: random.Random, n_flood: int, n_light: int,
                    prompt: int = 16, max_tokens: int = 8) -> None:
    """The flood's requests all arrive first, then the light tenant's."""
    for i in range(n_flood):
        d.submit(f"flood-{i:02d}", tokens(rng, prompt), user="flood", max_tokens=max_tokens)
    for i in range(n_light):
        d.submit(f"light-{i:02d}", tokens(rng, prompt), user="light", max_tokens=max_tokens)


def backlogged_steps(d: Driver, tenants: list[str]) -> range:
    """The steps at which every tenant in ``tenants`` still had a request not yet admitted."""
    last = min(max(s for rid, s in d.first_step.items() if d.user[rid] == t) for t in tenants)
    return range(0, last)


FAIR = {"name": "fair_share", "max_num_seqs": 4, "prefill_weight": 1.0, "decode_weight": 1.0}


def test_fcfs_keeps_the_light_tenant_behind_the_flood(examples, llama_path):
    with make_llm(examples, llama_path, scheduler={"name": "fcfs", "max_num_seqs": 4}) as llm:
        d = Driver(llm)
        flood_and_light(d, random.Random(5), n_flood=24, n_light=8)
        d.run()
        window = backlogged_steps(d, ["flood", "light"])
        assert d.served(window).get("light", 0) == 0
        first_light = min(s for rid, s in d.first_step.items() if rid.startswith("light"))
        assert first_light >= max(s for rid, s in d.first_step.items() if rid.startswith("flood"))
        d.check_complete()


@pytest.mark.parametrize("weights, share", [({}, 1.0), ({"light": 3.0}, 3.0)])
def test_fair_share_splits_tokens_served_by_weight(examples, llama_path, weights, share):
    """While both tenants have requests waiting, the tokens computed for them converge to their
    weights (1:1, or 3:1 for the light tenant), though the flood arrived first and is 3x larger.
    """
    sched = {**FAIR, "tenant_weights": weights, "max_num_seqs": 8}
    with make_llm(examples, llama_path, scheduler=sched) as llm:
        d = Driver(llm)
        flood_and_light(d, random.Random(6), n_flood=36, n_light=12 if share == 1 else 30)
        d.run()
        window = backlogged_steps(d, ["flood", "light"])
        assert len(window) >= 10
        served = d.served(window)
        ratio = served["light"] / served["flood"]
        assert share * 0.8 <= ratio <= share * 1.25, (served, len(window))
        print(f"window {len(window)} steps, served {served}, ratio {ratio:.3f}")
        # The light tenant started in the first step, not behind the flood.
        assert d.first_step["light-00"] == 0
        d.check_complete()


def test_fair_share_reactivated_tenant_gets_no_burst(examples, llama_path):
    """'b' leaves while 'a' keeps being served, then returns. It is lifted to a's counter, not
    credited for its idle spell, so it shares the seats evenly instead of taking all of them
    until it has caught up."""
    rng = random.Random(8)
    with make_llm(examples, llama_path, scheduler=FAIR) as llm:
        d = Driver(llm)
        policy = d.scheduler.policy
        for i in range(40):
            d.submit(f"a-{i:02d}", tokens(rng, 16), user="a", max_tokens=8)
        for i in range(3):
            d.submit(f"b-{i:02d}", tokens(rng, 16), user="b", max_tokens=8)
        while any(r.user == "b" for r in d.scheduler.requests.values()):
            d.step()
        for _ in range(25):                  # b idle, a served alone
            d.step()
        assert "b" not in policy.active
        idle_gap = policy.counters["a"] - policy.counters["b"]
        assert idle_gap > 150                # the credit a lift must not hand out

        back, a_before = len(d.plans), policy.counters["a"]
        for i in range(12):
            d.submit(f"b2-{i:02d}", tokens(rng, 16), user="b", max_tokens=8)
        d.step()
        assert "b" in policy.active
        # Lifted to the smallest counter among the active tenants (a's, as it was at that
        # round): b's counter now exceeds it by exactly what this step served b.
        assert policy.counters["b"] == a_before + d.served(range(back, back + 1)).get("b", 0)
        d.run()
        window = range(back, min(max(d.first_step[f"b2-{i:02d}"] for i in range(12)),
                                 max(s for rid, s in d.first_step.items() if d.user[rid] == "a")))
        served = d.served(window)
        assert len(window) >= 8
        # Without the lift, b would take every seat for the whole window: its idle_gap is more
        # than what the window serves it.
        assert served.get("b", 0) < idle_gap
        assert 0.75 <= served["b"] / served["a"] <= 1.33, served
        print(f"idle gap {idle_gap}, window {len(window)} steps, served {served}")
        d.check_complete()


def test_fair_share_select_and_lift_unit(examples):
    """select picks the head of the least-served tenant, counts the admissions already made in
    the round, and an arriving tenant with no request in the scheduler is lifted."""
    policy = examples["corellm_fairshare"].FairSharePolicy(prefill_weight=1, decode_weight=1)
    queue = WaitingQueue()
    ctx, _ = fake_ctx({}, waiting=queue)
    reqs = [make_request(f"{u}{i}", 10, user=u) for u in ("x", "y") for i in range(3)]
    for r in reqs:
        queue.push(r, policy.waiting_key(r, ctx), policy.queue_group(r))
    assert policy.active == {"x": 3, "y": 3} and policy.counters == {"x": 0.0, "y": 0.0}
    picks = []
    for _ in range(3):
        plan = SimpleNamespace(admitted=[], num_scheduled={}, budget=2048)
        ctx = SchedulingContext(T0, 1, SimpleNamespace(waiting=queue), plan)
        for _ in range(2):                   # two admissions per round
            pick = policy.select(queue, ctx)
            picks.append(pick.request_id)
            queue.remove(pick)
            plan.admitted.append(pick)
            plan.num_scheduled[pick.request_id] = 10
        policy.on_scheduled(ctx.admitted, ctx)
    assert picks == ["x0", "y0", "x1", "y1", "x2", "y2"]   # alternating within each round
    assert policy.counters == {"x": 30.0, "y": 30.0}

    # Every x request finishes; 'z' arrives with a stale counter of 0 while y is at 30: lifted
    # to 30. x comes back too, and keeps its 30 (never lowered).
    for r in reqs[:3]:
        policy.on_finished(r, ctx)
    assert "x" not in policy.active
    policy.counters["z"] = 0.0
    z, x = make_request("z0", 10, user="z"), make_request("x9", 10, user="x")
    for r in (z, x):
        queue.push(r, policy.waiting_key(r, ctx), policy.queue_group(r))
    assert policy.counters["z"] == 30.0 and policy.counters["x"] == 30.0
    ctx, _ = fake_ctx({}, waiting=queue)
    assert policy.select(queue, ctx) is z           # tie at 30: the older head
    # The last active tenant leaving sets the level the next arrival starts from.
    for r in reqs[3:] + [z, x]:
        policy.on_finished(r, ctx)
    assert not policy.active and policy.floor == 30.0


# =========================================================================== both
@pytest.mark.parametrize("name", ["residual_sjf", "fair_share"])
def test_kv_pressure_preempts_and_loses_nothing(examples, llama_path, name):
    """A pool too small for every running request: the policy's victims are preempted and
    recomputed, every request still finishes with its tokens, and no block leaks."""
    rng = random.Random(9)
    cfg = dict(model={"max_model_len": 96}, kv_cache={"num_blocks": 6, "block_size": 16},
               scheduler={"name": name, "max_num_seqs": 4})
    with make_llm(examples, llama_path, **cfg) as llm:
        d = Driver(llm)
        policy = d.scheduler.policy
        choose, victims = policy.choose_victim, []

        def spy(running, ctx):
            victim = choose(running, ctx)
            if name == "fair_share":
                worst = max(policy.counters[r.user] for r in running)
                assert policy.counters[victim.user] == worst
            else:
                assert policy.score(victim, 0) == max(policy.score(r, 0) for r in running)
            victims.append(victim.request_id)
            return victim
        policy.choose_victim = spy
        for i in range(6):
            d.submit(f"r{i}", tokens(rng, rng.randrange(8, 30)), user=f"u{i % 2}",
                     max_tokens=24)
        d.run()
        assert victims and llm.get_stats().num_preemptions == len(victims)
        d.check_complete()


def test_example_configs_validate_and_options_are_checked(examples):
    from corellm.config.compose import load_config
    from corellm.errors import ConfigError
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[e for _, e in EXAMPLES.values()],
                             plugins=list(examples.values()))
    workloads = REPO / "examples" / "workloads"
    for module, (folder, _) in EXAMPLES.items():
        name = examples[module].SCHEDULER_NAME
        config = load_config(folder / "config.yaml", registry=registry)
        assert config.scheduler.name == name
        # The A/B config beside the example workloads: the same policy, fcfs.yaml's settings.
        ab = load_config(workloads / f"{name.replace('_', '-')}.yaml", registry=registry)
        fcfs = load_config(workloads / "fcfs.yaml", registry=registry)
        assert ab.scheduler.name == name and ab.kv_cache == fcfs.kv_cache
        assert ab.scheduler.max_num_seqs == fcfs.scheduler.max_num_seqs
    for bad in ({"name": "residual_sjf", "rerank_window": 0},
                {"name": "residual_sjf", "aging_tokens_per_s": -1},
                {"name": "fair_share", "tenant_weights": {"x": 0}},
                {"name": "fair_share", "prefill_weight": 0, "decode_weight": 0}):
        with pytest.raises(ConfigError):
            load_config({"scheduler": bad}, registry=registry)


# =========================================================================== the benchmark
def test_scheduler_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/scheduler.py runs every policy on a small queue and writes its table."""
    monkeypatch.setattr(sys, "path", list(sys.path))        # it adds the examples' folders
    for name in EXAMPLES:       # set now, so that undoing it removes the benchmark's imports
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("bench_scheduler",
                                                  REPO / "benchmarks" / "scheduler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "out.json"
    start = time.perf_counter()
    bench.main(["--num-requests", "300", "--steps", "5", "--json", str(out)])
    assert time.perf_counter() - start < 30
    result = json.loads(out.read_text())
    rows = {row["policy"]: row for row in result["results"]}
    assert set(rows) == {"fcfs", "priority", "residual_sjf", "fair_share"}
    for row in rows.values():
        assert row["steps"] == 5 and row["waiting"] == 300
        assert 0 < row["schedule_ms"]["p50"] <= row["schedule_ms"]["p99"]
        assert row["admitted"] > 0
