"""Output processing off the stepping thread: ``LLM(core_thread=True)`` steps its in-process
engine on a core thread (``ThreadedInprocClient``) while the caller detokenizes, matches stop
strings and builds outputs. Same outputs as the serial loop; every request ends; errors,
interrupts, stats, utility calls, shutdown and direct use of ``llm.engine`` (``corellm bench``'s
``drive_engine``) behave as they do serially."""

from __future__ import annotations

import gc
import importlib.util
import json
import signal
import threading
import time
from pathlib import Path

import pytest

from corellm import LLM, SamplingParams
from corellm.engine.core_client import InprocClient, ThreadedInprocClient
from corellm.engine.llm import DEFAULT_CORE_THREAD, default_core_thread
from corellm.errors import InvalidRequestError, PluginError
from corellm.interfaces import ExecutorError
from tests.conftest import assert_pool_whole, engine_config

PROMPTS = ["hello world", "the cat sat", "a", {"prompt_token_ids": [5, 6, 7, 8, 9] * 4},
           "once upon a time", "z"]


@pytest.fixture(scope="module")
def serial(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def threaded(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=True)
    yield llm
    llm.shutdown()


def _view(outs):
    """Everything a caller sees of the outputs but the timing metrics, and the logprobs apart
    (a stop string's sample stays one step longer in the threaded engine's batches, and a
    batch of another shape may round a logprob differently in the last bits)."""
    exact, floats = [], []
    for o in outs:
        exact.append((o.prompt, o.prompt_token_ids, o.finished, o.num_cached_tokens >= 0,
                      [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                        None if c.logprobs is None else
                        [{t: (lp.rank, lp.decoded_token) for t, lp in step.items()}
                         for step in c.logprobs]) for c in o.outputs]))
        for c in o.outputs:
            if c.logprobs is not None:
                floats.append(c.cumulative_logprob)
                floats += [lp.logprob for step in c.logprobs for lp in step.values()]
    return exact, floats


def _same(got, expected) -> None:
    (exact, floats), (exact_e, floats_e) = _view(got), _view(expected)
    assert exact == exact_e
    assert floats == pytest.approx(floats_e, abs=1e-4)


def _core_thread_alive_and_idle(llm) -> None:
    thread = llm.client.thread
    assert thread is not None and thread.is_alive()
    steps = llm.engine.num_steps
    time.sleep(0.05)
    assert llm.engine.num_steps == steps, "the core thread steps outside a run"


# ----------------------------------------------------------------------------- choosing it
def test_the_client_follows_core_thread(llama_path, serial, threaded, monkeypatch):
    assert type(serial.client) is InprocClient
    assert type(threaded.client) is ThreadedInprocClient
    assert threaded.engine is threaded.client.engine        # llm.engine stays the EngineCore
    monkeypatch.delenv("CORELLM_CORE_THREAD", raising=False)
    assert default_core_thread() is DEFAULT_CORE_THREAD
    for value, expected in (("1", True), ("off", False), ("", DEFAULT_CORE_THREAD)):
        monkeypatch.setenv("CORELLM_CORE_THREAD", value)
        llm = LLM(engine_config(llama_path))
        try:
            assert isinstance(llm.client, ThreadedInprocClient) is expected
        finally:
            llm.shutdown()
    with pytest.raises(InvalidRequestError, match="core_thread"):
        LLM(engine_config(llama_path), engine_process=True, core_thread=True)


def test_the_thread_starts_with_the_first_run(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=True)
    try:
        assert llm.client.thread is None
        llm.get_stats()
        assert llm.client.thread is None
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        _core_thread_alive_and_idle(llm)
        assert llm.client.thread.name == "corellm-core"
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- same outputs
@pytest.mark.parametrize("name,params", [
    ("greedy", SamplingParams(max_tokens=24, temperature=0)),
    ("greedy-ignore-eos", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
    ("stop-strings", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                    stop=["e", "th", "  "])),
    ("stop-included", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                     stop=["a"], include_stop_str_in_output=True)),
    ("n-seeded", SamplingParams(n=3, max_tokens=16, temperature=0.9, seed=7, ignore_eos=True)),
    ("logprobs", SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)),
    ("n-stop-logprobs", SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=3,
                                       ignore_eos=True, stop=["o"], logprobs=2)),
    ("min-tokens-stop", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                       min_tokens=10, stop=["e"])),
])
def test_same_outputs_as_the_serial_loop(serial, threaded, name, params):
    expected = serial.generate(PROMPTS, params, use_tqdm=False)
    got = threaded.generate(PROMPTS, params, use_tqdm=False)
    _same(got, expected)
    assert all(o.finished for o in got)
    if params.stop:
        # Some sample did stop on a string, else the case tests nothing.
        assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str)
                   for o in got for c in o.outputs)
    assert_pool_whole(threaded)
    _core_thread_alive_and_idle(threaded)


