"""The engine core in its own process: a busy loop that drains new requests, steps, and pushes
outputs, so that HTTP parsing, tokenization and detokenization (in the client's process) never
stall the step loop.

Three threads: the main one runs the loop; one receives and decodes client messages into a
queue; one encodes and sends outputs from a queue, overlapping serialization with the next
step (ZeroMQ and msgspec release the GIL while they copy).

With flow control (``max_outputs_ahead``, which the asyncio client asks for), the loop steps
only while fewer than that many output batches are unprocessed by the client (it sends a
``CREDIT`` for each it has finished). A client slower than the engine (a busy API process
detokenizing many streams) then slows the engine to its own pace instead of queueing outputs
without bound, so a request that arrives is answered after at most that many batches, not
after everything produced before it.

After ``IDLE_TRIM_S`` without a step, the main thread returns the C heap's free memory to the
OS once (glibc's ``malloc_trim``): what a busy core keeps for reuse (the step temporaries, kept
in the heap by the CPU platform's allocator tuning) is not held through an idle spell.

A fourth watches the parent (the client's process). If it dies (``kill -9``), the core removes
the IPC directory, leaves its loop after the current step, runs ``engine.shutdown(error)`` (the
stop hooks see an error naming the lost parent) and exits with code 1, without waiting for the
sockets whose peer is gone; after ``PARENT_LOST_EXIT_S`` it exits anyway.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from collections.abc import MutableMapping
from typing import Any, Callable

import zmq

from corellm.engine import ipc
from corellm.outputs import EngineCoreOutput, EngineCoreOutputs, StepStats

logger = logging.getLogger("corellm.engine_core")

# Once the parent is gone, the process exits within this many seconds whatever it is doing.
PARENT_LOST_EXIT_S = 1.0
# How often the parent watch double-checks os.getppid() (a safety net behind the sentinel, and
# the only check where there is no sentinel).
PARENT_POLL_S = 1.0
# Wakes the busy loop (never sent by a client).
_WAKE = b"_wake"
# Seconds without a step after which the core trims its heap (once per idle spell). Longer than
# the pauses within a burst of requests, so a busy server does not page its temporaries back
# in after every pause; a trim of a large heap takes a noticeable time, and a request arriving
# meanwhile waits for it.
IDLE_TRIM_S = 5.0


def heap_trimmer() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of glibc (free pages anywhere in the heaps go back to the OS), or
    None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (ValueError, OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


class ParentProcessLost(RuntimeError):
    """The error ``engine.shutdown`` gets when the process that started the core is gone."""


class EngineCoreProc:
    def __init__(self, engine: Any, input_addr: str, output_addr: str,
                 max_outputs_ahead: int | None = None,
                 secure: Callable[[zmq.Socket], None] | None = None) -> None:
        self.engine = engine
        # Configures each socket before it connects (a launcher's authentication, say).
        self._secure = secure
        self.max_outputs_ahead = max_outputs_ahead
        self._ahead = 0             # batches with outputs sent and not yet credited
        self.inputs: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.outputs: queue.Queue[tuple[bytes, Any] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self._stop = False
        self._closing = False
        # Set when the client's process is gone: nothing left to flush outputs to.
        self.peer_gone = False
        # The engine's StepStats since the last send: they go to the client with the outputs,
        # where /metrics and other listeners read them.
        self._stats: list[StepStats] = []
        engine.add_stats_listener(self._stats.append)
        self._trim_heap = heap_trimmer()
        self._threads = [
            threading.Thread(target=self._recv_loop, args=(input_addr,), daemon=True,
                             name="corellm-core-input"),
            threading.Thread(target=self._send_loop, args=(output_addr,), daemon=True,
                             name="corellm-core-output"),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ socket threads
    def _recv_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        if self._secure is not None:
            self._secure(sock)
        sock.connect(addr)
        decoders = {ipc.ADD: ipc.request_decoder.decode, ipc.ABORT: ipc.abort_decoder.decode,
                    ipc.UTILITY: ipc.utility_call_decoder.decode, ipc.SHUTDOWN: lambda b: None,
                    ipc.CREDIT: ipc.int_decoder.decode}
        while not self._closing:
            if not sock.poll(200):
                continue
            kind, payload = sock.recv_multipart(copy=False)
            kind = bytes(kind.buffer)
            try:
                self.inputs.put((kind, decoders[kind](payload.buffer)))
            except Exception:   # a malformed message must not kill the engine
                logger.exception("dropping an undecodable %r message", kind)
        sock.close(linger=0)

    def _send_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDTIMEO, 200)    # a full queue must not hide a lost peer
        if self._secure is not None:
            self._secure(sock)
        sock.connect(addr)
        while True:
            item = self.outputs.get()
            if item is None:
                # Flush the last outputs (e.g. DEAD) on exit, unless nobody is left to read them.
                sock.close(linger=0 if self.peer_gone else 2000)
                return
            kind, obj = item
            frames = (kind, ipc.encoder.encode(obj))
            while not self.peer_gone:
                try:
                    sock.send_multipart(frames, copy=False)
                    break
                except zmq.Again:     # the client is slow to read: keep trying while it lives
                    continue

    # ------------------------------------------------------------------ the loop
    def run_busy_loop(self) -> None:
        engine = self.engine
        # When the last step ended; None once the heap was trimmed since.
        last_step: float | None = time.monotonic()
        while not self._stop:
            # Block only when there is nothing to step, or the client is behind.
            self._handle_inputs(block=not engine.has_unfinished_requests()
                                or self._client_behind())
            if self._stop:
                break
            if engine.has_unfinished_requests() and not self._client_behind():
                outputs = engine.step()
                last_step = time.monotonic()
                if outputs or self._stats:
                    self._send_outputs(outputs)
            elif last_step is not None and not engine.has_unfinished_requests() \
                    and time.monotonic() - last_step >= IDLE_TRIM_S:
                last_step = None
                if self._trim_heap is not None:
                    self._trim_heap()

    def _client_behind(self) -> bool:
        return self.max_outputs_ahead is not None and self._ahead >= self.max_outputs_ahead

    def _handle_inputs(self, block: bool) -> None:
        if block:
            try:
                self._handle(*self.inputs.get(timeout=1.0))
            except queue.Empty:
                return
        while not self._stop:
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, kind: bytes, payload: Any) -> None:
        if kind == _WAKE:
            return
        if kind == ipc.CREDIT:
            self._ahead = max(0, self._ahead - payload)
        elif kind == ipc.ADD:
            try:
                self.engine.add_request(payload)
            except Exception as exc:    # one bad request (a duplicate id...) is not fatal
                logger.error("rejected request %s: %s", payload.request_id, exc)
                self._send_outputs([EngineCoreOutput(payload.request_id, [],
                                                     finish_reason="error",
                                                     stop_reason=str(exc))])
        elif kind == ipc.ABORT:
            outputs = self.engine.abort_requests(payload)
            if outputs or self._stats:
                self._send_outputs(outputs)
        elif kind == ipc.UTILITY:
            self._call_utility(payload)
            if self._stats:                 # e.g. a prefix-cache reset changed the snapshot
                self._send_outputs([])
        elif kind == ipc.SHUTDOWN:
            self._stop = True

    def _call_utility(self, call: ipc.UtilityCall) -> None:
        result: Any = None
        error = None
        if call.method not in ipc.UTILITY_RESULT_TYPES:
            error = f"unknown utility method {call.method!r}"
        else:
            try:
                result = time.time() if call.method == "ping" else \
                    getattr(self.engine, call.method)(*call.args)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        self.outputs.put((ipc.UTILITY_RESULT, ipc.UtilityResult(
            call.call_id, error, ipc.msgspec.Raw(ipc.encoder.encode(result)))))

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        stats = self._stats[:]
        self._stats.clear()
        if outputs:
            self._ahead += 1
        self.outputs.put((ipc.OUTPUTS, EngineCoreOutputs(outputs, self.engine.clock.time(),
                                                         stats)))

    def send_dead(self, reason: str) -> None:
        self.outputs.put((ipc.DEAD, reason))

    def stop_for_lost_parent(self) -> None:
        """Leave the loop after the current step; drop what cannot be delivered any more."""
        self.peer_gone = True
        self._stop = True
        self.inputs.put((_WAKE, None))          # wake a loop blocked waiting for input

    def close(self) -> None:
        self._closing = True
        self.outputs.put(None)
        if self.peer_gone:
            return                 # nothing to flush to: the process exit reclaims the sockets
        for t in self._threads:
            t.join(timeout=5)
        if not any(t.is_alive() for t in self._threads):
            self.ctx.term()        # else: a stuck socket; process exit reclaims it


class _ParentWatch:
    """Notices at once when the process that started the core dies (killed with SIGKILL, say):
    an engine nobody can reach must not hold the accelerator, its memory or the IPC directory.

    In a spawned child, ``multiprocessing.parent_process().sentinel`` becomes readable the
    moment the parent dies; ``os.getppid()`` is checked too, every ``PARENT_POLL_S`` (the only
    check where there is no sentinel, e.g. when ``run_engine_core`` runs in-process)."""

    def __init__(self, parent_pid: int, ipc_dir: str | None) -> None:
        self.parent_pid = parent_pid
        self.ipc_dir = ipc_dir
        self.lost = threading.Event()
        self.proc: EngineCoreProc | None = None      # set once the busy loop may start
        self._lock = threading.Lock()
        parent = multiprocessing.parent_process()
        self._sentinel = parent.sentinel if parent is not None and parent.pid == parent_pid \
            else None

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="corellm-parent-watch").start()

    def attach(self, proc: EngineCoreProc) -> None:
        """The busy loop is about to start: a lost parent stops it from now on."""
        with self._lock:
            self.proc = proc
            if self.lost.is_set():
                proc.stop_for_lost_parent()

    def error(self) -> ParentProcessLost:
        return ParentProcessLost(f"parent process {self.parent_pid} is gone (the client that "
                                 "started the engine core died)")

    def _parent_alive(self) -> bool:
        if self._sentinel is None:
            time.sleep(PARENT_POLL_S)
            return os.getppid() == self.parent_pid
        try:
            ready = wait([self._sentinel], timeout=PARENT_POLL_S)
        except OSError:                # the descriptor is unusable: rely on getppid alone
            ready, self._sentinel = [], None
        if not ready:
            return os.getppid() == self.parent_pid
        # The parent's end of the pipe is closed. A dying process closes its files a moment
        # before its children are re-parented: confirm with getppid, briefly.
        deadline = time.monotonic() + 0.5
        while os.getppid() == self.parent_pid:
            if time.monotonic() > deadline:    # alive, yet it closed the pipe: poll from now on
                logger.warning("parent process %d closed its sentinel pipe; watching it with "
                               "getppid every %.0f s", self.parent_pid, PARENT_POLL_S)
                self._sentinel = None
                return True
            time.sleep(0.001)
        return False

    def _run(self) -> None:
        while self._parent_alive():
            pass
        t0 = time.monotonic()
        logger.error("parent process %d is gone; engine core stopping (exiting within %.0f s)",
                     self.parent_pid, PARENT_LOST_EXIT_S)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        with self._lock:
            self.lost.set()
            if self.proc is not None:
                self.proc.stop_for_lost_parent()
        # Bounded: a long step, a slow stop hook or a stuck socket does not keep us alive.
        time.sleep(max(0.0, PARENT_LOST_EXIT_S - (time.monotonic() - t0)))
        logger.error("engine core did not exit within %.0f s of losing its parent; exiting now",
                     PARENT_LOST_EXIT_S)
        _flush_logs()
        os._exit(1)


def _flush_logs() -> None:
    for h in logging.getLogger().handlers:
        try:
            h.flush()
        except Exception:
            pass


def build_engine_core(config: Any, input_addr: str, output_addr: str,
                      max_outputs_ahead: int | None = None,
                      secure: Callable[[zmq.Socket], None] | None = None,
                      lost: Callable[[], BaseException | None] = lambda: None
                      ) -> tuple[Any, EngineCoreProc]:
    """Build the engine (the plugins are loaded again here: they are imported per process) and
    its loop, connected to the client's two sockets; ``secure`` configures each socket before
    it connects. On a failure the engine is shut down (with ``lost()``, the reason its client
    is gone, if it is) and the error raised."""
    from corellm.engine.core import EngineCore
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=config.plugins.disable)
    engine = None
    try:
        restrict_devices(config, registry)
        engine = EngineCore(config, registry)
        if engine.clock.is_virtual:
            from corellm.errors import ConfigError
            raise ConfigError([("executor", f"{config.executor.name!r} runs on a virtual clock, "
                                "which cannot serve requests arriving in real time from "
                                "another process; run it in-process (corellm bench, "
                                "LLM(engine_process=False)) or give it a real clock (the sim "
                                "executor: executor.clock: real)")])
        return engine, EngineCoreProc(engine, input_addr, output_addr, max_outputs_ahead,
                                      secure)
    except BaseException:
        if engine is not None:
            try:
                engine.shutdown(lost())
            except Exception:        # the start-up's own error is the one to report
                logger.exception("engine shutdown after a failed start-up failed too")
        raise


def restrict_devices(config: Any, registry: Any,
                     environ: MutableMapping[str, str] = os.environ) -> str | None:
    """``parallel.device_ids`` as the platform's visible-devices variable
    (``PlatformSpec.visible_devices_env``), set here before the device runtime starts, so that
    this process and the ranks it spawns see just those devices: indices into the devices this
    process sees now (the variable's current list, if set). Returns the value set, or None."""
    ids = config.parallel.device_ids
    var = registry.get("platform", config.platform.name).spec.visible_devices_env if ids else None
    if not var:
        return None
    seen = [d.strip() for d in environ.get(var, "").split(",") if d.strip()]
    if var in environ and max(ids) >= len(seen):
        from corellm.errors import ConfigError
        raise ConfigError([("parallel.device_ids", f"{ids}: this process sees {len(seen)} "
                            f"device(s) ({var}={environ[var]!r})")])
    value = ",".join(seen[i] for i in ids) if var in environ else ",".join(map(str, ids))
    environ[var] = value
    return value


def ready_info(engine: Any) -> dict[str, Any]:
    """What the core tells its client once its model is loaded (``ModelInfo``'s fields and
    its pid)."""
    mi = engine.model_info
    return {"vocab_size": mi.vocab_size, "max_model_len": mi.max_model_len,
            "architecture": mi.architecture, "lora_targets": mi.lora_targets,
            "pid": os.getpid()}


def serve_engine_core(engine: Any, proc: EngineCoreProc,
                      lost: Callable[[], BaseException | None] = lambda: None) -> int:
    """Run the loop until the client's SHUTDOWN (or a lost client: ``lost()`` then gives the
    error), then shut the engine down (its stop hooks see the error, if any) and close the
    sockets. A failed step is reported to the client (DEAD) first. Returns the exit status."""
    code = 0
    error: BaseException | None = None
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as exc:
        code, error = 1, exc
        logger.error("engine core failed: %s", "".join(traceback.format_exception(exc)))
        proc.send_dead(f"engine core step failed: {type(exc).__name__}: {exc}")
    finally:
        gone = lost()
        if gone is not None and error is None:
            code, error = 1, gone
        try:
            engine.shutdown(error)
        finally:
            proc.close()
    return code


def run_engine_core(config: Any, input_addr: str, output_addr: str,
                    ready: Connection, parent_pid: int, log_level: int,
                    ipc_dir: str | None = None, max_outputs_ahead: int | None = None) -> None:
    """Entry point of the engine-core process (started with the spawn method). ``ipc_dir``
    holds the two sockets; the core removes it if its parent dies (else the client does).
    ``max_outputs_ahead``: flow control, for a client that credits the batches it processed."""
    from corellm.engine.logs import configure_logging
    # The parent's level; the format from CORELLM_LOG_FORMAT, which the spawn inherits.
    configure_logging(level=log_level)
    # Ctrl-C in a terminal and systemd's KillMode=control-group signal the whole process group.
    # The client coordinates shutdown (a server drains its requests first, then sends SHUTDOWN),
    # so while it lives the core ignores both signals; when it dies the parent watch stops the
    # core. A core that must go at once is killed (SIGKILL), as the client itself does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.parallel.cpu_affinity:     # before any thread: they, and the workers, inherit it
        os.sched_setaffinity(0, config.parallel.cpu_affinity)
    watch = _ParentWatch(parent_pid, ipc_dir)
    watch.start()

    lost = lambda: watch.error() if watch.lost.is_set() else None  # noqa: E731
    try:
        engine, proc = build_engine_core(config, input_addr, output_addr, max_outputs_ahead,
                                         lost=lost)
    except BaseException as exc:
        try:
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:            # the parent is gone
            pass
        raise SystemExit(1) from None
    watch.attach(proc)
    try:
        ready.send(("ready", ready_info(engine)))
        ready.close()
    except OSError:                # the parent died while we loaded: the watch stops the loop
        pass
    code = serve_engine_core(engine, proc, lost)
    if watch.lost.is_set():
        # Stop hooks done, nobody to talk to: run the exit handlers and skip the interpreter's
        # teardown (most of a second with torch loaded).
        atexit._run_exitfuncs()
        _flush_logs()
        os._exit(1)
    raise SystemExit(code)
