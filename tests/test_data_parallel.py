"""Data-parallel serving and live A/B splits: ``parallel.data_parallel_size`` engine replicas
behind one server, routed by ``corellm.serving.router.Router``; ``frontend.arms`` (``corellm
serve --config a=A.yaml --config b=B.yaml --split a=50,b=50``) for replica groups with their
own configs. The reference clients are the official ``openai`` client and ``corellm bench``."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from corellm.errors import ConfigError
from corellm.serving.router import NoReplicaError, Router, unit_hash
from tests.test_server import MAX_MODEL_LEN, Server, _server_config, _wait

UP = re.compile(r"engine replica\(s\) up: (?P<list>.*)")


# --------------------------------------------------------------------------- the router
def test_the_split_by_user_is_stable_and_within_5_percent_of_the_weights():
    for weights in ({"a": 50, "b": 50}, {"a": 70, "b": 30}, {"a": 1, "b": 1, "c": 2}):
        router = Router(weights)
        arms = [router.arm_for(f"user-{i}", None, f"req-{i}") for i in range(1000)]
        counts = collections.Counter(arms)
        total = sum(weights.values())
        for arm, w in weights.items():
            assert abs(counts[arm] / 1000 - w / total) <= 0.05, (weights, counts)
        # the same user lands in the same arm, whatever the request, in a new router too
        again = Router(weights)
        assert all(again.arm_for(f"user-{i}", "s", f"other-{i}") == arms[i]
                   for i in range(1000))
    assert 0.0 <= unit_hash("x") < 1.0


def test_the_split_keys_user_then_session_then_request():
    router = Router({"a": 1, "b": 1})
    users = {router.arm_for("u1", f"s{i}", f"r{i}") for i in range(50)}
    assert len(users) == 1                                 # the user decides
    sessions = {router.arm_for(None, "s1", f"r{i}") for i in range(50)}
    assert len(sessions) == 1                              # then the conversation
    requests = {router.arm_for(None, None, f"r{i}") for i in range(50)}
    assert requests == {"a", "b"}                          # else each request by its id


def test_least_outstanding_then_turns():
    router = Router({"x": 1})
    assert router.pick("x", [3, 1, 2], [True] * 3) == 1
    picks = [router.pick("x", [0, 0, 0], [True] * 3) for _ in range(6)]
    assert sorted(collections.Counter(picks).values()) == [2, 2, 2]      # ties in turn
    assert router.pick("x", [0, 5], [False, True]) == 1                  # a dead one skipped
    with pytest.raises(NoReplicaError, match="no replica of 'x' is up"):
        router.pick("x", [0, 0], [False, False])


def test_a_conversation_stays_on_its_replica_within_the_slack():
    router = Router({"x": 1}, affinity_slack=2)
    first = router.pick("x", [0, 0], [True, True], "conv")
    other = 1 - first
    load = [0, 0]
    load[first] = 2                                        # 2 more than the least: stays
    assert router.pick("x", load, [True, True], "conv") == first
    load[first] = 3                                        # 3 more: the load wins
    assert router.pick("x", load, [True, True], "conv") == other
    assert router.pick("x", [0, 0], [True, True], "conv") == other       # and it follows
    assert router.pick("x", [0, 0], [other == 0, other == 1], "conv") == other
    # the conversation's replica dead: the other one, whatever the slack
    load = [0, 0]
    assert router.pick("x", load, [other != 0, other != 1], "conv") == 1 - other
    plain = Router({"x": 1}, affinity=False)
    assert {plain.pick("x", [0, 0], [True, True], "conv") for _ in range(4)} == {0, 1}


# --------------------------------------------------------------------------- config
def test_serve_arms_from_the_command_line():
    import argparse

    from corellm.cli.serve_args import _serve_arms
    ns = argparse.Namespace(config=["a=A.yaml", "b=B.yaml"], split="a=90,b=10")
    assert _serve_arms(ns) == {"a": {"config": "A.yaml", "weight": 90.0},
                               "b": {"config": "B.yaml", "weight": 10.0}}
    assert ns.config == "A.yaml"
    ns = argparse.Namespace(config=["one.yaml"], split=None)
    assert _serve_arms(ns) is None and ns.config == "one.yaml"
    for config, split, match in ((["a=A", "b=B"], "a=1,c=1", "--split.*ARM one of a, b"),
                                 (["a=A", "b=B"], "a=1", "gives no weight to b"),
                                 (["a=A", "b=B"], "a=1,a=2,b=1", "arm 'a' given twice"),
                                 (["a=A", "B"], None, "name every file"),
                                 (["A", "B"], None, "given more than once"),
                                 (["A"], "a=1", "needs arms"),
                                 (["a=A", "a=B"], None, "arm 'a' given twice")):
        with pytest.raises(ConfigError, match=match):
            _serve_arms(argparse.Namespace(config=config, split=split))


def test_arm_config_errors_name_the_arm(llama_path, make_checkpoint, tmp_path):
    from corellm.config.compose import load_config
    from corellm.plugins import load_registry
    from corellm_plugins.frontend_openai.replicas import server_arms
    cfg = _server_config(llama_path)
    config = load_config({**cfg, "frontend": {"name": "openai"}}, registry=load_registry())
    def opts_with(arms: dict) -> object:
        return type(config.frontend).model_validate({**config.frontend.model_dump(),
                                                     "arms": arms})
    with pytest.raises(ConfigError, match=r"frontend.arms.b.set: scheduler.max_num_seqs"):
        server_arms(opts_with({"a": {}, "b": {"set": {"scheduler.max_num_seqs": -1}}}), config)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_server_config(make_checkpoint("qwen2"))))
    with pytest.raises(ConfigError, match=r"frontend.arms.b.config.*serves model .*not the "
                                          r"server's"):
        server_arms(opts_with({"a": {}, "b": {"config": str(other)}}), config)
    with pytest.raises(ConfigError, match=r"frontend.arms.a b.*an arm's name"):
        server_arms(opts_with({"a b": {}}), config)
    # what the server applies once for every arm, the arms must agree on
    with pytest.raises(ConfigError, match=r"frontend.arms.b: model.max_model_len.*differs"):
        server_arms(opts_with({"a": {}, "b": {"set": {"model.max_model_len": 32}}}), config)
    with pytest.raises(Exception, match=r"weight"):
        opts_with({"a": {"weight": float("inf")}})
    # replicas that would share one rendezvous port
    with pytest.raises(ConfigError, match=r"parallel.init_method.*would all take this port"):
        server_arms(opts_with({"a": {"replicas": 2, "set": {
            "parallel.tensor_parallel_size": 2, "executor.name": "multiproc",
            "parallel.init_method": "tcp://127.0.0.1:29500"}}}),
            config)


def test_a_replica_is_restarted_after_each_death_and_given_up_after_failures_in_a_row(
        monkeypatch):
    """The restart count is of failures in a row: a replica that serves again may die again
    any number of times; one that cannot start max_restarts times in a row is given up, and
    the group is dead once no replica is up or starting."""
    from corellm.engine import replicas
    from corellm.engine.ipc import EngineDeadError
    monkeypatch.setattr(replicas, "RESTART_BACKOFF_S", (0.0,))

    class Engine:
        def __init__(self) -> None:
            self.finished_callbacks: list = []
            self.is_dead = False
            self.engine_pid = 1
            self.where = "pid 1"
            self.died = asyncio.get_running_loop().create_future()

        def add_stats_listener(self, fn) -> None:
            pass

        async def wait_dead(self):
            return await asyncio.shield(self.died)

        def die(self) -> None:
            self.is_dead = True
            self.died.set_result(EngineDeadError("killed"))

        async def shutdown(self, timeout: float = 10.0) -> None:
            pass

    async def scenario() -> None:
        starts = {"n": 0, "fail": False}

        async def start(config):
            starts["n"] += 1
            if starts["fail"]:
                raise RuntimeError("cannot start")
            return Engine()
        group = await replicas.EngineGroup.create([replicas.Arm("", object(), 1)],
                                                  max_restarts=3, start=start)
        rep = group.replicas[0]
        for _ in range(6):                     # more deaths than max_restarts: each recovers
            old = rep.engine
            old.die()
            for _ in range(100):
                await asyncio.sleep(0)
                if rep.up and rep.engine is not old:
                    break
            assert rep.up and rep.restarts == 0
        starts["fail"] = True
        rep.engine.die()
        err = await asyncio.wait_for(group.wait_dead(), 5)
        assert rep.state == "failed" and "every replica is dead" in str(err)
        assert starts["n"] == 1 + 6 + 3
        await group.shutdown()
    monkeypatch.setattr(replicas, "cpu_slices", lambda arms: [None])
    asyncio.run(scenario())


def test_offline_llm_refuses_data_parallel(llama_path):
    from corellm import LLM
    from tests.conftest import engine_config
    with pytest.raises(ConfigError, match="parallel.data_parallel_size.*corellm serve"):
        LLM(engine_config(llama_path, parallel={"data_parallel_size": 2}))


# --------------------------------------------------------------------------- serving
def _replica_pids(srv: Server) -> dict[int, int]:
    for line in srv.log:
        m = UP.search(line)
        if m:
            return {int(i): int(p) for i, p in re.findall(r"replica (\d+)(?: \(\S+\))? pid "
                                                            r"(\d+)", m["list"])}
    raise AssertionError("no replica line:\n" + "".join(srv.log[-20:]))


def _greedy(client, model: str, prompt: str, **kw) -> tuple[str, dict]:
    raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=8,
                                                      temperature=0, **kw)
    return raw.parse().choices[0].text, dict(raw.headers)


def test_dp2_serves_every_request_spreads_the_load_and_routes_around_a_dead_replica(
        llama_path, tmp_path):
    from corellm import LLM, SamplingParams
    from tests.conftest import engine_config
    prompts = [f"The number {i} is" for i in range(16)]
    llm = LLM(engine_config(llama_path))
    ref = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)]
    llm.shutdown()

    cfg = _server_config(llama_path)
    cfg["parallel"] = {"data_parallel_size": 2}
    cfg["frontend"] = {"exit_on_engine_death": True}
    srv = Server(tmp_path, cfg)
    try:
        pids = _replica_pids(srv)
        assert sorted(pids) == [0, 1]
        client = srv.client()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: _greedy(client, srv.model, p), prompts))
        assert [text for text, _ in answers] == ref          # every one, as one engine answers
        served = collections.Counter(h["x-corellm-replica"] for _, h in answers)
        assert set(served) == {"0", "1"} and min(served.values()) >= 4, served
        metrics = httpx.get(srv.url + "/metrics").text
        for r in ("0", "1"):
            assert f'corellm:engine_alive{{model_name="{srv.model}",replica="{r}"}} 1.0' \
                in metrics
        health = httpx.get(srv.url + "/health").json()
        assert [r["state"] for r in health["replicas"]] == ["up", "up"]

        # A stream in flight on the replica that is killed ends with an error event naming
        # the death; new requests go to the other replica at once.
        body = {"model": srv.model, "prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 8, "n": 8,
                "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            victim = int(r.headers["x-corellm-replica"])
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(pids[victim], signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "engine" in json.loads(events[-2])["error"]["message"]
        # At once, well inside the restart's back-off (1 s): the other replica answers.
        text, headers = _greedy(client, srv.model, prompts[0])
        assert text == ref[0] and headers["x-corellm-replica"] == str(1 - victim)
        for p in prompts[1:6]:
            assert _greedy(client, srv.model, p)[0] == ref[prompts.index(p)]
        assert httpx.get(srv.url + "/health").status_code == 200
        # It comes back (the back-off, then a new engine core), and is routed to again.
        _wait(lambda: [r["state"] for r in httpx.get(srv.url + "/health").json()["replicas"]]
              == ["up", "up"], 60, "the replica's restart")
        assert any("restarted (engine core pid" in line for line in srv.log)
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda p: _greedy(client, srv.model, p), prompts[:8]))
        assert {h["x-corellm-replica"] for _, h in again} == {"0", "1"}
        assert srv.stop(signal.SIGTERM) == 0, "".join(srv.log[-20:])
    finally:
        srv.stop(signal.SIGKILL)


def test_ab_arms_split_users_label_metrics_and_bench_reads_each_arm(llama_path, tmp_path):
    cfg = _server_config(llama_path)
    cfg["frontend"] = {"arms": {"a": {"weight": 70},
                                "b": {"weight": 30, "set": {"scheduler.name": "priority"}}}}
    srv = Server(tmp_path, cfg)
    try:
        async def send_all() -> list[tuple[str, str]]:
            limits = httpx.Limits(max_connections=32)
            async with httpx.AsyncClient(limits=limits, timeout=60) as c:
                sem = asyncio.Semaphore(32)

                async def one(i: int) -> tuple[str, str]:
                    async with sem:
                        r = await c.post(srv.url + "/v1/completions", json={
                            "model": srv.model, "prompt": "hi", "max_tokens": 1,
                            "user": f"user-{i % 500}"})
                    assert r.status_code == 200, r.text
                    return f"user-{i % 500}", r.headers["x-corellm-arm"]
                return await asyncio.gather(*(one(i) for i in range(1000)))
        pairs = asyncio.run(send_all())
        by_user: dict[str, set[str]] = collections.defaultdict(set)
        for user, arm in pairs:
            by_user[user].add(arm)
        assert all(len(arms) == 1 for arms in by_user.values())       # a user stays put
        share = collections.Counter(arm for _, arm in pairs)
        assert abs(share["a"] / 1000 - 0.7) <= 0.05, share
        metrics = httpx.get(srv.url + "/metrics").text
        for arm, replica in (("a", "0"), ("b", "1")):
            assert (f'corellm:engine_alive{{arm="{arm}",model_name="{srv.model}",'
                    f'replica="{replica}"}} 1.0') in metrics
            m = re.search(rf'corellm:request_success_total{{arm="{arm}",finished_reason='
                          rf'"length",model_name="{srv.model}"}} (\S+)', metrics)
            assert m and float(m[1]) == share[arm], metrics
        # corellm bench --url: each arm a target of its own, compared side by side
        from corellm.cli.commands import main
        out = tmp_path / "ab.json"
        assert main(["bench", "--url", f"live={srv.url}", "--num-prompts", "40",
                     "--random-input-len", "16", "--random-output-len", "4",
                     "--request-rate", "inf", "--seed", "1", "--no-progress",
                     "--tokenizer", str(llama_path), "--result-filename", str(out)]) == 0
        results = json.loads(out.read_text())
        assert [t["label"] for t in results["targets"]] == ["live/a", "live/b"]
        runs = {r["target"]: r for r in results["runs"]}
        assert runs["live/a"]["completed"] + runs["live/b"]["completed"] == 40
        assert {q["arm"] for q in runs["live/b"]["requests"]} == {"b"}
        assert srv.stop(signal.SIGTERM) == 0
    finally:
        srv.stop(signal.SIGKILL)


def test_bench_counter_deltas_read_a_restarted_replicas_reset_as_prometheus_does():
    """corellm bench --url scrapes /metrics before and after a run: a replica that restarted
    in between counts from 0 again, and its series is read as the count since the reset (never
    a negative count); the other replicas' series are their differences."""
    from corellm_plugins.bench.server_client import counter_deltas, scrape_counters

    def page(r0: int, r1: int) -> str:
        return "\n".join([
            "# HELP corellm:prefix_cache_hits_total hits",
            f'corellm:prefix_cache_hits_total{{model_name="m",replica="0"}} {r0}.0',
            f'corellm:prefix_cache_hits_total{{model_name="m",replica="1"}} {r1}.0',
            'corellm:num_requests_running{model_name="m",replica="0"} 3.0'])

    class Client:
        def __init__(self, text: str) -> None:
            self.text, self.status_code = text, 200

        def get(self, url: str, timeout: float):
            return self

    before = scrape_counters(Client(page(100, 40)), "http://x")
    after = scrape_counters(Client(page(130, 7)), "http://x")      # replica 1 restarted
    assert before["prefix_cache_hits"] == {'model_name="m",replica="0"': 100.0,
                                           'model_name="m",replica="1"': 40.0}
    assert counter_deltas(before, after)["prefix_cache_hits"] == 30 + 7
    assert counter_deltas(after, after)["prefix_cache_hits"] == 0


