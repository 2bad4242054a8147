"""Engine-core clients: how ``LLM`` and ``AsyncLLM`` reach an ``EngineCore``.

- ``InprocClient``: the core lives in the caller's process; ``get_output()`` runs one step.
- ``SyncMPClient`` / ``AsyncMPClient``: the core runs its busy loop in a child process
  (``corellm.engine.core_proc``); requests go in and outputs come back over ZeroMQ as msgpack.

The multiprocess clients watch the child: when it dies, every waiter gets ``EngineDeadError``
with the reason (exit code, or the core's last message) instead of hanging.

The two sockets live in a private IPC directory (``corellm-ipc-*`` in the temp dir). It is
removed whichever way the engine ends: by the client at shutdown or as soon as the process is
seen dead, or by the engine core itself when the client's process dies first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import wait
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from corellm.config import EngineConfig
from corellm.engine import ipc
from corellm.engine.core import EngineCore
from corellm.engine.ipc import EngineDeadError, EngineStartupError
from corellm.interfaces import ModelInfo
from corellm.outputs import EngineCoreOutputs, StepStats
from corellm.plugins import Registry
from corellm.request import EngineCoreRequest

logger = logging.getLogger(__name__)

# A send blocks only when the core stopped reading (its queue is full or it is gone).
SEND_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = float(os.environ.get("CORELLM_ENGINE_STARTUP_TIMEOUT", "600"))
# Default time a shutdown gives the core to finish its step, run its stop hooks and exit before
# it is killed (SIGKILL).
STOP_TIMEOUT_S = 10.0
# How long to wait for a killed process to be gone.
KILL_WAIT_S = 5.0


class EngineCoreClient(ABC):
    model_info: ModelInfo

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener`` in this process with every ``StepStats`` the engine produces."""
        self._stats_listeners.append(listener)

    _stats_listeners: list[Callable[[StepStats], None]]

    @abstractmethod
    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The core in this process: nothing crosses a process boundary."""

    def __init__(self, config: EngineConfig, registry: Registry) -> None:
        self.engine = EngineCore(config, registry)
        self.model_info = self.engine.model_info

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        self.engine.add_stats_listener(listener)

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for r in requests:
            self.engine.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        if not self.engine.has_unfinished_requests():
            return EngineCoreOutputs([], self.engine.clock.time())
        return EngineCoreOutputs(self.engine.step(), self.engine.clock.time())

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def shutdown(self) -> None:
        self.engine.shutdown()


# --------------------------------------------------------------------------- multiprocess
class _CoreProcess:
    """Starts the engine-core process, waits until it is ready, and stops it. Owns the IPC
    directory (``ipc_dir``) and removes it once the process is stopped or seen dead."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="corellm-ipc-", ignore_cleanup_errors=True)
        self.ipc_dir: str = self._dir.name
        self._dir_lock = threading.Lock()
        self._dir_removed = False
        self.input_addr = f"ipc://{self.ipc_dir}/input"
        self.output_addr = f"ipc://{self.ipc_dir}/output"
        self.ctx = zmq.Context()
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self.closing = False
        # kill() may come from another thread while start() is spawning (a cancelled start):
        # the lock orders the two, and start() gives up once killed.
        self._lock = threading.Lock()
        self._killed = False
        # Once the watch runs, every wait for the process's exit status goes through _reap,
        # under this lock: of two threads in waitpid at once, one reaps the process and the
        # other gets no status (ECHILD), and would report exit code None, until the first has
        # stored it.
        self._reap_lock = threading.Lock()

    def start(self, config: EngineConfig, max_outputs_ahead: int | None = None) -> ModelInfo:
        from corellm.engine.core_proc import run_engine_core

        mp = multiprocessing.get_context("spawn")   # never fork a process that may hold CUDA
        reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core, name="corellm-engine-core", daemon=True,
            args=(config, self.input_addr, self.output_addr, writer, os.getpid(),
                  logging.getLogger("corellm").getEffectiveLevel(), self.ipc_dir,
                  max_outputs_ahead))
        with self._lock:
            if self._killed:
                raise EngineStartupError("engine core start-up was cancelled")
            self.proc.start()
        writer.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not reader.poll(0.1):
            if self._killed:
                raise EngineStartupError("engine core start-up was cancelled")
            if not self.proc.is_alive():
                raise EngineStartupError(f"engine core process exited with code "
                                         f"{self.proc.exitcode} during start-up (see its log)")
            if time.monotonic() > deadline:
                self.kill()
                raise EngineStartupError(f"engine core not ready after {STARTUP_TIMEOUT_S:.0f} s "
                                         "(CORELLM_ENGINE_STARTUP_TIMEOUT)")
        try:
            status, payload = reader.recv()
        except EOFError:
            self.proc.join(5)
            raise EngineStartupError(f"engine core process exited with code "
                                     f"{self.proc.exitcode} during start-up") from None
        reader.close()
        if status != "ready":
            self.proc.join(10)
            raise EngineStartupError(f"engine core failed to start: {payload}")
        self.pid = payload.pop("pid")
        logger.info("engine core process started (pid %d)", self.pid)
        return ModelInfo(**payload)

    def watch(self, on_death: Any) -> None:
        """Call ``on_death(reason)`` from a thread if the process ends while not closing. The IPC
        directory is removed as soon as the process has ended, either way."""
        def wait_for_exit() -> None:
            assert self.proc is not None
            wait([self.proc.sentinel])          # without reaping it: that is _reap's, locked
            code = self._reap()
            self.remove_ipc_dir()
            if not self.closing:
                reason = self.dead_reason or (f"engine core process (pid {self.proc.pid}) exited "
                                              f"with code {code}")
                logger.error("%s", reason)
                on_death(reason)
        threading.Thread(target=wait_for_exit, daemon=True, name="corellm-core-watch").start()

    def running(self) -> bool:
        """Started and not yet exited (exited means its sentinel is ready, reaped or not)."""
        try:
            return self.proc is not None and not wait([self.proc.sentinel], 0)
        except ValueError:             # not started
            return False

    def _reap(self, timeout: float | None = None) -> int | None:
        """Reap the process, waiting up to ``timeout`` seconds; its exit code, or None while it
        runs. Whichever thread reaps it, the others then read the status it stored."""
        assert self.proc is not None
        with self._reap_lock:
            self.proc.join(timeout)
            return self.proc.exitcode

    def _wait_exit(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to exit, and reap it; True once it
        has exited."""
        assert self.proc is not None
        if not wait([self.proc.sentinel], max(0.0, timeout)):
            return False
        self._reap(1)
        return True

    def stop(self, send_shutdown: Callable[[float], None] | None,
             timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine core, bounded: ``send_shutdown(budget)`` asks it to stop (it must
        return or raise within ``budget`` seconds); the core finishes its step, runs its stop
        hooks and exits. If it has not within ``timeout`` seconds of the start of the call, it
        is killed (SIGKILL: the core ignores SIGTERM while it shuts down). Then the IPC
        directory is removed. Idempotent."""
        t0 = time.monotonic()
        self.closing = True
        if self.running():
            assert self.proc is not None
            pid = self.proc.pid
            if send_shutdown is not None and self.dead_reason is None:
                try:
                    send_shutdown(max(0.0, timeout))
                except Exception as exc:
                    logger.warning("could not send the shutdown request to the engine core "
                                   "process (pid %d): %s", pid, exc)
            if self._wait_exit(timeout - (time.monotonic() - t0)):
                logger.info("engine core process (pid %d) stopped (exit code %s) in %.1f s", pid,
                            self.proc.exitcode, time.monotonic() - t0)
            else:
                logger.warning("engine core process (pid %d) did not stop within %.1f s of the "
                               "shutdown request; killing it (SIGKILL)", pid, timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the process if it is running (a cancelled or failed start, or the end of a
        stop), wait for it, and remove the IPC directory. Idempotent, any thread."""
        with self._lock:
            self._killed = True
            if self.running():
                assert self.proc is not None
                self.proc.kill()
                if self._wait_exit(KILL_WAIT_S):
                    logger.warning("engine core process (pid %d) killed", self.proc.pid)
                else:
                    logger.error("engine core process (pid %d) still running %.0f s after "
                                 "SIGKILL", self.proc.pid, KILL_WAIT_S)
        self.remove_ipc_dir()

    def remove_ipc_dir(self) -> None:
        """Remove the IPC directory (its socket files with it). Idempotent and thread-safe: the
        first call removes it, later ones return at once (after it is gone)."""
        with self._dir_lock:
            if self._dir_removed:
                return
            self._dir_removed = True
            self._dir.cleanup()


class _MPClientBase(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.process = _CoreProcess()
        self._call_ids = itertools.count()
        self._stats_listeners = []

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def dead_reason(self) -> str | None:
        return self.process.dead_reason

    @property
    def ipc_dir(self) -> str:
        """The directory of the two IPC sockets (gone once the engine has stopped)."""
        return self.process.ipc_dir

    def _check_alive(self) -> None:
        if self.process.dead_reason is not None:
            raise EngineDeadError(self.process.dead_reason)

    def _note_dead(self, reason: str) -> None:
        if self.process.dead_reason is None:
            self.process.dead_reason = reason

    # Set by subclasses: a queue (queue.Queue or asyncio.Queue) and futures (concurrent or
    # asyncio); both offer put_nowait / done / set_result / set_exception.
    outputs: Any
    _calls: dict[int, tuple[Any, Any]]

    def _dispatch(self, kind: bytes, payload: bytes) -> None:
        """Route one message from the core (on the thread or loop that owns the futures)."""
        if kind == ipc.OUTPUTS:
            batch = ipc.outputs_decoder.decode(payload)
            for stats in batch.stats:
                for listener in self._stats_listeners:
                    try:
                        listener(stats)
                    except Exception:          # a broken listener must not stop the outputs
                        logger.exception("stats listener %r failed", listener)
            if batch.outputs or not batch.stats:
                self.outputs.put_nowait(batch)
        elif kind == ipc.UTILITY_RESULT:
            res = ipc.utility_result_decoder.decode(payload)
            fut, rtype = self._calls.pop(res.call_id, (None, None))
            if fut is not None and not fut.done():
                if res.error is not None:
                    fut.set_exception(RuntimeError(res.error))
                else:
                    fut.set_result(msgspec.msgpack.decode(res.result, type=rtype))
        elif kind == ipc.DEAD:
            # The core says its loop is over: fail waiters now, not when the process has
            # finished exiting.
            self._on_death(ipc.str_decoder.decode(payload))

    @abstractmethod
    def _on_death(self, reason: str) -> None:
        """Fail every waiter with EngineDeadError (idempotent)."""


class SyncMPClient(_MPClientBase):
    """Blocking client (the offline ``LLM`` with ``engine_process=True``)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ctx = self.process.ctx
        self._in = ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self._in.bind(self.process.input_addr)
        self._out = ctx.socket(zmq.PULL)
        self._out.bind(self.process.output_addr)
        try:
            self.model_info = self.process.start(config)
        except BaseException:
            self._close_sockets()
            self.process.kill()
            raise
        self.outputs = queue.Queue()
        self._calls = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name="corellm-client-output")
        self._reader.start()
        self.process.watch(self._on_death)

    def _read_loop(self) -> None:
        while not self.process.closing:
            if not self._out.poll(200):
                continue
            kind, payload = self._out.recv_multipart()
            try:
                self._dispatch(kind, payload)
            except Exception:
                logger.exception("dropping an undecodable %r message from the engine core", kind)

    def _on_death(self, reason: str) -> None:
        first = self.process.dead_reason is None
        self._note_dead(reason)
        if first or self.outputs.empty():
            self.outputs.put(EngineDeadError(self.process.dead_reason or reason))
        for fut, _ in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(EngineDeadError(self.process.dead_reason or reason))
        self._calls.clear()

    def _send(self, kind: bytes, obj: Any) -> None:
        self._check_alive()
        with self._lock:
            try:
                self._in.send_multipart((kind, ipc.encoder.encode(obj)))
            except zmq.Again:          # nobody reading for SEND_TIMEOUT_S: the core is gone
                raise EngineDeadError(self.process.dead_reason or "engine core stopped "
                                      "receiving requests") from None

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for r in requests:
            self._send(ipc.ADD, r)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.process.dead_reason is None:
            self._send(ipc.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        item = self.outputs.get()
        if isinstance(item, BaseException):
            self.outputs.put(item)           # every later call fails the same way
            raise item
        return item

    def call_utility(self, method: str, *args: Any, timeout: float | None = 60.0) -> Any:
        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (fut, ipc.UTILITY_RESULT_TYPES[method])
        try:
            self._send(ipc.UTILITY, ipc.UtilityCall(call_id, method, list(args)))
            return fut.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def _close_sockets(self) -> None:
        self._in.close(linger=0)
        self._out.close(linger=0)

    def _send_shutdown(self, budget: float) -> None:
        """Queue SHUTDOWN, waiting at most ``budget`` seconds for the core to take it."""
        if self.process.dead_reason is not None:
            raise EngineDeadError(self.process.dead_reason)
        with self._lock:
            if not self._in.poll(int(budget * 1000), zmq.POLLOUT):
                raise EngineDeadError(f"engine core not receiving for {budget:.1f} s")
            self._in.send_multipart((ipc.SHUTDOWN, ipc.encoder.encode(None)), flags=zmq.NOBLOCK)

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine core: it finishes its step, runs its stop hooks and exits; killed
        (SIGKILL) if it has not within ``timeout`` seconds. Idempotent."""
        if self.process.closing:
            return
        try:
            self.process.stop(self._send_shutdown, timeout)
        finally:
            self._reader.join(2)
            self._close_sockets()
            self.process.ctx.term()


class AsyncMPClient(_MPClientBase):
    """asyncio client (``AsyncLLM``). Create it with ``await AsyncMPClient.create(config)``
    inside the event loop that will use it.

    Flow control: the core steps only while fewer than ``MAX_OUTPUTS_AHEAD`` of the batches it
    sent are unprocessed here; ``outputs_processed()`` credits each one (the caller's output
    handler calls it once a batch is delivered). Two keep the pipeline full: the core computes
    the next step while this process handles the last."""

    MAX_OUTPUTS_AHEAD = 2

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.loop = asyncio.get_running_loop()
        actx = zmq.asyncio.Context.shadow(self.process.ctx)
        self._in = actx.socket(zmq.PUSH)
        self._in.bind(self.process.input_addr)
        self._out = actx.socket(zmq.PULL)
        self._out.bind(self.process.output_addr)
        self._calls = {}
        self.outputs = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._death = asyncio.Event()       # set when the core's death is noticed

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncMPClient:
        self = cls(config)
        try:
            # Loading the model takes a while: wait for it off the event loop.
            self.model_info = await asyncio.to_thread(self.process.start, config,
                                                      self.MAX_OUTPUTS_AHEAD)
        except BaseException:
            self._close_sockets()
            self.process.kill()
            raise
        self._reader = asyncio.create_task(self._read_loop(), name="corellm-client-output")
        self.process.watch(lambda reason: self.loop.call_soon_threadsafe(self._on_death, reason))
        return self

    async def _read_loop(self) -> None:
        while True:
            kind, payload = await self._out.recv_multipart()
            try:
                self._dispatch(kind, payload)
            except Exception:            # never let one bad message silence the engine
                logger.exception("dropping an undecodable %r message from the engine core", kind)
                if kind == ipc.OUTPUTS:  # nor hold it back waiting for this batch's credit
                    try:
                        await self._send(ipc.CREDIT, 1)
                    except EngineDeadError:
                        pass             # its death reaches the waiters another way

    def _on_death(self, reason: str) -> None:
        first = self.process.dead_reason is None
        self._note_dead(reason)
        err = EngineDeadError(self.process.dead_reason or reason)
        if first or self.outputs.empty():
            self.outputs.put_nowait(err)
        for fut, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._death.set()                   # and the sends blocked on a core that is gone

    async def _send(self, kind: bytes, obj: Any) -> None:
        self._check_alive()
        sent = self._in.send_multipart((kind, ipc.encoder.encode(obj)))
        if sent.done():                     # queued at once: the usual case
            sent.result()
            return
        # The core is not reading: its queue is full, or it died just now (a send that began
        # before the death was noticed). Wait for the send, the death or SEND_TIMEOUT_S,
        # whichever comes first, so that a death ends the wait at once.
        death = asyncio.ensure_future(self._death.wait())
        try:
            await asyncio.wait((sent, death), timeout=SEND_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            death.cancel()
        if sent.done():
            sent.result()
            return
        sent.cancel()
        raise EngineDeadError(self.process.dead_reason or "engine core stopped receiving "
                              "requests")

    async def add_requests_async(self, requests: Iterable[EngineCoreRequest]) -> None:
        for r in requests:
            await self._send(ipc.ADD, r)

    async def outputs_processed(self, batch: EngineCoreOutputs) -> None:
        """``batch`` (from ``get_output_async``) is handled: the core may step again."""
        if batch.outputs and self.process.dead_reason is None:
            await self._send(ipc.CREDIT, 1)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.process.dead_reason is None:
            await self._send(ipc.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        item = await self.outputs.get()
        if isinstance(item, BaseException):
            self.outputs.put_nowait(item)
            raise item
        return item

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout: float | None = 60.0) -> Any:
        """Call ``method`` in the core; ``timeout`` bounds the whole call, the send included
        (asyncio.TimeoutError past it)."""
        fut = self.loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (fut, ipc.UTILITY_RESULT_TYPES[method])

        async def call() -> Any:
            await self._send(ipc.UTILITY, ipc.UtilityCall(call_id, method, list(args)))
            return await fut
        try:
            return await asyncio.wait_for(call(), timeout)
        finally:
            self._calls.pop(call_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()     # failed by a death noticed while the send was blocked
            else:
                fut.cancel()

    # the synchronous interface, for symmetry (used from other threads only)
    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        asyncio.run_coroutine_threadsafe(self.add_requests_async(requests), self.loop).result()

    def abort_requests(self, request_ids: list[str]) -> None:
        asyncio.run_coroutine_threadsafe(self.abort_requests_async(request_ids),
                                         self.loop).result()

    def _close_sockets(self) -> None:
        self._in.close(linger=0)
        self._out.close(linger=0)

    def _send_shutdown(self, budget: float) -> None:
        """Queue SHUTDOWN from a worker thread (the event loop is free: shutdown_async awaits
        the thread), waiting at most ``budget`` seconds for the core to take it."""
        if self.process.dead_reason is not None:
            raise EngineDeadError(self.process.dead_reason)

        async def send() -> None:
            await self._in.send_multipart((ipc.SHUTDOWN, ipc.encoder.encode(None)))
        fut = asyncio.run_coroutine_threadsafe(send(), self.loop)
        try:
            fut.result(budget)
        except FutureTimeout:
            fut.cancel()
            raise EngineDeadError(f"engine core not receiving for {budget:.1f} s") from None

    async def shutdown_async(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine core: it finishes its step, runs its stop hooks and exits; killed
        (SIGKILL) if it has not within ``timeout`` seconds. Idempotent."""
        if self.process.closing:
            return
        self.process.closing = True       # a second call returns at once
        try:
            await asyncio.to_thread(self.process.stop, self._send_shutdown, timeout)
        finally:
            if self._reader is not None:
                self._reader.cancel()
            self._close_sockets()
            self.process.ctx.term()

    def shutdown(self) -> None:
        """Kill the engine core at once (no event loop needed); see ``shutdown_async``."""
        self.process.closing = True
        self.process.kill()
