"""The OpenAI-compatible server: FastAPI routes over an ``AsyncLLM`` whose engine core runs in
its own process, served by uvicorn."""

from __future__ import annotations

import asyncio
import difflib
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

import corellm
from corellm.components import BuildContext
from corellm.engine.async_llm import AsyncLLM, RequestStream
from corellm.engine.chat import RESERVED_TEMPLATE_KEYS, render_chat
from corellm.engine.ipc import EngineDeadError
from corellm.engine.output_processor import RequestOutputKind
from corellm.errors import CorellmError, InvalidRequestError
from corellm.interfaces import Frontend
from corellm.model_config import checkpoint_name
from corellm.outputs import CompletionOutput, RequestOutput
from corellm.sampling_params import SamplingParams

from .metrics import EngineMetrics
from .options import API_KEY_ENV, OpenAIServerOptions
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeChatRequest, TokenizeCompletionRequest, _SamplingFields)

logger = logging.getLogger("corellm.server")


# --------------------------------------------------------------------------- errors
class APIError(Exception):
    """Becomes an OpenAI-style error response."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _invalid(exc: InvalidRequestError, renames: dict[str, str] | None = None) -> APIError:
    field = exc.field.removeprefix("sampling_params.")
    field = (renames or {}).get(field, field)
    return APIError(400, f"{field}: {exc.message}", param=field)


def _validation_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Unions report the failing member first in loc ("str", "list[int]", ...): drop those.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    field = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        fields = list(model.model_fields) if len(loc) == 1 else []
        close = difflib.get_close_matches(loc[-1], fields, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return APIError(400, f"{field}: unknown field{hint}", param=field)
    if err["type"] == "missing":
        return APIError(400, f"{field}: field required", param=field)
    return APIError(400, f"{field}: {err['msg']} (got {err.get('input')!r})"[:500], param=field)


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes "
                            "(frontend.max_request_bytes)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes "
                                "(frontend.max_request_bytes)", code="request_too_large")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, model) from None


# --------------------------------------------------------------------------- the serving logic
class OpenAIServing:
    def __init__(self, engine: AsyncLLM, options: OpenAIServerOptions, model_name: str) -> None:
        self.engine = engine
        self.options = options
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_info.max_model_len
        self.created = int(time.time())

    # ------------------------------------------------------------------ shared pieces
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def sampling_params(self, req: Any, max_tokens: int | None, num_prompt_tokens: int,
                        logprobs: int | None, max_tokens_field: str,
                        logprobs_field: str = "logprobs") -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream: true",
                           param="stream_options")
        unsupported = {"logit_bias": bool(req.logit_bias),
                       "stream_options.continuous_usage_stats": bool(
                           req.stream_options and req.stream_options.continuous_usage_stats)}
        if isinstance(req, CompletionRequest):
            unsupported |= {"echo": req.echo, "suffix": req.suffix is not None,
                            "best_of": req.best_of is not None and req.best_of != req.n}
        else:
            unsupported |= {"tools": bool(req.tools),
                            "tool_choice": req.tool_choice not in (None, "none", "auto"),
                            "chat_template_kwargs": bool(
                                set(req.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KEYS),
                            "response_format": bool(req.response_format)
                            and req.response_format.get("type") != "text"}
        for field, used in unsupported.items():
            if used:
                raise APIError(400, f"{field}: not supported by this server", param=field)
        remaining = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = remaining
        elif isinstance(max_tokens, int) and max_tokens >= 1 and max_tokens > remaining:
            raise APIError(400, f"{max_tokens_field}: this model's maximum context length is "
                                f"{self.max_model_len} tokens; the prompt has "
                                f"{num_prompt_tokens}, so at most {max(remaining, 0)} can be "
                                f"generated, but {max_tokens} were requested",
                           param=max_tokens_field)
        kwargs: dict[str, Any] = dict(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=req.seed, stop=req.stop or [], ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids or [], logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, cache_salt=req.cache_salt)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                kwargs[name] = getattr(req, name)
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError as exc:
            raise _invalid(exc, {"max_tokens": max_tokens_field,
                                 "logprobs": logprobs_field}) from None

    def tokenize_prompt(self, prompt: str | list[int], field: str) -> list[int]:
        try:
            _, ids = self.engine.processor.tokenize(
                prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        except InvalidRequestError as exc:
            raise APIError(400, f"{field}: {exc.message}", param=field) from None
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{field}: {len(ids)} tokens leaves no room to generate in this "
                                f"model's maximum context length of {self.max_model_len}",
                           param=field)
        return ids

    async def _submit(self, ids: list[int], params: SamplingParams, request_id: str,
                      req: _SamplingFields, kind: RequestOutputKind) -> RequestStream:
        """Validate and queue the request now, so bad input is a 400 even when streaming.
        ``req`` carries the scheduling attributes: priority, user (tenant), session_id."""
        try:
            return await self.engine.add_request({"prompt_token_ids": ids}, params, request_id,
                                                 priority=req.priority, user=req.user,
                                                 session_id=req.session_id, output_kind=kind)
        except InvalidRequestError as exc:
            raise _invalid(exc) from None

    def usage(self, num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
                "prompt_tokens_details": {"cached_tokens": num_cached}}

    @staticmethod
    def check_finish(c: CompletionOutput) -> None:
        if c.finish_reason == "error":
            raise APIError(500, "the engine failed while generating this request (see the "
                                "server log)", code="engine_error")

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, data: dict[str, Any]) -> Response:
        req: CompletionRequest = _parse(CompletionRequest, data)
        self.check_model(req.model)
        prompts: list[str | list[int]]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt: is empty", param="prompt")
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(400, "logprobs: must be >= 0", param="logprobs")
        many = len(prompts) > 1
        token_ids = [self.tokenize_prompt(p, f"prompt[{i}]" if many else "prompt")
                     for i, p in enumerate(prompts)]
        params = [self.sampling_params(req, req.max_tokens, len(ids), req.logprobs, "max_tokens")
                  for ids in token_ids]
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid   # never collides
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gens = []
        try:
            for i, (ids, p) in enumerate(zip(token_ids, params)):
                gens.append(await self._submit(ids, p, f"{internal}-{i}", req, kind))
        except BaseException:
            for g in gens:
                g.close()
            raise
        if req.stream:
            return self._sse(self._stream_completion(req, rid, gens, token_ids), gens)
        try:
            finals = await asyncio.gather(*(_last(g) for g in gens))
        finally:
            for g in gens:
                g.close()
        choices, num_completion, num_cached = [], 0, 0
        for i, out in enumerate(finals):
            num_cached += out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c)
                num_completion += len(c.token_ids)
                choices.append({"index": i * req.n + c.index, "text": c.text,
                                "logprobs": None if req.logprobs is None
                                else self._completion_logprobs(c, req.logprobs),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": self.usage(sum(map(len, token_ids)), num_completion, num_cached)})

    def _completion_logprobs(self, c: CompletionOutput, k: int, offset: int = 0,
                             ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[tid]
            text = chosen.decoded_token or ""
            tokens.append(text)
            token_lps.append(chosen.logprob)
            # legacy format: the top alternatives and the sampled token, text -> logprob
            top = {lp.decoded_token or "": lp.logprob for lp in _top_k(entry, tid, k)}
            top.setdefault(text, chosen.logprob)
            tops.append(top)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def _stream_completion(self, req: CompletionRequest, rid: str,
                                 gens: list[RequestStream],
                                 token_ids: list[list[int]]) -> AsyncIterator[str]:
        created = int(time.time())
        num_completion, num_cached = 0, 0
        offsets: dict[int, int] = {}
        async for i, out in _merge(gens):
            if out.finished:
                num_cached += out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c)
                index = i * req.n + c.index
                num_completion += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(c, req.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                yield _sse_data({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "text": c.text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            yield _sse_data({"id": rid, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": [],
                             "usage": self.usage(sum(map(len, token_ids)), num_completion,
                                                 num_cached)})

    # ------------------------------------------------------------------ /v1/chat/completions
    def render_chat(self, req: ChatCompletionRequest,
                    continue_final_message: bool = False) -> list[int]:
        messages = [{"role": m.role, "content": m.text(),
                     **({"name": m.name} if m.name else {})} for m in req.messages]
        ids = render_chat(self.tokenizer, messages, add_generation_prompt=req.add_generation_prompt,
                          continue_final_message=continue_final_message,
                          chat_template_kwargs=req.chat_template_kwargs)
        return self.tokenize_prompt(ids, "messages")

    async def chat(self, data: dict[str, Any]) -> Response:
        req: ChatCompletionRequest = _parse(ChatCompletionRequest, data)
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
        ids = self.render_chat(req)
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = req.max_tokens, "max_tokens"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, len(ids), logprobs, field,
                                      "top_logprobs")
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gen = await self._submit(ids, params, internal, req, kind)
        if req.stream:
            return self._sse(self._stream_chat(req, rid, gen, len(ids)), [gen])
        try:
            out = await _last(gen)
        finally:
            gen.close()
        choices, num_completion = [], 0
        for c in out.outputs:
            self.check_finish(c)
            num_completion += len(c.token_ids)
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": self._chat_logprobs(c, req) if req.logprobs else None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": self.usage(len(ids), num_completion, out.num_cached_tokens)})

    def _chat_logprobs(self, c: CompletionOutput, req: ChatCompletionRequest) -> dict[str, Any]:
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[tid]
            content.append({**_token_logprob(chosen), "top_logprobs": [
                _token_logprob(lp) for lp in _top_k(entry, tid, k)]})
        return {"content": content}

    async def _stream_chat(self, req: ChatCompletionRequest, rid: str,
                           gen: RequestStream, num_prompt: int,
                           ) -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        for j in range(req.n):
            yield _sse_data({**base, "choices": [{"index": j, "delta": {"role": "assistant",
                                                                          "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
        num_completion, num_cached = 0, 0
        async for out in gen:
            if out.finished:
                num_cached = out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c)
                num_completion += len(c.token_ids)
                yield _sse_data({**base, "choices": [{
                    "index": c.index, "delta": {"content": c.text} if c.text else {},
                    "logprobs": self._chat_logprobs(c, req) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            yield _sse_data({**base, "choices": [],
                             "usage": self.usage(num_prompt, num_completion, num_cached)})

    # ------------------------------------------------------------------ /tokenize, /detokenize
    async def tokenize(self, data: dict[str, Any]) -> Response:
        """vLLM's ``POST /tokenize``: a ``prompt`` as /v1/completions tokenizes it, or
        ``messages`` as /v1/chat/completions renders and tokenizes them."""
        req: TokenizeCompletionRequest | TokenizeChatRequest
        if "messages" in data:
            req = _parse(TokenizeChatRequest, data)
            self.check_model(req.model)
            ids = self.render_chat(self._chat_for_tokenize(req),
                                   continue_final_message=req.continue_final_message)
        elif "prompt" in data:
            req = _parse(TokenizeCompletionRequest, data)
            self.check_model(req.model)
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "prompt: field required (or messages, to tokenize a chat)",
                           param="prompt")
        return JSONResponse({
            "count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids)
            if req.return_token_strs else None})

    def _chat_for_tokenize(self, req: TokenizeChatRequest) -> ChatCompletionRequest:
        """The chat request whose rendering (``render_chat``) /tokenize returns."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message: cannot be combined with "
                                "add_generation_prompt: true", param="continue_final_message")
        if req.add_special_tokens:
            raise APIError(400, "add_special_tokens: only false with messages (the chat template "
                                "writes the special tokens)", param="add_special_tokens")
        kwargs = dict(req.chat_template_kwargs or {})
        unsupported = {"tools": bool(req.tools),
                       "chat_template_kwargs": bool(set(kwargs) & RESERVED_TEMPLATE_KEYS)}
        for field, used in unsupported.items():
            if used:
                raise APIError(400, f"{field}: not supported by this server", param=field)
        return ChatCompletionRequest(messages=req.messages,
                                     add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=kwargs or None)

    async def detokenize(self, data: dict[str, Any]) -> Response:
        """vLLM's ``POST /detokenize``: ``tokens`` back to text (special tokens kept)."""
        req: DetokenizeRequest = _parse(DetokenizeRequest, data)
        self.check_model(req.model)
        vocab = self.engine.model_info.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is outside the vocabulary "
                                    f"[0, {vocab})", param="tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    # ------------------------------------------------------------------ streaming plumbing
    def _sse(self, events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except APIError as exc:
                yield _sse_data(exc.body())
            except EngineDeadError as exc:
                logger.error("request failed: %s", exc)
                yield _sse_data(APIError(500, f"engine is dead: {exc}", code="engine_dead").body())
            yield "data: [DONE]\n\n"
        return _EventStream(body(), streams)


class _EventStream(StreamingResponse):
    """Server-sent events whose requests are aborted however the response ends: finished,
    client gone mid-stream, or cancelled before the first byte."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.close()


def _top_k(entry: dict[int, Any], sampled: int, k: int) -> list[Any]:
    """The top-k alternatives of one position, best first (the sampled token's own entry is
    among them only if it ranks in the top k)."""
    ranked = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None),
                    key=lambda x: x[0])
    seen, result = set(), []
    for rank, t, lp in ranked:
        if t in seen or (t == sampled and rank > k):
            continue
        seen.add(t)
        result.append(lp)
    return result[:k]


def _token_logprob(lp: Any) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}


def _sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


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


# --------------------------------------------------------------------------- the app
# Routes outside /v1 that still need the API key (vLLM's tokenizer endpoints).
_KEYED_ROUTES = frozenset({"/tokenize", "/detokenize"})


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``, cancelling it if the client disconnects first (Starlette does this for
    streaming bodies; a non-streaming request would otherwise generate to the end for nobody).
    Cancellation closes the request's stream, which aborts it in the core. Call only after the
    body has been read: from then on the only message left to receive is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    logger.info("client disconnected from %s; request aborted", request.url.path)
    return Response(status_code=499)


def build_app(engine: AsyncLLM, options: OpenAIServerOptions, model_name: str) -> FastAPI:
    app = FastAPI(title="corellm", version=corellm.__version__, docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, options, model_name)
    metrics = EngineMetrics(engine, model_name, options.metrics_prefix, serving.max_model_len)
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    app.state.serving, app.state.metrics = serving, metrics

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[..., Awaitable[Response]]) -> Response:
        if api_key is not None and (request.url.path.startswith("/v1")
                                    or request.url.path in _KEYED_ROUTES):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                    token.strip().encode(), api_key.encode()):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                     "<key>'", code="invalid_api_key").response()
        try:
            return await call_next(request)
        except APIError as exc:
            return exc.response()

    async def run(request: Request, work: Callable[[dict[str, Any]], Awaitable[Response]],
                  ) -> Response:
        was_dead = engine.is_dead
        try:
            data = await _read_json(request, options.max_request_bytes)
            return await _until_disconnect(request, work(data))
        except APIError as exc:
            return exc.response()
        except InvalidRequestError as exc:
            return _invalid(exc).response()
        except EngineDeadError as exc:
            # A request that was in flight when the engine died is a 500; one that arrived at a
            # dead engine is a 503 (service unavailable).
            status = 503 if was_dead else 500
            logger.error("request failed: %s", exc)
            return APIError(status, f"engine is dead: {exc}", code="engine_dead").response()
        except Exception as exc:        # a bug: still an OpenAI-shaped answer, and logged
            logger.exception("request to %s failed", request.url.path)
            return APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                            code="internal_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, serving.chat)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await run(request, serving.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await run(request, serving.detokenize)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": serving.created,
            "owned_by": "corellm", "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health(options.health_timeout_s)
        except (EngineDeadError, asyncio.TimeoutError, TimeoutError) as exc:
            reason = str(exc) or f"engine loop did not answer within {options.health_timeout_s} s"
            return APIError(503, f"engine unavailable: {reason}", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": corellm.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = await metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    return app


# --------------------------------------------------------------------------- the Frontend
def default_model_name(config: Any) -> str:
    return checkpoint_name(config.model.path)


class OpenAIServer(Frontend):
    def __init__(self, options: OpenAIServerOptions, ctx: BuildContext) -> None:
        self.options = options
        self.config = ctx.config
        self.model_name = options.served_model_name or default_model_name(ctx.config)

    def run(self) -> None:
        # SIGTERM ends start-up like Ctrl-C does; while serving, uvicorn takes both signals for
        # a graceful shutdown and re-raises them afterwards, landing here as SystemExit.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            asyncio.run(self.serve())
        except (KeyboardInterrupt, SystemExit):
            pass

    async def serve(self) -> None:
        import uvicorn

        opts = self.options
        # Bind first: a port in use is reported before minutes of model loading, not after.
        sock = socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((opts.host, opts.port))
        except OSError as exc:
            sock.close()
            raise CorellmError(f"frontend.port: cannot listen on {opts.host}:{opts.port}: "
                               f"{exc.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        port = sock.getsockname()[1]
        try:
            engine = await AsyncLLM.create(self.config)
        except BaseException:
            sock.close()
            raise
        try:
            app = build_app(engine, opts, self.model_name)
            engine.finished_callbacks.append(app.state.metrics.observe_finished)
            server = uvicorn.Server(uvicorn.Config(
                app, log_level=opts.log_level, timeout_graceful_shutdown=5,
                access_log=opts.log_level == "debug"))
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                logger.info("serving %r on http://%s:%d (engine core pid %d)%s", self.model_name,
                            host, port, engine.engine_pid,
                            "; /v1 requires an API key" if opts.api_key
                            or os.environ.get(API_KEY_ENV) else "")
            await task
        finally:
            logger.info("shutting down the engine core")
            await engine.shutdown()
