"""Engine-core clients: how ``LLM`` and ``AsyncLLM`` reach an ``EngineCore``.

- ``InprocClient``: the core lives in the caller's process; ``get_output()`` runs one step.
- ``ThreadedInprocClient``: the core lives in the caller's process and a thread of its own (the
  "core thread") steps it while a run is on (``stepping()``), so that the caller processes one
  step's outputs (detokenization, stop strings) while the next step runs.
- ``SyncMPClient`` / ``AsyncMPClient`` (``corellm.engine.async_client``): the core runs its busy
  loop apart (``corellm.engine.core_proc``), in a child process or where the ``core_launcher``
  puts it (``corellm.engine.core_process``); requests and outputs go over ZeroMQ as msgpack.
  When the core dies, every waiter gets ``EngineDeadError`` with the reason instead of
  hanging. A child's sockets live in a private directory, removed however the engine ends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from corellm.config.compose import EngineConfig
from corellm.engine import ipc
from corellm.engine.core import EngineCore
from corellm.engine.core_process import SEND_TIMEOUT_S, STOP_TIMEOUT_S, core_launcher
from corellm.engine.ipc import EngineDeadError
from corellm.interfaces import ModelInfo
from corellm.outputs import EngineCoreOutputs, StepStats
from corellm.plugins.discovery import Registry
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

    def stepping(self) -> contextlib.AbstractContextManager[None]:
        """Around a caller's loop of ``get_output()`` calls (``LLM._run``): a client whose
        engine steps on its own while the caller processes outputs starts that here, and stops
        it on the way out, when every abort sent inside has been applied."""
        return contextlib.nullcontext()

    def ran_dry(self, batch: EngineCoreOutputs) -> bool:
        """Whether ``batch`` (from ``get_output()``) says the engine has nothing left to step:
        a caller still waiting for a request then never gets it. False where it cannot tell."""
        return False


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

    def ran_dry(self, batch: EngineCoreOutputs) -> bool:
        return not batch.outputs and not self.engine.has_unfinished_requests()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine, method)(*args)

    def shutdown(self) -> None:
        self.engine.shutdown()


# Commands to the core thread.
_ADD, _ABORT, _CALL, _CREDIT, _RUN, _PAUSE, _STOP = range(7)


@dataclass(slots=True)
class _Failed:
    """Sent by the core thread instead of a batch when a step (or an abort) raised."""
    error: BaseException
    stats: list[StepStats]


@dataclass(slots=True)
class _Dry:
    """Sent once the engine has nothing left to step (see ``ran_dry``)."""
    timestamp: float
    stats: list[StepStats]


@dataclass(slots=True)
class _RunState:
    """The core thread's own state (no other thread touches it)."""
    stepping: bool = False  # a run is on
    ahead: int = 0          # batches sent and not yet credited
    dry: bool = False       # _Dry sent, and nothing stepped since