def test_vllm_naming_labels_request_histograms_with_the_replica():
    """In vLLM's naming the data-parallel rank is the ``engine`` label, of the request
    histograms and counters as of the gauges: each replica's requests are observed under its
    own, and every replica's series is there (at 0) before its first request."""
    from types import SimpleNamespace

    from corellm_plugins.frontend_openai.metrics import EngineMetrics

    class Group:                        # what EngineMetrics asks of an EngineGroup
        replicas = [SimpleNamespace(index=i, arm="") for i in range(2)]
        replica_finished_callbacks: list = []

        def add_replica_stats_listener(self, listener) -> None:
            pass

    group = Group()
    metrics = EngineMetrics(group, "m", "vllm", max_model_len=64)
    metrics.attach_finished(group)
    timing = SimpleNamespace(latency=0.5, time_to_first_token=0.1, first_scheduled_time=1.0,
                             first_token_time=1.1, last_token_time=1.5, arrival_time=0.9,
                             inter_token_latencies=[0.2, 0.2], num_generation_tokens=3)
    state = SimpleNamespace(abort_reason=None, prompt_token_ids=[1, 2], metrics=timing,
                            samples=[SimpleNamespace(token_ids=[5, 6, 7], finish_reason="stop")])
    for callback in group.replica_finished_callbacks:
        callback(group.replicas[1], [state])

    def get(name: str, engine: str, **labels) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": engine,
                                                        **labels})
    assert get("vllm:e2e_request_latency_seconds_count", "1") == 1
    assert get("vllm:e2e_request_latency_seconds_count", "0") == 0
    assert get("vllm:request_success_total", "1", finished_reason="stop") == 1
    assert get("vllm:request_success_total", "0", finished_reason="stop") == 0
    assert get("vllm:request_generation_tokens_sum", "1") == 3