def test_per_prompt_params_many_requests_and_chat_shape(serial, threaded):
    prompts = [{"prompt_token_ids": [3 + i % 50] * (5 + i % 17)} for i in range(40)]
    params = [SamplingParams(max_tokens=1 + i % 13, temperature=0, ignore_eos=i % 2 == 0,
                             **({"stop": ["e"]} if i % 3 == 0 else {})) for i in range(40)]
    _same(threaded.generate(prompts, params, use_tqdm=False),
          serial.generate(prompts, params, use_tqdm=False))


def test_a_stop_string_costs_at_most_one_step_ahead(serial, threaded):
    """The thread runs one step ahead: a stop string found in step k is aborted before step
    k+2, so the threaded run takes at most one step more than the serial one."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=["e"])
    s0, t0 = serial.get_stats().num_steps, threaded.get_stats().num_steps
    a = serial.generate(["hello"], params, use_tqdm=False)
    b = threaded.generate(["hello"], params, use_tqdm=False)
    _same(b, a)
    assert a[0].outputs[0].finish_reason == "stop"
    ds, dt = serial.get_stats().num_steps - s0, threaded.get_stats().num_steps - t0
    assert ds <= dt <= ds + 1


def test_the_thread_runs_at_most_two_batches_ahead(llama_path):
    """A slow caller (a listener sleeping in this thread) never falls more than
    ``max_batches_ahead`` batches behind the engine."""
    llm = LLM(engine_config(llama_path), core_thread=True)
    client = llm.client
    lags = []
    real_get = client.get_output
    received = [0]

    def get_output():
        batch = real_get()
        received[0] += 1
        lags.append(llm.engine.num_steps - received[0])
        return batch
    client.get_output = get_output
    llm.add_stats_listener(lambda s: time.sleep(0.01))
    try:
        llm.generate([{"prompt_token_ids": [4] * 8}] * 3, SamplingParams(max_tokens=12,
                                                                        ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    assert lags and max(lags) <= client.max_batches_ahead - 1 and max(lags) >= 0


# ----------------------------------------------------------------------------- stats, utilities
def test_stats_listeners_get_every_record_in_the_callers_thread(llama_path):
    records, threads = [], set()
    llm = LLM(engine_config(llama_path), core_thread=True)

    def listener(s):
        records.append(s)
        threads.add(threading.current_thread())
    llm.add_stats_listener(listener)
    try:
        before = llm.get_stats().num_steps
        llm.generate([{"prompt_token_ids": [3] * 5}, {"prompt_token_ids": [4] * 9}],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        steps = [s for s in records if s.kind == "step"]
        assert len(steps) == llm.get_stats().num_steps - before == 4
        assert sorted(f.num_generation_tokens for s in records for f in s.finished) == [4, 4]
        # A stop string: the abort's "event" record arrives too, by the end of the call.
        records.clear()
        out = llm.generate(["hello"], SamplingParams(max_tokens=60, temperature=0,
                                                     ignore_eos=True, stop=["e"]),
                           use_tqdm=False)
        assert out[0].outputs[0].finish_reason == "stop"
        assert [f.finish_reason for s in records for f in s.finished] == ["abort"]
        assert len([s for s in records if s.kind == "step"]) == llm.get_stats().num_steps - \
            before - 4
        # Between runs, records made in this thread are delivered at once.
        records.clear()
        assert llm.reset_prefix_cache()
        assert [s.kind for s in records] == ["event"]
        assert threads == {threading.main_thread()}
    finally:
        llm.shutdown()


def test_utility_calls_in_a_run_run_on_the_core_thread(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=True)
    engine = llm.engine
    where, seen = [], []
    real = engine.get_stats

    def get_stats():
        where.append(threading.current_thread().name)
        return real()
    engine.get_stats = get_stats
    # A listener (in this thread, inside the run) asks for the stats: served between steps.
    llm.add_stats_listener(lambda s: seen.append(llm.get_stats().num_steps)
                           if s.kind == "step" else None)
    try:
        llm.generate([{"prompt_token_ids": [3] * 5}], SamplingParams(max_tokens=5,
                                                                    ignore_eos=True),
                     use_tqdm=False)
        assert where and set(where) == {"corellm-core"}
        assert seen == sorted(seen) and len(seen) == 5
        where.clear()
        llm.get_stats()                              # between runs: here
        assert where == [threading.current_thread().name]
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- failures
def test_an_engine_error_surfaces_with_its_type_and_ends_every_request(llama_path, monkeypatch):
    llm = LLM(engine_config(llama_path), core_thread=True)
    engine = llm.engine
    real = engine.executor.execute_model
    calls = {"n": 0}

    def explode(plan):
        calls["n"] += 1
        if calls["n"] == 4:
            raise PluginError("sampler plugin fell over")
        return real(plan)
    monkeypatch.setattr(engine.executor, "execute_model", explode)
    try:
        with pytest.raises(PluginError, match="sampler plugin fell over") as info:
            llm.generate(PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
        assert any(e.name == "explode" for e in info.traceback)    # its own frames kept
        assert not engine.has_unfinished_requests()
        assert_pool_whole(llm)
        _core_thread_alive_and_idle(llm)
        monkeypatch.undo()
        # The engine stays usable, the thread too.
        out = llm.generate("still alive", SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert out[0].finished and len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_an_executor_error_fails_everything_and_surfaces(llama_path, monkeypatch):
    llm = LLM(engine_config(llama_path), core_thread=True)
    engine = llm.engine

    def dead(plan):
        raise ExecutorError("rank 0: the workers are gone")
    try:
        llm.generate("warm", SamplingParams(max_tokens=2), use_tqdm=False)
        monkeypatch.setattr(engine.executor, "execute_model", dead)
        with pytest.raises(ExecutorError, match="workers are gone"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=20), use_tqdm=False)
        assert not engine.has_unfinished_requests()
        assert_pool_whole(llm)
    finally:
        monkeypatch.undo()
        llm.shutdown()


def test_a_bad_prompt_still_raises_before_anything_runs(threaded):
    before = threaded.get_stats().num_steps
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]\.prompt"):
        threaded.generate(["fine", "", "also fine"], use_tqdm=False)
    assert threaded.get_stats().num_steps == before
    assert_pool_whole(threaded)


@pytest.mark.parametrize("core_thread", [False, True])
def test_a_lost_request_is_an_error_not_a_hang(llama_path, monkeypatch, core_thread):
    """A request the engine drops without an output: the caller is told, in either mode."""
    llm = LLM(engine_config(llama_path), core_thread=core_thread)
    engine = llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        outs = real_step()
        if calls["n"] == 2:      # every request ended behind the client's back, unreported
            engine.scheduler.abort_requests(engine.scheduler.get_request_ids())
        return outs
    monkeypatch.setattr(engine, "step", step)
    try:
        with pytest.raises(RuntimeError, match="never finished"):
            llm.generate(["a", "b"], SamplingParams(max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
        assert_pool_whole(llm)
    finally:
        monkeypatch.undo()
        llm.shutdown()


def test_ctrl_c_in_the_caller_aborts_leftovers_and_stops_the_thread(llama_path):
    """A real SIGINT to the main thread while it waits for outputs (the core thread sends it
    from its third step): generate raises KeyboardInterrupt, every request of the call is
    aborted, the thread stops stepping, and the next generate works."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signals)")
    llm = LLM(engine_config(llama_path), core_thread=True)
    engine = llm.engine
    main_id = threading.main_thread().ident
    fired = []

    def on_step(stats):                   # the engine's own listener: on the core thread
        if stats.kind == "step" and stats.step == 3 and not fired:
            fired.append(threading.current_thread().name)
            signal.pthread_kill(main_id, signal.SIGINT)
    engine.add_stats_listener(on_step)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [3 + i] * 10} for i in range(4)],
                         SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        assert fired == ["corellm-core"]
        assert not engine.has_unfinished_requests()
        assert_pool_whole(llm)
        assert not llm.output_processor.has_unfinished_requests()
        _core_thread_alive_and_idle(llm)
        out = llm.generate("again", SamplingParams(max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        signal.signal(signal.SIGINT, previous)
        llm.shutdown()


def test_an_interrupt_while_processing_outputs(llama_path):
    """A KeyboardInterrupt raised in the caller's thread mid-run (from a listener, which runs
    there): the same clean end."""
    llm = LLM(engine_config(llama_path), core_thread=True)
    seen = []

    def listener(s):
        seen.append(s)
        if len(seen) == 4:
            raise KeyboardInterrupt
    llm.add_stats_listener(listener)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [3 + i] * 10} for i in range(4)],
                         SamplingParams(max_tokens=300, ignore_eos=True), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert_pool_whole(llm)
        _core_thread_alive_and_idle(llm)
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- shutdown
def test_shutdown_joins_the_thread(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=True)
    llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    thread = llm.client.thread
    assert thread.is_alive()
    llm.shutdown()
    assert not thread.is_alive()
    llm.shutdown()                                   # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    # Never ran: no thread, nothing to join.
    with LLM(engine_config(llama_path), core_thread=True) as other:
        pass
    assert other.client.thread is None