class ThreadedInprocClient(InprocClient):
    """The core in this process, stepped by a thread of its own (the *core thread*) while a
    run is on, so that the caller's output processing overlaps the next step.

    Inside ``stepping()`` (``LLM._run``'s loop) the engine is the core thread's: it steps while
    anything is unfinished and queues each step's outputs for ``get_output()``. Aborts (stop
    strings) reach it through a command queue without waiting and apply before its next step;
    ``add_requests`` and ``call_utility`` run there too, between steps, and return or raise.
    At most ``max_batches_ahead`` batches are unprocessed (a batch counts until the caller asks
    for the next): with 2, as ``AsyncMPClient.MAX_OUTPUTS_AHEAD``, step k+1 runs while the
    caller processes step k, and a stop string found in step k is aborted before step k+2
    (serially: k+1), one token of compute per stop string and nothing of the output.

    Between runs the thread waits and the engine is the caller's: ``llm.engine`` may be used
    and stepped directly (``drive_engine``, tests), and every method here is
    ``InprocClient``'s. The thread starts with the first run; ``shutdown()`` joins it.

    Stats made on the core thread reach ``add_stats_listener``'s listeners in the caller's
    thread before the batch they came with is returned (serially, listeners run inside
    ``step()``), or at the end of the run; between runs, at once: every one, in order. (The
    ``corellm_step_finished`` hook runs where the step runs.) A step's exception
    (``ExecutorError``, ``PluginError``, a policy's error...) is raised again, the same object,
    by the caller's next ``get_output()``, once the engine has ended what it touched, as
    serially. A ``KeyboardInterrupt`` in the caller propagates at once, and ``stepping()``
    returns only when the thread has applied the aborts sent and stopped (a step at most).
    """

    MAX_BATCHES_AHEAD = 2

    def __init__(self, config: EngineConfig, registry: Registry,
                 max_batches_ahead: int = MAX_BATCHES_AHEAD) -> None:
        if max_batches_ahead < 1:
            raise ValueError(f"max_batches_ahead must be >= 1, got {max_batches_ahead}")
        super().__init__(config, registry)
        self.max_batches_ahead = max_batches_ahead
        self._cmds: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._outs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None     # the core thread, from the first run
        self._running = False        # inside stepping(): the engine is the core thread's
        self._owe_credit = False     # a batch was handed out and is not yet credited
        self._dry: EngineCoreOutputs | None = None
        self._failed: BaseException | None = None   # a step of this run raised it
        self._listeners: list[Callable[[StepStats], None]] = []
        self._thread_stats: list[StepStats] = []    # made on the core thread, not yet sent
        self._closed = False

    # ------------------------------------------------------------------ on the core thread
    def _start_thread(self) -> None:
        self.thread = threading.Thread(target=_core_thread_main,
                                        args=(weakref.ref(self), self._cmds),
                                        daemon=True, name="corellm-core")
        self.thread.start()
        # A client dropped without shutdown(): its thread leaves once it is collected.
        weakref.finalize(self, self._cmds.put, (_STOP, None))

    def _apply(self, kind: int, arg: Any, state: _RunState) -> bool:
        """Apply one command; False for _STOP."""
        if kind == _CREDIT:
            state.ahead -= 1
        elif kind == _ABORT:
            try:
                self.engine.abort_requests(arg)
            except BaseException as exc:        # noqa: B036 - the caller's to raise
                state.stepping = False
                self._outs.put(_Failed(exc, self._take_stats()))
        elif kind == _ADD or kind == _CALL:
            fn, fut = arg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:    # noqa: B036 - the caller's to raise
                    fut.set_exception(exc)
        elif kind == _RUN:
            state.stepping, state.ahead, state.dry = True, 0, False
        elif kind == _PAUSE:
            state.stepping = False
            arg.set_result(self._take_stats())
        elif kind == _STOP:
            return False
        return True

    def _due(self, state: _RunState) -> bool:
        """A step (or the news that there is none to take) is due."""
        return state.stepping and state.ahead < self.max_batches_ahead and (
            not state.dry or self.engine.has_unfinished_requests())

    def _step(self, state: _RunState) -> None:
        """One step's outputs, or _Dry, onto the output queue."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            state.dry = True
            state.ahead += 1
            self._outs.put(_Dry(engine.clock.time(), self._take_stats()))
            return
        state.dry = False
        try:
            outputs = engine.step()
        except BaseException as exc:            # noqa: B036 - the caller's to raise
            state.stepping = False
            self._outs.put(_Failed(exc, self._take_stats()))
            return
        state.ahead += 1
        self._outs.put(EngineCoreOutputs(outputs, engine.clock.time(), self._take_stats()))

    def _take_stats(self) -> list[StepStats]:
        stats, self._thread_stats = self._thread_stats, []
        return stats

    def _on_stats(self, stats: StepStats) -> None:
        """The engine's listener: on the core thread, keep the record for the caller; in the
        caller's thread (between runs), deliver it now."""
        if threading.current_thread() is self.thread:
            self._thread_stats.append(stats)
        else:
            self._deliver([stats])

    # ------------------------------------------------------------------ the caller's side
    def _deliver(self, stats: list[StepStats]) -> None:
        for s in stats:
            for listener in self._listeners:
                listener(s)

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        if not self._listeners:
            self.engine.add_stats_listener(self._on_stats)
        self._listeners.append(listener)

    def _on_core_thread(self, kind: int, fn: Callable[[EngineCore], Any]) -> Any:
        """``fn(engine)`` run on the core thread between two steps: its result, or its error."""
        fut: Future = Future()
        self._cmds.put((kind, (fn, fut)))
        while True:
            try:
                return fut.result(1.0)
            except TimeoutError:
                self._check_thread()

    def _check_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            raise RuntimeError("the engine's core thread has stopped")

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        if self._closed:
            raise RuntimeError("this engine is shut down")
        if not self._running:
            return super().add_requests(requests)
        requests = list(requests)

        def add(engine: EngineCore) -> None:
            for r in requests:
                engine.add_request(r)
        self._on_core_thread(_ADD, add)

    def abort_requests(self, request_ids: list[str]) -> None:
        if not self._running:
            return super().abort_requests(request_ids)
        if request_ids:
            self._cmds.put((_ABORT, list(request_ids)))     # applied before the next step

    def call_utility(self, method: str, *args: Any) -> Any:
        if not self._running:
            return super().call_utility(method, *args)
        return self._on_core_thread(_CALL, lambda engine: getattr(engine, method)(*args))

    def get_output(self) -> EngineCoreOutputs:
        if not self._running:
            return super().get_output()         # outside a run: one step, in this thread
        if self._failed is not None:
            raise self._failed
        if self._owe_credit:
            self._owe_credit = False
            self._cmds.put((_CREDIT, None))     # the last batch is processed
        while True:
            try:
                item = self._outs.get(timeout=1.0)
                break
            except queue.Empty:
                self._check_thread()
        if item.stats:
            stats, item.stats = item.stats, []
            self._deliver(stats)
        if isinstance(item, _Failed):
            self._failed = item.error            # the thread steps no more in this run
            raise item.error
        self._owe_credit = True
        if isinstance(item, _Dry):
            self._dry = EngineCoreOutputs([], item.timestamp)
            return self._dry
        return item

    def ran_dry(self, batch: EngineCoreOutputs) -> bool:
        if not self._running:
            return super().ran_dry(batch)
        return batch is self._dry

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        if self._closed:
            raise RuntimeError("this engine is shut down")
        if self._running:
            raise RuntimeError("a run is already on: LLM.generate is not reentrant (called "
                               "from a stats listener, or from two threads at once?)")
        if self.thread is None:
            self._start_thread()
        else:
            self._check_thread()
        self._owe_credit = False
        self._dry = None
        self._failed = None
        self._cmds.put((_RUN, None))
        self._running = True
        try:
            yield
        except BaseException:
            self._end_run(failing=True)
            raise
        self._end_run(failing=False)

    def _end_run(self, failing: bool) -> None:
        """Stop the thread stepping and wait until it has, every command sent before applied;
        then drop the batches the caller did not take, delivering their stats. A
        KeyboardInterrupt meanwhile waits for that too (a step at most), then is raised."""
        ack: Future = Future()
        self._cmds.put((_PAUSE, ack))
        interrupted: KeyboardInterrupt | None = None
        stats: list[StepStats] = []
        while True:
            try:
                stats = ack.result(1.0)
                break
            except TimeoutError:
                if self.thread is None or not self.thread.is_alive():
                    break
            except KeyboardInterrupt as exc:
                interrupted = interrupted or exc
        self._running = False
        self._owe_credit = False
        self._dry = None
        self._failed = None
        while True:             # what the thread sent before it paused
            try:
                item = self._outs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Failed) and not failing:
                # After the caller had what it waited for: a step it ran ahead (of requests
                # nobody waits for) or an abort failed. The engine ended what it touched.
                logger.warning("the engine's core thread, ahead of the caller: %r", item.error,
                               exc_info=item.error)
            if item.stats:
                self._deliver(item.stats)
        self._deliver(stats)
        if interrupted is not None and not failing:
            raise interrupted

    def shutdown(self) -> None:
        """Stop and join the core thread, then shut the engine down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self.thread
        if thread is not None:
            self._cmds.put((_STOP, None))
            if thread is not threading.current_thread():
                thread.join()
        super().shutdown()


def _core_thread_main(ref: weakref.ref, cmds: queue.SimpleQueue) -> None:
    """The core thread: apply commands; step while a run is on. It holds its client only while
    it works, so a client nobody refers to can be collected while the thread waits (its
    finalizer sends _STOP)."""
    state = _RunState()
    due = False
    while True:
        if due:
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                cmd = None
        else:
            cmd = cmds.get()
        client = ref()
        if client is None:
            return
        while cmd is not None:
            if not client._apply(*cmd, state):
                return
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if client._due(state):
            client._step(state)
        due = client._due(state)
        del client


class _MPClientBase(EngineCoreClient):
    """A client of an engine core run apart, where ``core_launcher`` says (``self.process``)."""

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        self.process = core_launcher(config, registry)
        self._call_ids = itertools.count()
        self._stats_listeners = []

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def dead_reason(self) -> str | None:
        return self.process.dead_reason

    @property
    def ipc_dir(self) -> str | None:
        """The IPC sockets' directory (gone once the engine stopped; None: not an mp core)."""
        return getattr(self.process, "ipc_dir", None)

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

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        super().__init__(config, registry)
        ctx = self.process.ctx
        self._in = ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self._out = ctx.socket(zmq.PULL)
        try:
            self.process.bind(self._in, "input")
            self.process.bind(self._out, "output")
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
            self.process.kill()       # done already, unless the stop was interrupted
            self._reader.join(2)
            self._close_sockets()
            self.process.ctx.term()
