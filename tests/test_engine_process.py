"""The engine-core process's life cycle: it never outlives its client (a ``kill -9`` of the
client's process stops it at once, its stop hooks told why), its IPC directory never outlives it,
and a shutdown is bounded (a core that does not stop in time is killed, and the log says so).

Times are printed, not asserted: the bounds below are liveness bounds only."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import engine_config
from tests.plugin_fixtures import install_fake_dist

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 5.0            # liveness bound for an exit or a removal, generous on a loaded CI box

STOP_SINK = r"""
import os, time

def corellm_engine_stopped(engine_id, error):
    with open(os.environ["STOP_LOG"], "a") as f:
        f.write(f"{engine_id} {error!r}\n")
    time.sleep(float(os.environ.get("STOP_SLEEP", "0")))
"""


def _install_stop_sink(tmp_path: Path) -> Path:
    plugins = tmp_path / "plugins"
    install_fake_dist(plugins, "fake-stop-sink-proc", "0.1", {"fake_stop_sink_proc": STOP_SINK},
                      {"stop_sink": "fake_stop_sink_proc"})
    return plugins


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:           # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().split(")")[-1].split()[1]) == pid:
                    out.add(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                pass
    return out


def _wait(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


# --------------------------------------------------------------------------- the client is killed
# The client: an LLM with its engine in a process (the same client process and core as the
# server's), generating when it is killed, so that the core's loop is busy stepping.
PARENT = r"""
import json, sys
from multiprocessing import resource_tracker
from corellm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(json.loads(sys.argv[1]), engine_process=True)
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None) or 0
    print("READY", json.dumps({"engine_pid": llm.client.pid, "ipc_dir": llm.client.ipc_dir,
                               "tracker_pid": tracker}), flush=True)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    while True:
        llm.generate([{"prompt_token_ids": [3] * 8}] * 4, params, use_tqdm=False)
"""

# Runs the client, SIGKILLs it and reaps what it leaves behind: a child subreaper, so that the
# orphaned engine (and resource tracker) become its children and their exit codes can be read.
HARNESS = r"""
import ctypes, json, os, signal, subprocess, sys, time
args = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(36, 1, 0, 0, 0) != 0:                  # PR_SET_CHILD_SUBREAPER
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
parent = subprocess.Popen([sys.executable, "-c", args["parent"], json.dumps(args["config"])],
                          stdout=subprocess.PIPE, text=True)
info = None
for line in parent.stdout:
    if line.startswith("READY "):
        info = json.loads(line[6:])
        break
if info is None:
    parent.kill()
    print(json.dumps({"error": "the client did not start", "code": parent.wait()}))
    sys.exit(0)
engine_pid, tracker_pid = info["engine_pid"], info["tracker_pid"]
dir_before = os.path.isdir(info["ipc_dir"])
time.sleep(0.5)                                       # let it generate
t0 = time.monotonic()
parent.send_signal(signal.SIGKILL)
parent.wait()

def reap(pid, bound):
    # Exit code (or None if still running after bound) and seconds since the SIGKILL.
    while True:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "not a child", time.monotonic() - t0
        if got == pid:
            return os.waitstatus_to_exitcode(status), time.monotonic() - t0
        if time.monotonic() - t0 > bound:
            return None, time.monotonic() - t0
        time.sleep(0.002)

engine_code, engine_s = reap(engine_pid, args["bound"])
dir_gone_s = None
while time.monotonic() - t0 < args["bound"]:
    if not os.path.exists(info["ipc_dir"]):
        dir_gone_s = time.monotonic() - t0
        break
    time.sleep(0.005)
tracker_code, tracker_s = reap(tracker_pid, args["bound"]) if tracker_pid else (None, None)
for pid, code in ((engine_pid, engine_code), (tracker_pid, tracker_code)):
    if pid and code is None:                   # never leave anything behind
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
print(json.dumps({**info, "parent_pid": parent.pid, "dir_before": dir_before,
                  "engine_code": engine_code,
                  "engine_s": engine_s, "dir_gone_s": dir_gone_s, "tracker_code": tracker_code,
                  "tracker_s": tracker_s}))
