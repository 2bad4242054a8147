"""The asyncio engine client: what a server holds. The engine core runs in its own process
(``AsyncMPClient``); tokenization, detokenization and stop strings happen here, in the caller's
event loop, through the same ``Processor`` and ``OutputProcessor`` as the offline ``LLM``.

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
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from corellm.config import EngineConfig
from corellm.engine.core_client import AsyncMPClient
from corellm.engine.ipc import EngineDeadError
from corellm.engine.llm import build_config, load_tokenizer
from corellm.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState
from corellm.engine.processor import Processor, PromptType
from corellm.model_config import load_generation_eos_ids, model_path
from corellm.outputs import EngineStats, RequestOutput
from corellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called with the requests that finished in one batch of outputs (e.g. to observe latency
# histograms). Runs on the event loop: keep it cheap.
FinishedCallback = Callable[[list[RequestState]], None]


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
        self._ids = itertools.count()
        self._handler = asyncio.create_task(self._output_handler(), name="corellm-outputs")

    @classmethod
    async def create(cls, config: EngineConfig | Mapping[str, Any] | str | Path | None = None,
                     *, model: str | None = None) -> AsyncLLM:
        """Validate the config, start the engine-core process and wait until it is ready."""
        config, _ = build_config(config, model, ())
        path = model_path(config)
        # The engine process starts (imports torch, loads the model) while this process loads
        # the tokenizer: on two cores, the two overlap.
        starting = asyncio.ensure_future(AsyncMPClient.create(config))
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
            processor = Processor(tokenizer, client.model_info, load_generation_eos_ids(path))
            return cls(config, client, tokenizer, processor)
        except BaseException:
            await client.shutdown_async()
            raise

    @property
    def engine_pid(self) -> int:
        return self.client.pid

    @property
    def is_dead(self) -> bool:
        return (self.dead_error is not None or self.client.dead_reason is not None
                or self._handler.done())

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str | None = None, *, priority: int = 0,
                       user: str | None = None, session_id: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                       ) -> AsyncIterator[RequestOutput]:
        """Submit one request and iterate over its outputs (deltas by default).

        Raises ``InvalidRequestError`` (before anything is scheduled) for bad input and
        ``EngineDeadError`` if the engine process dies. Closing or cancelling the iterator
        early (a client that went away) aborts the request, freeing its KV blocks.
        """
        stream = await self.add_request(prompt, sampling_params, request_id, priority=priority,
                                        user=user, session_id=session_id,
                                        output_kind=output_kind)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_request(self, prompt: PromptType, sampling_params: SamplingParams,
                          request_id: str | None = None, *, priority: int = 0,
                          user: str | None = None, session_id: str | None = None,
                          output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                          ) -> RequestStream:
        """Validate and submit a request now; return the iterator of its outputs. A server uses
        this to answer bad input with an error status before it starts a streaming response."""
        if self.is_dead:
            raise self.dead_error or EngineDeadError(self.client.dead_reason or "engine is dead")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        text, core_request = self.processor.process(rid, prompt, sampling_params, priority,
                                                    user=user, session_id=session_id)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        state = self.output_processor.add_request(rid, text, core_request, output_kind, queue)
        try:
            await self.client.add_requests_async(state.core_requests)
        except BaseException:
            self.abort(rid)
            raise
        return RequestStream(self, rid, queue)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Safe to call from cleanup code: it
        never awaits."""
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids and not self.is_dead:
            task = asyncio.get_running_loop().create_task(
                self.client.abort_requests_async(child_ids))
            task.add_done_callback(_log_failure)
            logger.debug("aborted %s", request_id)

    async def _output_handler(self) -> None:
        op = self.output_processor
        try:
            while True:
                batch = await self.client.get_output_async()
                done = op.process_outputs(batch.outputs)
                if done.reqs_to_abort:
                    await self.client.abort_requests_async(done.reqs_to_abort)
                if done.finished:
                    for callback in self.finished_callbacks:
                        try:
                            callback(done.finished)
                        except Exception:
                            logger.exception("finished-request callback failed")
        except EngineDeadError as exc:
            self._fail_all(exc)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # Nothing would deliver outputs any more: fail loudly rather than hang everyone.
            logger.exception("output handler failed")
            self._fail_all(EngineDeadError(f"output handler failed: {exc!r}"))
            raise

    def _fail_all(self, exc: EngineDeadError) -> None:
        self.dead_error = self.dead_error or exc
        op = self.output_processor
        for state in list(op.requests.values()):
            if state.queue is not None:
                state.queue.put_nowait(exc)
        op.abort_requests(list(op.requests))

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

    async def shutdown(self) -> None:
        self._handler.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        await self.client.shutdown_async()


class RequestStream:
    """The outputs of one request, as an async iterator. ``close()`` (or cancelling a pending
    ``__anext__``) before the last output aborts the request in the engine core."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:            # cancelled: whoever waited is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None \
            and not isinstance(task.exception(), EngineDeadError):
        logger.error("abort failed: %r", task.exception())


__all__ = ["AsyncLLM", "RequestOutputKind"]
