"""The asyncio engine-core client (``AsyncLLM``'s): requests go to the engine-core process
and its output batches come back on the event loop, with flow control so the core never runs far
ahead of the process that delivers its outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import zmq
import zmq.asyncio

from corellm.config.compose import EngineConfig
from corellm.engine import ipc
from corellm.engine.core_client import _MPClientBase
from corellm.engine.core_process import SEND_TIMEOUT_S, STOP_TIMEOUT_S
from corellm.engine.ipc import EngineDeadError
from corellm.outputs import EngineCoreOutputs
from corellm.plugins.discovery import Registry
from corellm.request import EngineCoreRequest

logger = logging.getLogger("corellm.engine.core_client")


class AsyncMPClient(_MPClientBase):
    """asyncio client (``AsyncLLM``). Create it with ``await AsyncMPClient.create(config)``
    inside the event loop that will use it.

    Flow control: the core steps only while fewer than ``MAX_OUTPUTS_AHEAD`` of the batches it
    sent are unprocessed here; ``outputs_processed()`` credits each one (the caller's output
    handler calls it once a batch is delivered). Two keep the pipeline full: the core computes
    the next step while this process handles the last."""

    MAX_OUTPUTS_AHEAD = 2

    def __init__(self, config: EngineConfig, registry: Registry | None = None) -> None:
        super().__init__(config, registry)
        self.loop = asyncio.get_running_loop()
        actx = zmq.asyncio.Context.shadow(self.process.ctx)
        self._in = actx.socket(zmq.PUSH)
        self._out = actx.socket(zmq.PULL)
        self._calls = {}
        self.outputs = asyncio.Queue()
        self._reader: asyncio.Task | None = None
        self._death = asyncio.Event()       # set when the core's death is noticed

    @classmethod
    async def create(cls, config: EngineConfig, registry: Registry | None = None
                     ) -> AsyncMPClient:
        self = cls(config, registry)
        try:
            self.process.bind(self._in, "input")
            self.process.bind(self._out, "output")
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
            self.process.kill()       # done already, unless the stop was interrupted
            if self._reader is not None:
                self._reader.cancel()
            self._close_sockets()
            self.process.ctx.term()

    def shutdown(self) -> None:
        """Kill the engine core at once (no event loop needed); see ``shutdown_async``."""
        self.process.closing = True
        self.process.kill()