"""


def test_engine_exits_at_once_when_its_client_is_killed(llama_path, tmp_path):
    """``kill -9`` of the client's process: the core notices at once (its parent's sentinel),
    removes the IPC directory, runs its stop hooks with an error naming the lost parent and
    exits non-zero; the resource tracker the spawn started goes with it."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs prctl(PR_SET_CHILD_SUBREAPER)")
    plugins = _install_stop_sink(tmp_path)
    log = tmp_path / "stops.log"
    env = {**os.environ, "STOP_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(plugins), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    cfg = engine_config(llama_path, model={"max_model_len": 256})
    out = subprocess.run(
        [sys.executable, "-c", HARNESS,
         json.dumps({"parent": PARENT, "config": cfg, "bound": BOUND_S})],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert "error" not in result, out.stderr[-3000:]
    print(f"\nclient SIGKILLed: engine exited after {result['engine_s'] * 1000:.0f} ms "
          f"(code {result['engine_code']}), IPC dir gone after "
          f"{(result['dir_gone_s'] or float('nan')) * 1000:.0f} ms, resource tracker "
          f"exited after {(result['tracker_s'] or float('nan')) * 1000:.0f} ms")
    assert result["dir_before"]
    assert result["engine_code"] not in (None, 0), (result, out.stderr[-3000:])
    assert result["dir_gone_s"] is not None, "the IPC directory was left behind"
    assert not os.path.exists(result["ipc_dir"])
    if result["tracker_pid"]:
        assert result["tracker_code"] is not None, "the resource tracker outlived the engine"
    assert f"parent process {result['parent_pid']} is gone; engine core stopping" in out.stderr, \
        out.stderr[-3000:]
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines            # the stop hook ran, once, and was told why
    assert "ParentProcessLost" in lines[0] and "parent process" in lines[0], lines


# --------------------------------------------------------------------------- the engine is killed
def test_engine_killed_under_a_live_client(llama_path):
    """``kill -9`` of the engine: the client fails with EngineDeadError and removes the IPC
    directory as soon as it sees the process gone, not only at shutdown."""
    from corellm import LLM, SamplingParams
    from corellm.engine.ipc import EngineDeadError

    llm = LLM(engine_config(llama_path), engine_process=True)
    try:
        ipc_dir, pid = llm.client.ipc_dir, llm.client.pid
        assert os.path.isdir(ipc_dir) and _pid_alive(pid)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited with code -9"):
            llm.generate([{"prompt_token_ids": [3] * 5}], SamplingParams(max_tokens=4),
                         use_tqdm=False)
        took = _wait(lambda: not os.path.exists(ipc_dir), BOUND_S, "the IPC directory removal")
        print(f"\nIPC dir removed {took * 1000:.0f} ms after the EngineDeadError")
        assert not _pid_alive(pid)
    finally:
        llm.shutdown()
    assert not os.path.exists(ipc_dir)


# --------------------------------------------------------------------------- shutdown
def test_shutdown_removes_the_ipc_dir_and_leaves_no_child(llama_path):
    from corellm import LLM, SamplingParams

    before = _children(os.getpid())
    llm = LLM(engine_config(llama_path), engine_process=True)
    ipc_dir, pid = llm.client.ipc_dir, llm.client.pid
    out = llm.generate([{"prompt_token_ids": [3] * 5}], SamplingParams(max_tokens=4),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids
    t0 = time.monotonic()
    llm.client.shutdown(timeout=BOUND_S)
    print(f"\nsync shutdown took {(time.monotonic() - t0) * 1000:.0f} ms")
    llm.client.shutdown(timeout=BOUND_S)            # idempotent
    assert not os.path.exists(ipc_dir)
    assert llm.client.process.proc.exitcode == 0
    # No child left: not the engine (reaped, not a zombie), nothing new but a resource tracker
    # (started once per process by the first spawn; it lives as long as this process).
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    from multiprocessing import resource_tracker
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    assert _children(os.getpid()) - before - {tracker} == set()


def test_async_shutdown_with_timeout(llama_path):
    import asyncio

    from corellm.engine.async_client import AsyncMPClient
    from corellm.engine.llm import build_config

    config, _ = build_config(engine_config(llama_path), None, ())

    async def run() -> tuple[str, int, float, int | None]:
        client = await AsyncMPClient.create(config)
        ipc_dir, pid = client.ipc_dir, client.pid
        assert os.path.isdir(ipc_dir)
        assert await client.call_utility_async("ping", timeout=BOUND_S) > 0
        t0 = time.monotonic()
        await client.shutdown_async(timeout=BOUND_S)
        took = time.monotonic() - t0
        await client.shutdown_async(timeout=BOUND_S)      # idempotent
        return ipc_dir, pid, took, client.process.proc.exitcode

    ipc_dir, pid, took, code = asyncio.run(asyncio.wait_for(run(), 300))
    print(f"\nasync shutdown took {took * 1000:.0f} ms")
    assert code == 0
    assert not os.path.exists(ipc_dir) and not _pid_alive(pid)


def test_a_send_blocked_on_a_core_that_dies_ends_with_the_death():
    """A send that began just before the core's death was noticed (the core no longer reads:
    the send does not complete) fails as soon as the death is noticed, not after
    SEND_TIMEOUT_S; and a utility call's timeout bounds its send too. (/health, a ping with a
    5 s timeout, once took the 10 s send timeout here.)"""
    import asyncio
    import types

    from corellm.engine import async_client
    from corellm.engine.ipc import EngineDeadError

    async def run() -> tuple[float, float]:
        client = object.__new__(async_client.AsyncMPClient)
        loop = asyncio.get_running_loop()
        client.loop, client.outputs, client._calls = loop, asyncio.Queue(), {}
        client._call_ids = iter(range(1, 1000))
        client._death = asyncio.Event()
        client.process = types.SimpleNamespace(dead_reason=None)
        client._in = types.SimpleNamespace(send_multipart=lambda parts: loop.create_future())
        t0 = time.monotonic()
        loop.call_later(0.2, client._on_death, "killed by signal SIGKILL")
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await client.call_utility_async("ping", timeout=30)
        after_death = time.monotonic() - t0
        client.process.dead_reason, client._death = None, asyncio.Event()    # alive, not reading
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await client.call_utility_async("ping", timeout=0.3)
        return after_death, time.monotonic() - t0

    after_death, after_timeout = asyncio.run(run())
    assert 0.2 <= after_death < async_client.SEND_TIMEOUT_S / 2
    assert 0.3 <= after_timeout < async_client.SEND_TIMEOUT_S / 2


def test_a_core_that_does_not_stop_in_time_is_killed(llama_path, tmp_path, monkeypatch, caplog):
    """The graceful part of a shutdown is bounded by its timeout: a stop hook that hangs gets
    the core SIGKILLed, and the log says exactly that."""
    plugins = _install_stop_sink(tmp_path)
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.setenv("STOP_LOG", str(tmp_path / "stops.log"))
    monkeypatch.setenv("STOP_SLEEP", "60")
    from corellm import LLM

    llm = LLM(engine_config(llama_path), engine_process=True)
    ipc_dir = llm.client.ipc_dir
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="corellm.engine.core_client"):
        llm.client.shutdown(timeout=1.0)
    took = time.monotonic() - t0
    sys.modules.pop("fake_stop_sink_proc", None)
    print(f"\nshutdown(timeout=1) of a hanging core took {took * 1000:.0f} ms")
    assert took < 1.0 + BOUND_S
    assert llm.client.process.proc.exitcode == -signal.SIGKILL
    assert "did not stop within 1.0 s of the shutdown request; killing it (SIGKILL)" \
        in caplog.text
    assert "terminating" not in caplog.text
    assert not os.path.exists(ipc_dir)
    assert (tmp_path / "stops.log").read_text().count("\n") == 1     # the hook had started


def test_the_stop_log_states_the_real_exit_code(monkeypatch, caplog):
    """The watch thread and a stop both wait for the core to exit. When the watch thread reaps
    it but has not yet stored its status (here: held up 0.5 s after its waitpid, as by a wait
    for the GIL), the stop must still log the real exit code, not None."""
    import multiprocessing

    from corellm.engine.core_process import _CoreProcess

    real_waitpid = os.waitpid

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        result = real_waitpid(pid, options)
        if result[0] == pid and threading.current_thread().name == "corellm-core-watch":
            time.sleep(0.5)
        return result
    monkeypatch.setattr(os, "waitpid", waitpid)
    core = _CoreProcess()
    core.proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,),
                                                             daemon=True)
    core.proc.start()
    deaths: list[str] = []
    core.watch(deaths.append)
    with caplog.at_level(logging.INFO, logger="corellm.engine.core_client"):
        core.stop(lambda budget: os.kill(core.proc.pid, signal.SIGTERM), timeout=BOUND_S)
    assert f"stopped (exit code {-signal.SIGTERM})" in caplog.text, caplog.text
    assert core.proc.exitcode == -signal.SIGTERM
    assert not deaths and not os.path.exists(core.ipc_dir)
    core.ctx.term()


