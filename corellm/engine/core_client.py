"""Engine-core clients: how ``LLM`` and ``AsyncLLM`` reach an ``EngineCore``.

- ``InprocClient``: the core lives in the caller's process; ``get_output()`` runs one step.
- ``SyncMPClient`` / ``AsyncMPClient`` (``corellm.engine.async_client``): the core runs its busy
  loop in a child process (``corellm.engine.core_proc``, started and stopped by
  ``corellm.engine.core_process``); requests go in and outputs come back over ZeroMQ as msgpack.

The multiprocess clients watch the child: when it dies, every waiter gets ``EngineDeadError``
with the reason (exit code, or the core's last message) instead of hanging.

The two sockets live in a private IPC directory (``corellm-ipc-*`` in the temp dir). It is
removed whichever way the engine ends: by the client at shutdown or as soon as the process is
seen dead, or by the engine core itself when the client's process dies first.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from corellm.config import EngineConfig
from corellm.engine import ipc
from corellm.engine.core import EngineCore
from corellm.engine.core_process import SEND_TIMEOUT_S, STOP_TIMEOUT_S, _CoreProcess
from corellm.engine.ipc import EngineDeadError
from corellm.interfaces import ModelInfo
from corellm.outputs import EngineCoreOutputs, StepStats
from corellm.plugins import Registry
from corellm.request import EngineCoreRequest

logger = logging.getLogger(__name__)


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