def test_a_dropped_llm_lets_its_thread_go(llama_path):
    llm = LLM(engine_config(llama_path), core_thread=True)
    llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    thread = llm.client.thread
    del llm
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


# ----------------------------------------------------------------------------- llm.engine
def test_drive_engine_and_direct_steps_between_runs(llama_path):
    """``corellm bench``'s drive_engine steps ``llm.engine`` itself: between generate calls
    the engine is the caller's (the core thread waits), before the first one there is no
    thread at all."""
    from corellm_plugins.bench.engine_driver import drive_engine
    from corellm_plugins.bench.targets import RunOptions
    from corellm_plugins.bench.workload import build_workload

    wl = build_workload({"name": "w", "seed": 0, "num_requests": 6,
                         "requests": {"input_len": 12, "output_len": 5},
                         "arrivals": "all_at_once"}, vocab_size=200, exclude_ids={0})
    llm = LLM(engine_config(llama_path), core_thread=True)
    try:
        records, _ = drive_engine(llm, wl, RunOptions(progress=False), salt="a")
        assert all(r.ok for r in records) and llm.client.thread is None
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        first = llm.generate("x", greedy, use_tqdm=False)
        records, _ = drive_engine(llm, wl, RunOptions(progress=False), salt="b")
        assert all(r.ok and r.output_tokens == 5 for r in records)
        # Direct steps, as tests and the docs' examples do.
        _, core = llm.processor.process("direct", {"prompt_token_ids": [7] * 6},
                                        SamplingParams(max_tokens=3, ignore_eos=True))
        llm.engine.add_request(core)
        finished = []
        while llm.engine.has_unfinished_requests():
            finished += [o.request_id for o in llm.engine.step() if o.finished]
        assert finished == ["direct"]
        again = llm.generate("x", greedy, use_tqdm=False)
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- the benchmark
def test_the_benchmark_runs_and_agrees(llama_path, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_output_overlap",
        Path(__file__).resolve().parent.parent / "benchmarks" / "output_overlap.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "o.json"
    assert bench.main(["--model", str(llama_path), "--num-requests", "4", "--input-len", "4:8",
                       "--output-len", "6:6", "--repeats", "1", "--noise-procs", "1",
                       "--logprobs", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "CPU: " in table and "noise +1" in table
    results = json.loads(out.read_text())
    assert set(results["runs"]) == {"quiet", "noise"}
    for cond in results["runs"].values():
        assert {"serial", "thread", "process"} <= set(cond)
        assert all(cond[m]["output_tokens"] == 24 for m in ("serial", "thread", "process"))
    assert all(a["identical"] == 4 for a in results["agreement"].values())
