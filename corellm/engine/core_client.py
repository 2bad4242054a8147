"""Engine-core clients: how ``LLM`` and ``AsyncLLM`` reach an ``EngineCore``.

- ``InprocClient``: the core lives in the caller's process; ``get_output()`` runs one step.
- ``SyncMPClient`` / ``AsyncMPClient``: the core runs its busy loop in a child process
  (``corellm.engine.core_proc``); requests go in and outputs come back over ZeroMQ as msgpack.

The multiprocess clients watch the child: when it dies, every waiter gets ``EngineDeadError``
with the reason (exit code, or the core's last message) instead of hanging.
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
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from corellm.config import EngineConfig
from corellm.engine import ipc
from corellm.engine.core import EngineCore
from corellm.engine.ipc import EngineDeadError, EngineStartupError
from corellm.interfaces import ModelInfo
from corellm.outputs import EngineCoreOutputs
from corellm.plugins import Registry
from corellm.request import EngineCoreRequest

logger = logging.getLogger(__name__)

# A send blocks only when the core stopped reading (its queue is full or it is gone).
SEND_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = float(os.environ.get("CORELLM_ENGINE_STARTUP_TIMEOUT", "600"))


class EngineCoreClient(ABC):
    model_info: ModelInfo

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

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        for r in requests:
            self.engine.add_request(r)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        if not self.engine.has_unfinished_requests():
            return EngineCoreOutputs([], time.time())
        return EngineCoreOutputs(self.engine.step(), time.time())

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def shutdown(self) -> None:
        self.engine.shutdown()


# --------------------------------------------------------------------------- multiprocess
class _CoreProcess:
    """Starts the engine-core process, waits until it is ready, and stops it."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="corellm-ipc-")
        self.input_addr = f"ipc://{self._dir.name}/input"
        self.output_addr = f"ipc://{self._dir.name}/output"
        self.ctx = zmq.Context()
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None
        self.closing = False
        # kill() may come from another thread while start() is spawning (a cancelled start):
        # the lock orders the two, and start() gives up once killed.
        self._lock = threading.Lock()
        self._killed = False

    def start(self, config: EngineConfig) -> ModelInfo:
        from corellm.engine.core_proc import run_engine_core

        mp = multiprocessing.get_context("spawn")   # never fork a process that may hold CUDA
        reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(
            target=run_engine_core, name="corellm-engine-core", daemon=True,
            args=(config.to_dict(), self.input_addr, self.output_addr, writer, os.getpid(),
                  logging.getLogger("corellm").getEffectiveLevel()))
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
        """Call ``on_death(reason)`` from a thread if the process ends while not closing."""
        def wait() -> None:
            assert self.proc is not None
            self.proc.join()
            if not self.closing:
                reason = self.dead_reason or (f"engine core process (pid {self.proc.pid}) exited "
                                              f"with code {self.proc.exitcode}")
                logger.error("%s", reason)
                on_death(reason)
        threading.Thread(target=wait, daemon=True, name="corellm-core-watch").start()

    def stop(self, send_shutdown: Any, timeout: float = 10.0) -> None:
        self.closing = True
        if self.proc is None:
            return
        if self.proc.is_alive():
            try:
                send_shutdown()
            except Exception:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("engine core did not stop within %.0f s; terminating it", timeout)
            self.proc.terminate()
            self.proc.join(5)
        self.kill()

    def kill(self) -> None:
        with self._lock:
            self._killed = True
            if self.proc is not None and self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        self._dir.cleanup()


class _MPClientBase(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.process = _CoreProcess()
        self._call_ids = itertools.count()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def dead_reason(self) -> str | None:
        return self.process.dead_reason

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
            self.outputs.put_nowait(ipc.outputs_decoder.decode(payload))
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

    def shutdown(self) -> None:
        if self.process.closing:
            return
        self.process.stop(lambda: self._send(ipc.SHUTDOWN, None))
        self._reader.join(2)
        self._close_sockets()
        self.process.ctx.term()


class AsyncMPClient(_MPClientBase):
    """asyncio client (``AsyncLLM``). Create it with ``await AsyncMPClient.create(config)``
    inside the event loop that will use it."""

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

    @classmethod
    async def create(cls, config: EngineConfig) -> AsyncMPClient:
        self = cls(config)
        try:
            # Loading the model takes a while: wait for it off the event loop.
            self.model_info = await asyncio.to_thread(self.process.start, config)
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

    async def _send(self, kind: bytes, obj: Any) -> None:
        self._check_alive()
        try:
            await asyncio.wait_for(self._in.send_multipart((kind, ipc.encoder.encode(obj))),
                                   SEND_TIMEOUT_S)
        except (asyncio.TimeoutError, TimeoutError):
            raise EngineDeadError(self.process.dead_reason or "engine core stopped receiving "
                                  "requests") from None

    async def add_requests_async(self, requests: Iterable[EngineCoreRequest]) -> None:
        for r in requests:
            await self._send(ipc.ADD, r)

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
        fut = self.loop.create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (fut, ipc.UTILITY_RESULT_TYPES[method])
        try:
            await self._send(ipc.UTILITY, ipc.UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    # the synchronous interface, for symmetry (used from other threads only)
    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        asyncio.run_coroutine_threadsafe(self.add_requests_async(requests), self.loop).result()

    def abort_requests(self, request_ids: list[str]) -> None:
        asyncio.run_coroutine_threadsafe(self.abort_requests_async(request_ids),
                                         self.loop).result()

    def _close_sockets(self) -> None:
        self._in.close(linger=0)
        self._out.close(linger=0)

    async def shutdown_async(self) -> None:
        if self.process.closing:
            return
        try:
            if self.process.proc is not None and self.process.proc.is_alive() \
                    and self.process.dead_reason is None:
                await self._send(ipc.SHUTDOWN, None)
        except Exception:
            pass
        try:
            await asyncio.to_thread(self.process.stop, lambda: None)
        finally:
            if self._reader is not None:
                self._reader.cancel()
            self._close_sockets()
            self.process.ctx.term()

    def shutdown(self) -> None:
        self.process.closing = True
        self.process.kill()
