"""Server-sent events and the engine's output streams: a stream's events ending with an error
event and ``[DONE]`` whatever fails, requests aborted however the response ends, and several
prompts' streams merged or awaited to their final outputs."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from corellm.engine.async_llm import RequestStream
from corellm.engine.ipc import EngineDeadError
from corellm.errors import RequestAbortedError
from corellm.outputs import RequestOutput

from .errors import APIError, _aborted

logger = logging.getLogger("corellm.server")


def _sse(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """``events`` as server-sent events, then ``[DONE]``; if they fail, an error event comes
    first. ``streams`` are the requests behind them, aborted however the response ends."""
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield _sse_data(exc.body())
        except RequestAbortedError as exc:
            yield _sse_data(_aborted(exc).body())
        except EngineDeadError as exc:
            logger.error("request failed: %s", exc)
            yield _sse_data(APIError(500, f"engine is dead: {exc}", code="engine_dead").body())
        except Exception as exc:     # a bug: the stream still ends with an error and [DONE]
            logger.exception("stream failed")
            yield _sse_data(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     code="internal_error").body())
        yield "data: [DONE]\n\n"
    return _EventStream(body(), streams)


class _EventStream(StreamingResponse):
    """Server-sent events whose requests are aborted however the response ends: finished,
    client gone mid-stream, or cancelled before the first byte.

    ``on_sent``, when set, is called once with the body bytes handed to the HTTP server: every
    event, the error event and ``[DONE]`` included, counted from the messages Starlette sends
    (each event encoded once, by Starlette: nothing is encoded again to count it). It is called
    as the last one is taken, before this task yields to the loop again (so a scrape sent once
    the client has read the end sees it), or, when the response ends early (client gone, task
    cancelled), with what was taken until then. Taken is not received: the socket's buffers, and
    what uvicorn silently drops after a disconnect until the stream is cancelled (an event or
    so), are counted too."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.streams = streams
        self.on_sent: Callable[[int], None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        on_sent, sent = self.on_sent, 0

        def report() -> None:
            nonlocal on_sent
            if on_sent is not None:
                on_sent(sent)
                on_sent = None

        async def counted(message: dict[str, Any]) -> None:
            nonlocal sent
            await send(message)        # counted once the server took it; a raise: not sent
            if message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
                if not message.get("more_body", False):
                    report()
        try:
            await super().__call__(scope, receive, send if on_sent is None else counted)
        finally:
            # Ended before its requests did: the client went away (or stopped reading).
            for s in self.streams:
                s.close("client_disconnected")
            report()


def _sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _gather_finals(gens: list[RequestStream]) -> list[RequestOutput]:
    try:
        return await asyncio.gather(*(_last(g) for g in gens))
    finally:
        for g in gens:
            g.close()


async def _last(gen: RequestStream) -> RequestOutput:
    last = None
    async for out in gen:
        last = out
    assert last is not None
    return last


async def _merge(gens: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, tagging items with the iterator's index."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any] | tuple[None, BaseException] | None] = asyncio.Queue()

    async def pump(i: int, gen: RequestStream) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except BaseException as exc:      # noqa: BLE001 - forwarded to the consumer
            await queue.put((None, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
            elif item[0] is None:
                raise item[1]
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