def test_replicas_on_a_platform_with_a_device_per_rank_get_devices_of_their_own(monkeypatch,
                                                                               caplog):
    """On CUDA a data-parallel server gives each replica on this machine its own block of
    tensor_parallel_size devices (parallel.device_ids); the engine-core process turns them into
    CUDA_VISIBLE_DEVICES (as indices into what it sees) before the device runtime starts, so
    its ranks, cuda:0..tp-1, are that replica's. Replicas whose ranks a launcher or executor of
    their own places (Ray) get none; nor do CPU ones (they get CPU slices)."""
    from corellm.config.schema import EngineConfig, ParallelConfig
    from corellm.engine.core_proc import restrict_devices
    from corellm.engine.replicas import Arm, device_slices
    from corellm.errors import ConfigError
    from corellm.plugins import load_registry
    from corellm.specs import CoreLauncherOptions, ExecutorOptions, PlatformOptions

    def config(tp: int, platform: str = "cuda", **sections) -> EngineConfig:
        return EngineConfig(platform=PlatformOptions(name=platform),
                            parallel=ParallelConfig(tensor_parallel_size=tp), **sections)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")     # 8 GPUs seen
    arms = [Arm("a", config(2), 2), Arm("b", config(1), 1),
            Arm("c", config(2, executor=ExecutorOptions(name="ray")), 1),
            Arm("d", config(1, core_launcher=CoreLauncherOptions(name="ray")), 1),
            Arm("e", config(1, platform="cpu"), 1), Arm("f", config(1), 1)]
    assert device_slices(arms) == [[0, 1], [2, 3], [4], None, None, None, [5]]
    # devices a config sets by hand are kept by its replica and skipped for the others
    mine = config(2).model_copy(update={"parallel": ParallelConfig(
        tensor_parallel_size=2, device_ids=[0, 1])})
    assert device_slices([Arm("a", config(1), 2), Arm("b", mine, 1)]) == [[2], [3], None]
    # more than the machine has: none is given any (they share, as one engine's would)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert device_slices([Arm("a", config(2), 2)]) == [None, None]
    assert "need 4 devices of their own and 3 of the 3" in caplog.text

    registry = load_registry()
    replica = config(2).model_copy(update={"parallel": ParallelConfig(
        tensor_parallel_size=2, device_ids=[2, 3])})
    env: dict[str, str] = {}
    assert restrict_devices(replica, registry, env) == "2,3"
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}           # the server's own view, narrowed
    assert restrict_devices(replica, registry, env) == "6,7"
    with pytest.raises(ConfigError, match=r"parallel.device_ids.*sees 2 device\(s\)"):
        restrict_devices(replica, registry, {"CUDA_VISIBLE_DEVICES": "0,1"})
    cpu = config(1, platform="cpu").model_copy(update={"parallel": ParallelConfig(
        device_ids=[1])})
    assert restrict_devices(cpu, registry, env) is None            # the CPU: nothing hidden
    assert restrict_devices(config(2), registry, env) is None      # none given
