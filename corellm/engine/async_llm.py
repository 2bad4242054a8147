"""The asyncio engine client: what a server holds. The engine core runs in its own process
(``AsyncMPClient``); detokenization and stop strings happen here, in the caller's event loop,
through the same ``Processor`` and ``OutputProcessor`` as the offline ``LLM``. Each batch of
outputs is processed in slices of at most ``OUTPUT_SLICE_S`` seconds, yielding to the loop in
between, so a huge batch delays other tasks (``/health``, other streams) by one slice, never by
the whole batch.

    engine = await AsyncLLM.create("cfg.yaml")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text, end="")          # deltas
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from corellm.config.compose import EngineConfig
from corellm.engine.async_client import AsyncMPClient
from corellm.engine.ipc import EngineDeadError
from corellm.engine.llm import build_config, load_tokenizer
from corellm.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState
from corellm.engine.processor import Processor, PromptType
from corellm.config.logits_processors import RequestChecker
from corellm.checkpoint.reader import load_generation_eos_ids, model_path
from corellm.lora.request import LoRARequest
from corellm.outputs import EngineStats, RequestOutput, StepStats
from corellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called with the requests that ended in one batch of outputs (e.g. to observe latency
# histograms), including aborted ones (their unfinished samples have finish_reason "abort" and
# the state's ``abort_reason`` says why). Runs on the event loop: keep it cheap.
FinishedCallback = Callable[[list[RequestState]], None]

# Longest stretch the output handler runs before yielding to the event loop.
OUTPUT_SLICE_S = 0.005


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: AsyncMPClient, tokenizer: Any,
                 processor: Processor) -> None:
        self.config = config
        self.client = client
        self.tokenizer = tokenizer
        self.processor = processor
        self.model_info = client.model_info
        self.output_processor = OutputProcessor(tokenizer)
        self.finished_callbacks: list[FinishedCallback] = []
        self.dead_error: EngineDeadError | None = None
        self._death: asyncio.Future[EngineDeadError] = asyncio.get_running_loop().create_future()
        self._rejecting: BaseException | None = None     # set by abort_all: no new requests
        self._ids = itertools.count()
        self._latest_stats: StepStats | None = None
        client.add_stats_listener(self._keep_latest_stats)
        self._handler = asyncio.create_task(self._output_handler(), name="corellm-outputs")

    @classmethod
    async def create(cls, config: EngineConfig | Mapping[str, Any] | str | Path | None = None,
                     *, model: str | None = None) -> AsyncLLM:
        """Validate the config, start the engine-core process and wait until it is ready."""
        config, registry = build_config(config, model, ())
        path = model_path(config)
        # The engine process starts (imports torch, loads the model) while this process loads
        # the tokenizer: on two cores, the two overlap.
        starting = asyncio.ensure_future(AsyncMPClient.create(config, registry))
        try:
            tokenizer = await asyncio.to_thread(
                load_tokenizer, config.model.tokenizer or path,
                "model.tokenizer" if config.model.tokenizer else "model.path")
        except BaseException:
            starting.cancel()                  # kills the engine process it was starting
            with contextlib.suppress(BaseException):
                await starting
            raise
        client = await starting
        try:
            processor = Processor(tokenizer, client.model_info, load_generation_eos_ids(path),
                                  RequestChecker.for_config(config, registry),
                                  max_lora_rank=config.lora.max_lora_rank)
            return cls(config, client, tokenizer, processor)
        except BaseException:
            await client.shutdown_async()
            raise

    @property
    def engine_pid(self) -> int:
        return self.client.pid

    @property
    def where(self) -> str:
        """Where the engine core runs, in words: its pid, and a launcher's place for it."""
        return self.client.process.where

    @property
    def is_dead(self) -> bool:
        return (self.dead_error is not None or self.client.dead_reason is not None
                or self._handler.done())

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       user: str | None = None, session_id: str | None = None,
                       group_id: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       lora_request: LoRARequest | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Submit one request and iterate over its outputs (deltas by default).

        Raises ``InvalidRequestError`` (before anything is scheduled) for bad input and
        ``EngineDeadError`` if the engine process dies. Closing or cancelling the iterator
        early (a client that went away) aborts the request, freeing its KV blocks.
        """
        stream = await self.add_request(prompt, sampling_params, request_id, priority=priority,
                                        user=user, session_id=session_id,
                                        group_id=group_id, output_kind=output_kind,
                                        lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_request(self, prompt: PromptType, sampling_params: SamplingParams,
                          request_id: str | None = None, *, priority: int = 0,
                          user: str | None = None, session_id: str | None = None,
                          group_id: str | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                          params_checked: bool = False,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and submit a request now; return the iterator of its outputs. A server uses
        this to answer bad input with an error status before it starts a streaming response.
        Requests given the same ``group_id`` (the prompts of one client call) share that call's
        seats in the batch (``scheduler.max_num_seqs_per_request``); the ``n`` samples of one
        request always do. ``params_checked``: the caller has had the logits processors check
        ``sampling_params`` (``processor.checker``) already, as the server does in its check
        processes; they are not checked again here, on the event loop."""
        if self.is_dead:
            raise self.dead_error or EngineDeadError(self.client.dead_reason or "engine is dead")
        if self._rejecting is not None:
            raise self._rejecting
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        text, core_request = self.processor.process(rid, prompt, sampling_params, priority,
                                                    user=user, session_id=session_id,
                                                    group_id=group_id,
                                                    params_checked=params_checked,
                                                    lora_request=lora_request)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        state = self.output_processor.add_request(rid, text, core_request, output_kind, queue)
        try:
            await self.client.add_requests_async(state.core_requests)
        except BaseException:
            self.abort(rid)
            raise
        return RequestStream(self, rid, queue)

    def abort(self, request_id: str, reason: str = "cancelled") -> None:
        """Abort a request (no-op if it already finished): free its engine-core requests, log it
        and report it to the finished callbacks with ``reason`` (e.g. ``client_disconnected``).
        Safe to call from cleanup code: it never awaits."""
        self._abort([request_id], reason)

    def abort_all(self, error: BaseException, reason: str) -> int:
        """End every request in flight (each stream raises ``error``) and refuse new ones with
        ``error`` from now on (a server shutting down); returns how many were ended."""
        self._rejecting = error
        states = list(self.output_processor.requests.values())
        for state in states:
            if state.queue is not None:
                state.queue.put_nowait(error)
        self._abort([s.request_id for s in states], reason)
        return len(states)

    def _abort(self, request_ids: list[str], reason: str) -> None:
        op = self.output_processor
        states = [op.requests[r] for r in request_ids if r in op.requests]
        child_ids = op.abort_requests(request_ids)
        if not states:
            return
        now = time.time()
        for state in states:
            state.abort(reason, now)
            logger.info("request %s aborted (%s) after %d generated tokens", state.request_id,
                        reason, state.metrics.num_generation_tokens)
        self._report_finished(states)
        if child_ids and not self.is_dead:
            task = asyncio.get_running_loop().create_task(
                self.client.abort_requests_async(child_ids))
            task.add_done_callback(_log_failure)

    def _report_finished(self, states: list[RequestState]) -> None:
        for callback in self.finished_callbacks:
            try:
                callback(states)
            except Exception:
                logger.exception("finished-request callback failed")

    async def _output_handler(self) -> None:
        op = self.output_processor
        try:
            while True:
                batch = await self.client.get_output_async()
                outputs, start, now = batch.outputs, 0, time.time()
                while start < len(outputs):
                    # A slice: as many outputs as fit in OUTPUT_SLICE_S (one at least), then
                    # let the loop run (/health, other streams, new requests).
                    done, start = op.process_outputs_for(outputs, start, OUTPUT_SLICE_S, now)
                    if done.reqs_to_abort:
                        await self.client.abort_requests_async(done.reqs_to_abort)
                    if done.finished:
                        self._report_finished(done.finished)
                    if start < len(outputs):
                        await asyncio.sleep(0)
                await self.client.outputs_processed(batch)
        except EngineDeadError as exc:
            self._fail_all(exc)
            if not self._death.done():
                self._death.set_result(exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # Nothing would deliver outputs any more: fail loudly rather than hang everyone.
            logger.exception("output handler failed")
            err = EngineDeadError(f"output handler failed: {exc!r}")
            self._fail_all(err)
            if not self._death.done():
                self._death.set_result(err)
            raise

    def _fail_all(self, exc: EngineDeadError) -> None:
        self.dead_error = self.dead_error or exc
        op = self.output_processor
        for state in list(op.requests.values()):
            if state.queue is not None:
                state.queue.put_nowait(exc)
        op.abort_requests(list(op.requests))

    async def wait_dead(self) -> EngineDeadError:
        """Return (with the reason) once the engine core has died; never after a shutdown."""
        return await asyncio.shield(self._death)

    # ------------------------------------------------------------------ observability
    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener`` with every ``StepStats`` the engine core produces: one per step
        that scheduled work (``kind="step"``) and one per abort or prefix-cache reset between
        steps (``kind="event"``), each carrying a full snapshot of the scheduler and KV pool.
        The same records a ``corellm_step_finished`` plugin sees in the engine's process.

        Listeners run on this engine's event loop (the client's output reader task), in the
        order the core produced the records, before the outputs that came with them are
        processed: keep them cheap and never block. One that raises is logged and skipped;
        the outputs still flow. Records produced before a listener was added are not replayed
        (``latest_stats`` has the last one)."""
        self.client.add_stats_listener(listener)

    @property
    def latest_stats(self) -> StepStats | None:
        """The last ``StepStats`` received from the engine core, or None before the first
        (a fresh engine that has not stepped yet: ask ``get_stats()`` for that state).
        Its ``scheduler`` snapshot describes the engine as of its last change: every step,
        abort and prefix-cache reset sends a new record (a request just added shows in the
        record of the step that follows, at once on a running engine)."""
        return self._latest_stats

    def _keep_latest_stats(self, stats: StepStats) -> None:
        self._latest_stats = stats

    # ------------------------------------------------------------------ engine utilities
    async def check_health(self, timeout: float = 5.0) -> None:
        """Raise unless the engine process is alive and its loop answers within ``timeout``."""
        if self.is_dead:
            raise self.dead_error or EngineDeadError(self.client.dead_reason or "engine is dead")
        await self.client.call_utility_async("ping", timeout=timeout)

    async def get_stats(self, timeout: float = 10.0) -> EngineStats:
        return await self.client.call_utility_async("get_stats", timeout=timeout)

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine core: it finishes its step, runs its stop hooks and exits; killed
        if it has not within ``timeout`` seconds."""
        self._handler.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        await self.client.shutdown_async(timeout=timeout)


class RequestStream:
    """The outputs of one request, as an async iterator. ``close()`` (or cancelling a pending
    ``__anext__``) before the last output aborts the request in the engine core."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False
        # Set by an EngineGroup: the A/B arm and the replica serving the request.
        self.arm: str | None = None
        self.replica: int | None = None
        # Why the request is aborted if its waiter is cancelled (a server sets
        # "client_disconnected": its handlers are cancelled when the client goes away).
        self.cancel_reason = "cancelled"

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:            # cancelled: whoever waited is gone
            self.close(self.cancel_reason)
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self, reason: str = "cancelled") -> None:
        """Abort the request unless it has ended; ``reason`` is logged and counted."""
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id, reason)

    async def aclose(self) -> None:
        self.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None \
            and not isinstance(task.exception(), EngineDeadError):
        logger.error("abort failed: %r", task.exception())


__all__ = ["AsyncLLM", "RequestOutputKind"]