# --------------------------------------------------------------------------- memory
def test_the_core_trims_its_heap_once_per_idle_spell(tmp_path, monkeypatch):
    """What a busy core keeps in its heap for reuse goes back to the OS once it has been idle
    for IDLE_TRIM_S: once per idle spell (the first one being the start-up's), never between
    steps."""
    from corellm.engine import core_proc, ipc

    trims: list[float] = []
    monkeypatch.setattr(core_proc, "IDLE_TRIM_S", 0.3)
    monkeypatch.setattr(core_proc, "heap_trimmer",
                        lambda: lambda: trims.append(time.monotonic()))
    busy = threading.Event()
    last_step = [0.0]

    class Engine:
        def add_stats_listener(self, listener) -> None:
            pass

        def has_unfinished_requests(self) -> bool:
            return busy.is_set()

        def step(self) -> list:
            time.sleep(0.01)
            last_step[0] = time.monotonic()
            return []

    proc = core_proc.EngineCoreProc(Engine(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    loop = threading.Thread(target=proc.run_busy_loop)
    loop.start()

    def idle_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:               # wake the loop as new input would
            proc.inputs.put((core_proc._WAKE, None))
            time.sleep(0.02)
    try:
        idle_for(0.6)
        assert len(trims) == 1                      # after start-up
        busy.set()
        idle_for(0.6)                               # stepping all along: no trim
        assert len(trims) == 1
        busy.clear()
        idle_for(1.0)
        assert len(trims) == 2 and trims[1] - last_step[0] >= 0.3
    finally:
        proc.inputs.put((ipc.SHUTDOWN, None))
        loop.join(BOUND_S)
        proc.close()
    assert not loop.is_alive()


# --------------------------------------------------------------------------- the IPC directory
def test_ipc_dir_removal_is_idempotent_and_thread_safe():
    from corellm.engine.core_process import _CoreProcess

    proc = _CoreProcess()
    assert os.path.isdir(proc.ipc_dir)
    (Path(proc.ipc_dir) / "input").write_text("")         # as if a socket were bound there
    errors: list[BaseException] = []

    def remove() -> None:
        try:
            proc.remove_ipc_dir()
        except BaseException as exc:          # pragma: no cover - the failure being tested
            errors.append(exc)
    threads = [threading.Thread(target=remove) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    assert not errors and not os.path.exists(proc.ipc_dir)
    proc.kill()                  # never started: nothing to kill, the directory already gone
    proc.stop(None, timeout=0)
    proc.ctx.term()


def test_parent_watch_without_a_sentinel_polls_getppid(tmp_path):
    """Where there is no parent sentinel (not a spawned child), the watch falls back to
    ``os.getppid()``; a lost parent still removes the IPC directory and exits non-zero within
    the bound."""
    ipc_dir = tmp_path / "corellm-ipc-test"
    ipc_dir.mkdir()
    script = (
        "import sys, time\n"
        "from corellm.engine import core_proc\n"
        "watch = core_proc._ParentWatch(-1, sys.argv[1])\n"     # not our parent: lost at once
        "assert watch._sentinel is None\n"
        "watch.start()\n"
        "time.sleep(60)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script, str(ipc_dir)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    print(f"\nexited {(time.monotonic() - t0) * 1000:.0f} ms after start (imports included)")
    assert out.returncode == 1, out.stderr
    assert "parent process -1 is gone" in out.stderr
    assert not ipc_dir.exists()


def test_the_core_runs_at_most_two_batches_ahead_of_an_async_client(llama_path):
    """Flow control: a client that has not processed the outputs it got (a busy API process)
    holds the engine core at MAX_OUTPUTS_AHEAD unprocessed batches, instead of letting outputs
    pile up ahead of a request that arrives later; the core still answers utility calls while
    held, and steps on once the batches are credited."""
    import asyncio

    from corellm.engine.async_client import AsyncMPClient
    from corellm.engine.llm import build_config
    from corellm.request import EngineCoreRequest
    from corellm.sampling_params import SamplingParams

    config, _ = build_config(engine_config(llama_path), None, ())
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def run() -> tuple[int, int, int]:
        client = await AsyncMPClient.create(config)
        try:
            await client.add_requests_async([EngineCoreRequest(
                "r", [10, 11, 12], params, None, time.time())])
            await asyncio.sleep(1.0)            # time for 40 steps, were the core not held
            held = (await client.call_utility_async("get_stats")).num_generation_tokens
            batches = client.outputs.qsize()
            while True:                         # now process (credit) every batch
                batch = await asyncio.wait_for(client.get_output_async(), BOUND_S)
                await client.outputs_processed(batch)
                if any(o.finish_reason for o in batch.outputs):
                    break
            done = (await client.call_utility_async("get_stats")).num_generation_tokens
            return held, batches, done
        finally:
            await client.shutdown_async(timeout=BOUND_S)

    held, batches, done = asyncio.run(asyncio.wait_for(run(), 300))
    assert held == AsyncMPClient.MAX_OUTPUTS_AHEAD == batches
    assert done == 40
