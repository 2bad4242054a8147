"""The OpenAI-compatible server: FastAPI routes over an ``AsyncLLM`` whose engine core runs in
its own process, served by uvicorn.

Nothing a single request asks for may stall the others: what it may ask for is bounded
(``frontend.limits``, and a text is refused by its length when it cannot fit the context),
parsing large bodies, chat templates and tokenization run on worker threads that take the
cheapest job first (``preprocess.FairExecutor``), and outputs are processed in short slices
(``AsyncLLM``), so the event loop answers ``/health`` and other clients while the largest
allowed request runs. On SIGTERM/SIGINT the server drains: new requests get 503, running ones
may finish within ``frontend.drain_timeout_s``, the rest end with an error event naming the
shutdown, then every process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import ipaddress
import json
import logging
import os
import re
import reprlib
import secrets
import signal
import socket
import sys
import time
import typing
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

import corellm
from corellm.components import BuildContext
from corellm.engine.async_llm import AsyncLLM, RequestStream
from corellm.engine.chat import RESERVED_TEMPLATE_KEYS, render_chat_text
from corellm.engine.ipc import EngineDeadError
from corellm.engine.output_processor import RequestOutputKind
from corellm.errors import CorellmError, InvalidRequestError, RequestAbortedError
from corellm.interfaces import Frontend
from corellm.logs import configured as logs_configured
from corellm.model_config import checkpoint_name
from corellm.outputs import CompletionOutput, RequestOutput
from corellm.sampling_params import SamplingParams

from .metrics import EngineMetrics
from .openapi import (ERROR_TYPES, HEALTH_ERRORS, HOST_ERROR, REQUEST_ERRORS, ChatCompletion,
                      ChatCompletionChunk, Completion, CompletionChunk, DetokenizeResponse,
                      ModelList, TokenizeResponse, Version, json_body, responses)
from .openapi import install as install_openapi
from .options import API_KEY_ENV, OpenAIServerOptions, RequestLimits
from .preprocess import FairExecutor, TextBound
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeChatRequest, TokenizeCompletionRequest, _SamplingFields)

if typing.TYPE_CHECKING:
    from .connections import RepeatFilter

logger = logging.getLogger("corellm.server")


# --------------------------------------------------------------------------- errors
class APIError(HTTPException):
    """Becomes an OpenAI-style error response. An ``HTTPException``, so FastAPI lets it through
    when body parsing raises it."""

    TYPES = ERROR_TYPES

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped: whatever a message quotes, the answer is valid JSON and UTF-8.
        return Response(json.dumps(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = 80
_short_repr.maxlist = _short_repr.maxdict = 8


def _invalid(exc: InvalidRequestError, renames: dict[str, str] | None = None) -> APIError:
    field = exc.field.removeprefix("sampling_params.")
    field = (renames or {}).get(field, field)
    return APIError(400, f"{field}: {exc.message}", param=field)


def _validation_error(errors: Sequence[Any], model: type[BaseModel] | None) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors, as a 400 naming the field."""
    err = errors[0]
    loc = [str(p) for p in err["loc"]]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    # Unions report the failing member first in loc ("str", "list[int]", ...): drop those.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    field = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        fields = list(model.model_fields) if model is not None and len(loc) == 1 else []
        close = difflib.get_close_matches(loc[-1], fields, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return APIError(400, f"{field}: unknown field{hint}", param=field)
    if err["type"] == "missing":
        return APIError(400, f"{field or 'request body'}: field required", param=field)
    return APIError(400, f"{field or 'request body'}: {err['msg']} "
                         f"(got {_short_repr.repr(err.get('input'))})", param=field)


# --------------------------------------------------------------------------- request bodies
# JSON text may spell a lone UTF-16 surrogate ("\ud800"): valid JSON, but not a string any
# tokenizer or encoder accepts. Bodies whose bytes contain such an escape are checked value by
# value (a valid pair, "\ud83d\ude00", merely triggers the check).
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class _HugeInt:
    """Stands in for an integer literal longer than Python converts (``int_max_str_digits``),
    so the error can name the field it was in."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _HugeInt:
    limit = sys.get_int_max_str_digits() or 4300
    return _HugeInt(len(text)) if len(text) > limit else int(text)


def _reject_constant(name: str) -> Any:
    raise APIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or an ``APIError`` (400) that names what is wrong: not
    JSON, not an object, nested too deeply, an integer too long to convert or a string that is
    not valid Unicode (these two name the field)."""
    try:
        # Strict UTF-8 (RFC 8259): json.loads(bytes) would let encoded surrogates through.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8: {exc}") from None
    checked = _ESCAPED_SURROGATE.search(raw) is not None
    try:
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except ValueError as exc:
            if isinstance(exc, json.JSONDecodeError):
                raise
            # An integer literal over Python's digit limit: parse again, marking it, to name it.
            data = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int)
            checked = True
    except json.JSONDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    if checked:
        try:
            _check_values(data, "")
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None
    return data


def _check_values(value: Any, path: str) -> None:
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        if m:
            raise APIError(400, f"{path or 'request body'}: not valid Unicode (a lone UTF-16 "
                                f"surrogate {ascii(m.group())[1:-1]} at character {m.start()})",
                           param=path or None)
    elif isinstance(value, _HugeInt):
        raise APIError(400, f"{path}: an integer of {value.digits} digits is out of range",
                       param=path or None)
    elif isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                raise APIError(400, f"{path or 'request body'}: a key is not valid Unicode "
                                    f"({ascii(key)})", param=path or None)
            _check_values(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_values(item, f"{path}[{i}]")


async def _read_body(request: Request, limit: int) -> bytes:
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
    return b"".join(chunks)


# Routes whose bodies carry chat messages.
_CHAT_ROUTES = frozenset({"/v1/chat/completions", "/tokenize"})
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones on
# the preprocessing pool, at a cost of a unit (about a microsecond) per this many bytes.
INLINE_PARSE_BYTES = 64 << 10
JSON_BYTES_PER_COST = 50


def check_message_count(data: dict[str, Any], limits: RequestLimits) -> None:
    """``messages`` within ``frontend.limits.max_messages``, a list content counting each of its
    parts: checked on the parsed JSON, before pydantic validates each message (30,000 messages
    took 0.2 s of the event loop to validate, and the chat template another 0.3 s)."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    limit = limits.max_messages
    count = len(messages)
    if count <= limit:
        count = sum(len(m["content"]) if isinstance(m, dict) and isinstance(
            m.get("content"), list) and m["content"] else 1 for m in messages)
    if count > limit:
        what = f"{count} messages" if count == len(messages) else \
            f"{count} messages and content parts (a list content counts each part)"
        raise APIError(400, f"messages: {what} exceed the limit of {limit} "
                            "(frontend.limits.max_messages)", param="messages")


class _JSONRequest(Request):
    """A request whose body is read with the size limit and parsed by ``parse_json_body``
    (FastAPI calls ``body()`` and ``json()`` when it builds a typed body)."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            self._body = await _read_body(self, self.app.state.max_request_bytes)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            serving = self.app.state.serving
            if len(raw) <= INLINE_PARSE_BYTES:
                self._json = self._parse(raw, serving.limits)
            else:
                # json.loads takes 20 ms for 1 MiB of small objects. On the loop, twenty such
                # bodies held every other client's request for their sum; on the pool they wait
                # behind smaller jobs (twenty clients sending 1 MiB bodies of four kinds: a
                # one-token completion took 0.1-0.3 s, 0.3-1.0 s with bodies parsed on the loop).
                self._json = await serving.off_loop(self._parse, raw, serving.limits,
                                                    cost=len(raw) / JSON_BYTES_PER_COST)
        return self._json

    def _parse(self, raw: bytes, limits: RequestLimits) -> dict[str, Any]:
        data = parse_json_body(raw)
        if self.scope["path"] in _CHAT_ROUTES:
            check_message_count(data, limits)
        return data


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


class _OpenAIRoute(APIRoute):
    """Routes whose JSON bodies are checked as OpenAI's API does: 415 for another content type,
    413 over the size limit, and every parse or validation error a 400 naming the field."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()
        model = next((t for t in typing.get_type_hints(self.endpoint).values()
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
        takes_body = "POST" in self.methods

        async def route(request: Request) -> Response:
            if takes_body and not _is_json(request.headers.get("content-type")):
                got = request.headers.get("content-type")
                return APIError(415, "Content-Type must be application/json, got "
                                     f"{got!r}" if got else "Content-Type must be "
                                     "application/json (the header is missing)",
                                code="unsupported_media_type").response()
            try:
                return await handler(_JSONRequest(request.scope, request.receive))
            except RequestValidationError as exc:
                return _validation_error(exc.errors(), model).response()
            except APIError as exc:
                return exc.response()
            except HTTPException as exc:          # FastAPI's own (e.g. a body it cannot read)
                return APIError(exc.status_code, str(exc.detail)).response()
        return route


def _parse(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc.errors(), model) from None


# --------------------------------------------------------------------------- the serving logic
# What a chat message costs the template beyond its text, in characters' worth of tokenizing
# (preprocess.FairExecutor's unit: about a microsecond).
CHAT_COST_PER_MESSAGE = 16


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, options: OpenAIServerOptions, model_name: str) -> None:
        self.engine = engine
        self.options = options
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_info.max_model_len
        self.limits = options.limits
        self.created = int(time.time())
        # Texts too long to fit the context are refused by their length, before tokenizing.
        self.text_bound = TextBound(self.tokenizer, self.max_model_len)
        # Large bodies are parsed, chat templates rendered and texts tokenized here, off the
        # event loop, cheapest job first.
        self._preprocess = FairExecutor("corellm-preprocess")

    async def off_loop(self, fn: Callable[..., Any], *args: Any, cost: float) -> Any:
        """Run ``fn`` (tokenizer work) on the preprocessing pool; ``cost``: its estimated work,
        in ``FairExecutor``'s unit (about a microsecond: a character to tokenize)."""
        return await self._preprocess.run(partial(fn, *args), cost)

    def close(self) -> None:
        self._preprocess.shutdown()

    # ------------------------------------------------------------------ limits
    def check_limits(self, req: _SamplingFields, num_prompts: int, logprobs: int | None,
                     logprobs_field: str) -> None:
        """What a request may ask for (``frontend.limits``): checked before any tokenizer or
        engine work is spent on it."""
        lim = self.limits
        samples = num_prompts * req.n
        if samples > lim.max_samples:
            field = "n" if num_prompts == 1 else "prompt"
            what = f"n={req.n}" if num_prompts == 1 else \
                f"{num_prompts} prompts x n={req.n} = {samples} samples"
            raise APIError(400, f"{field}: {what} exceeds the limit of {lim.max_samples} samples "
                                "per request (frontend.limits.max_samples)", param=field)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        if len(stops) > lim.max_stop_strings:
            raise APIError(400, f"stop: {len(stops)} stop strings exceed the limit of "
                                f"{lim.max_stop_strings} (frontend.limits.max_stop_strings)",
                           param="stop")
        for i, stop in enumerate(stops):
            if len(stop) > lim.max_stop_string_chars:
                where = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
                raise APIError(400, f"{where}: {len(stop)} characters exceed the limit of "
                                    f"{lim.max_stop_string_chars} "
                                    "(frontend.limits.max_stop_string_chars)", param="stop")
        if req.stop_token_ids and len(req.stop_token_ids) > lim.max_stop_token_ids:
            raise APIError(400, f"stop_token_ids: {len(req.stop_token_ids)} ids exceed the limit "
                                f"of {lim.max_stop_token_ids} "
                                "(frontend.limits.max_stop_token_ids)", param="stop_token_ids")
        if logprobs and logprobs > 0 and logprobs * samples > lim.max_logprobs_total:
            raise APIError(400, f"{logprobs_field}: {logprobs} alternatives x {samples} samples "
                                f"= {logprobs * samples} per generated position exceed the limit "
                                f"of {lim.max_logprobs_total} "
                                "(frontend.limits.max_logprobs_total)", param=logprobs_field)

    def check_generated_tokens(self, params: list[SamplingParams], field: str,
                               defaulted: bool) -> None:
        total = sum(p.max_tokens * p.n for p in params)
        limit = self.limits.max_generated_tokens
        if total > limit:
            samples = sum(p.n for p in params)
            per = f"{params[0].max_tokens}" if len({p.max_tokens for p in params}) == 1 \
                else "up to " + str(max(p.max_tokens for p in params))
            why = (f" ({field} was not set: each sample may fill the rest of the context; set "
                   f"{field} or lower n)") if defaulted else ""
            raise APIError(400, f"{field}: {samples} samples x {per} tokens = {total} exceeds the "
                                f"limit of {limit} generated tokens per request "
                                f"(frontend.limits.max_generated_tokens){why}", param=field)

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

    def check_text_length(self, text: str, field: str, what: str = "") -> None:
        """Refuse ``text`` when it has more characters than fit in the context, before the
        tokenizer spends time on it (about a second for 1 MiB)."""
        excess = self.text_bound.excess(text)
        if excess:
            raise APIError(400, f"{field}: {what}{excess} characters cannot fit in this "
                                f"model's maximum context length of {self.max_model_len} tokens "
                                f"(model.max_model_len): no token of this tokenizer stands for "
                                f"more than {self.text_bound.per_token} characters", param=field)

    def tokenize_prompt(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_length(prompt, field)
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
                      req: _SamplingFields, kind: RequestOutputKind,
                      group_id: str | None = None) -> RequestStream:
        """Validate and queue the request now, so bad input is a 400 even when streaming.
        ``req`` carries the scheduling attributes: priority, user (tenant), session_id;
        ``group_id`` makes the prompts of one call one client request to the scheduler."""
        try:
            stream = await self.engine.add_request({"prompt_token_ids": ids}, params, request_id,
                                                   priority=req.priority, user=req.user,
                                                   session_id=req.session_id, group_id=group_id,
                                                   output_kind=kind)
        except InvalidRequestError as exc:
            raise _invalid(exc) from None
        stream.cancel_reason = "client_disconnected"     # what cancels a handler here
        return stream

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
    async def completions(self, req: CompletionRequest) -> Response:
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
        self.check_limits(req, len(prompts), req.logprobs, "logprobs")
        many = len(prompts) > 1
        # One job per prompt, chained: other clients' small jobs run between them.
        token_ids = await self._preprocess.run_all(
            [partial(self.tokenize_prompt, p, f"prompt[{i}]" if many else "prompt")
             for i, p in enumerate(prompts)], [self.text_cost(len(p)) for p in prompts])
        params = [self.sampling_params(req, req.max_tokens, len(ids), req.logprobs, "max_tokens")
                  for ids in token_ids]
        self.check_generated_tokens(params, "max_tokens", defaulted=req.max_tokens is None)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid   # never collides
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gens = []
        try:
            for i, (ids, p) in enumerate(zip(token_ids, params)):
                gens.append(await self._submit(ids, p, f"{internal}-{i}", req, kind,
                                               group_id=internal if many else None))
        except BaseException:
            for g in gens:
                g.close()
            raise
        if req.stream:
            return self._sse(self._stream_completion(req, rid, gens, token_ids), gens)
        finals = await _gather_finals(gens)
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
        text = render_chat_text(self.tokenizer, messages,
                                add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=req.chat_template_kwargs)
        self.check_text_length(text, "messages", "the chat template's output: ")
        # The template writes the special tokens (BOS) itself.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenize_prompt(ids, "messages")

    def text_cost(self, chars: int) -> int:
        """About what tokenizing a text of ``chars`` characters costs (a microsecond a
        character): no more than the longest text that can fit, longer ones are refused."""
        bound = self.text_bound.max_chars
        return chars if bound is None else min(chars, bound)

    def chat_cost(self, messages: Sequence[Any]) -> int:
        """About what rendering and tokenizing ``messages`` costs: their text, and for each
        message the template's work on it (about 14 us a message, and 1 us a character to
        tokenize, on a 2-core AMD EPYC)."""
        chars = sum(len(m.content) if isinstance(m.content, str)
                    else sum(len(p.text) for p in m.content or ()) for m in messages)
        return self.text_cost(chars) + CHAT_COST_PER_MESSAGE * len(messages)

    async def chat(self, req: ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.check_limits(req, 1, logprobs, "top_logprobs")
        ids = await self.off_loop(self.render_chat, req, cost=self.chat_cost(req.messages))
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = req.max_tokens, "max_tokens"
        params = self.sampling_params(req, max_tokens, len(ids), logprobs, field,
                                      "top_logprobs")
        self.check_generated_tokens([params], field, defaulted=max_tokens is None)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gen = await self._submit(ids, params, internal, req, kind)
        if req.stream:
            return self._sse(self._stream_chat(req, rid, gen, len(ids)), [gen])
        out, = await _gather_finals([gen])
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
            ids = await self.off_loop(lambda: self.render_chat(
                self._chat_for_tokenize(req), continue_final_message=req.continue_final_message),
                cost=self.chat_cost(req.messages))
        elif "prompt" in data:
            req = _parse(TokenizeCompletionRequest, data)
            self.check_model(req.model)
            # Not bounded by the context: counting a long text's tokens is what this is for.
            ids = await self.off_loop(lambda: self.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens), cost=len(req.prompt))
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

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """vLLM's ``POST /detokenize``: ``tokens`` back to text (special tokens kept)."""
        self.check_model(req.model)
        vocab = self.engine.model_info.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is outside the vocabulary "
                                    f"[0, {vocab})", param="tokens")
        return JSONResponse({"prompt": await self.off_loop(self.tokenizer.decode, req.tokens,
                                                           cost=len(req.tokens))})

    # ------------------------------------------------------------------ streaming plumbing
    def _sse(self, events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
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
    client gone mid-stream, or cancelled before the first byte."""

    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Ended before its requests did: the client went away (or stopped reading).
            for s in self.streams:
                s.close("client_disconnected")


def _aborted(exc: RequestAbortedError) -> APIError:
    if exc.reason == "shutdown":
        return APIError(503, str(exc), code="server_shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, str(exc), code=f"aborted_{exc.reason}")


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


# --------------------------------------------------------------------------- the app
# Routes outside /v1 that still need the API key (vLLM's tokenizer endpoints).
_KEYED_ROUTES = frozenset({"/tokenize", "/detokenize"})
# What a client is told to wait before retrying a server that is shutting down.
RETRY_AFTER_S = 5


class ServerState:
    """What the guard and the shutdown share: whether the server drains, and the requests
    (POST routes) it is still answering."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0

    async def wait_idle(self, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Wait until no request is in flight (True), ``timeout`` passes or ``stop`` is set."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline and not (stop and stop.is_set()):
            await asyncio.sleep(0.02)
        return not self.inflight


def default_allowed_hosts(host: str) -> list[str]:
    """The Host header values a server bound to ``host`` answers by default: any when bound to
    every interface, else the bind address, plus the loopback names when it is loopback."""
    try:
        ip: Any = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        return ["*"]
    hosts = [host.lower()]
    if host.lower() == "localhost" or (ip is not None and ip.is_loopback):
        hosts += [h for h in ("localhost", "127.0.0.1", "::1") if h not in hosts]
    return hosts


def host_allowed(header: str, allowed: Sequence[str]) -> bool:
    """Whether a Host header (port ignored) matches ``allowed``: exact names, ``*``, or
    ``*.example.com`` for the hosts of a domain."""
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header[1:]
    elif header.count(":") == 1:
        name = header.partition(":")[0]
    else:
        name = header
    name = name.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern or (
                pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


_SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff")]


def _with_security_headers(send: Any) -> Any:
    """``send`` adding the headers every response carries: ``nosniff`` keeps a browser from
    reading a JSON error or an event stream as HTML."""
    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *_SECURITY_HEADERS]}
        await send(message)
    return wrapped


class _Guard:
    """ASGI middleware in front of every route: the Host check (DNS rebinding), the API key,
    and, while the server drains, 503 for new requests. It also counts the POST requests in
    flight, so the shutdown knows when they are done."""

    def __init__(self, app: Any, *, api_key: str | None, allowed_hosts: list[str],
                 state: ServerState) -> None:
        self.app, self.api_key, self.allowed_hosts, self.state = app, api_key, allowed_hosts, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        error = self.check(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1

    def check(self, scope: Any) -> APIError | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if "*" not in self.allowed_hosts:
            # HTTP/1.0 lets a client leave Host out: without one the check cannot pass
            if host is None:
                return APIError(400, "no Host header: one of frontend.allowed_hosts is "
                                     "required", code="host_not_allowed")
            if not host_allowed(host.decode("latin-1"), self.allowed_hosts):
                return APIError(400, f"Host header {host.decode('latin-1')!r} is not allowed "
                                     "(frontend.allowed_hosts)", code="host_not_allowed")
        path = scope["path"]
        if self.api_key is not None and (path.startswith("/v1") or path in _KEYED_ROUTES):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                    token.strip(), self.api_key.encode()):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                     "<key>'", code="invalid_api_key")
        if self.state.draining and (scope["method"] == "POST" or path == "/health"):
            return APIError(503, "the server is shutting down", code="server_shutting_down",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        return None


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``, cancelling it if the client disconnects first (Starlette does this for
    streaming bodies; a non-streaming request would otherwise generate to the end for nobody).
    Cancellation closes the request's streams, which aborts them in the core (reason
    ``client_disconnected``). Call only after the body has been read: from then on the only
    message left to receive is the disconnect."""
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
    return Response(status_code=499)


def _tokenize_body_schema() -> dict[str, Any]:
    """/tokenize takes either body; its schema refers to the models' parts as FastAPI names
    them in ``components`` (the chat route's body brings ``ChatMessage`` and ``TextPart``)."""
    variants = []
    for model in (TokenizeCompletionRequest, TokenizeChatRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)
        variants.append(schema)
    # A body with a messages key, even null, is read as a chat (OpenAIServing.tokenize).
    variants[0]["not"] = {"required": ["messages"]}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"anyOf": variants}}}}}


def build_app(engine: AsyncLLM, options: OpenAIServerOptions, model_name: str,
              state: ServerState | None = None) -> FastAPI:
    app = FastAPI(title="corellm", version=corellm.__version__, docs_url=None, redoc_url=None)
    app.router.route_class = _OpenAIRoute
    serving = OpenAIServing(engine, options, model_name)
    # Engine gauges come from the engine's StepStats stream (a listener registered here); a
    # scrape only checks liveness. serve() seeds them (metrics.start()) before accepting.
    metrics = EngineMetrics(engine, model_name, options.metrics_prefix, serving.max_model_len,
                            health_timeout_s=options.health_timeout_s)
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    state = state or ServerState()
    app.state.serving, app.state.metrics, app.state.server = serving, metrics, state
    app.state.max_request_bytes = options.max_request_bytes
    allowed_hosts = options.allowed_hosts if options.allowed_hosts is not None \
        else default_allowed_hosts(options.host)
    app.add_middleware(_Guard, api_key=api_key, allowed_hosts=allowed_hosts, state=state)
    if options.cors_allow_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=options.cors_allow_origins,
                           allow_methods=["GET", "POST"], allow_headers=["*"])

    async def run(request: Request, work: Awaitable[Response]) -> Response:
        was_dead = engine.is_dead
        try:
            return await _until_disconnect(request, work)
        except APIError as exc:
            return exc.response()
        except InvalidRequestError as exc:
            return _invalid(exc).response()
        except RequestAbortedError as exc:
            return _aborted(exc).response()
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

    @app.post("/v1/completions", responses=responses(json_body(
        "The completion; with stream: true, its chunks as server-sent events.", Completion,
        stream=CompletionChunk), REQUEST_ERRORS))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await run(request, serving.completions(body))

    @app.post("/v1/chat/completions", responses=responses(json_body(
        "The chat completion; with stream: true, its chunks as server-sent events.",
        ChatCompletion, stream=ChatCompletionChunk), REQUEST_ERRORS))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await run(request, serving.chat(body))

    @app.post("/tokenize", openapi_extra=_tokenize_body_schema(), responses=responses(
        json_body("The token ids.", TokenizeResponse), REQUEST_ERRORS))
    async def tokenize(request: Request) -> Response:
        return await run(request, serving.tokenize(await request.json()))

    @app.post("/detokenize", responses=responses(
        json_body("The text of the tokens.", DetokenizeResponse), REQUEST_ERRORS))
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await run(request, serving.detokenize(body))

    @app.get("/v1/models", response_model=None, responses=responses(
        json_body("The served model.", ModelList), HOST_ERROR))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": serving.created,
            "owned_by": "corellm", "max_model_len": serving.max_model_len}]}

    # response_class: a 200 without a body, which FastAPI would document as JSON.
    @app.get("/health", response_class=Response, responses=responses(
        {"description": "The engine is alive and its loop answers."}, HEALTH_ERRORS))
    async def health() -> Response:
        try:
            await engine.check_health(options.health_timeout_s)
        except (EngineDeadError, asyncio.TimeoutError, TimeoutError) as exc:
            reason = str(exc) or f"engine loop did not answer within {options.health_timeout_s} s"
            return APIError(503, f"engine unavailable: {reason}", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/version", response_model=None, responses=responses(
        json_body("The corellm version.", Version), HOST_ERROR))
    async def version() -> dict[str, str]:
        return {"version": corellm.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses(
        {"description": "Prometheus' text format."}, HOST_ERROR))
    async def prometheus() -> Response:
        body, content_type = await metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    # /v1/* and the tokenizer routes need the key when one is set, as _Guard checks them.
    install_openapi(app, None if api_key is None else
                    lambda path: path.startswith("/v1") or path in _KEYED_ROUTES)
    return app


# --------------------------------------------------------------------------- the Frontend
def default_model_name(config: Any) -> str:
    return checkpoint_name(config.model.path)


# After the drain: how long ended requests get to send their last event, uvicorn gets to close
# connections, and the engine core gets to stop before it is killed.
SETTLE_S = 2.0
ENGINE_STOP_TIMEOUT_S = 5.0
# Like log records within this time collapse into the first and a count (connections.py).
LOG_REPEAT_WINDOW_S = 10.0
# Said once the server is up: small models' sampled answers look broken, and a user who sent
# no temperature may not know that OpenAI's default of 1 applies.
TEMPERATURE_HINT = ('requests without "temperature" are sampled at temperature 1.0 (OpenAI\'s '
                    'default); send "temperature": 0 for greedy, repeatable answers')


def _uvicorn_server(config: Any, sock: socket.socket, cap: int, header_timeout_s: float,
                    on_serving: Callable[[], None] | None = None) -> Any:
    """uvicorn's server with its own signal capture turned off (``OpenAIServer`` handles
    SIGINT/SIGTERM itself: drain, then stop, for the whole life of the engine), serving ``sock``
    through a ``Listener`` instead of asyncio's server: asyncio accepts until the process runs
    out of files, the ``Listener`` holds at most ``cap`` connections and closes those that do
    not send a request head within ``header_timeout_s`` (see connections.py). ``on_serving`` is
    called just before the listener takes its first connection."""
    import uvicorn

    from .connections import Connection, Listener

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=[])         # the app's lifespan, no listening
            if not self.started:
                return

            def connection(listener: Listener) -> Connection:
                return Connection(self.config, self.server_state, self.lifespan.state,
                                  listener=listener, header_timeout_s=header_timeout_s)

            listener = Listener(sock, cap, connection)
            self.servers.append(listener)             # closed by uvicorn's shutdown
            # Before the first accept: connections queued while the model loaded are served
            # at once, and the "serving" line comes before any of their answers.
            if on_serving is not None:
                on_serving()
            listener.start()

    return Server(config)


async def _flush_log_repeats(repeats: RepeatFilter) -> None:
    while True:
        await asyncio.sleep(LOG_REPEAT_WINDOW_S)
        repeats.flush()


def _file_limit() -> str:
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


class OpenAIServer(Frontend):
    def __init__(self, options: OpenAIServerOptions, ctx: BuildContext) -> None:
        self.options = options
        self.config = ctx.config
        self.model_name = options.served_model_name or default_model_name(ctx.config)

    def run(self) -> int:
        # Until the server is up, SIGTERM ends start-up as Ctrl-C does; from then on serve()
        # handles both signals (drain, then stop).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            return asyncio.run(self.serve())
        except (KeyboardInterrupt, SystemExit):
            return 0

    async def serve(self) -> int:
        """Serve until SIGINT/SIGTERM (drain, exit status 0) or the engine core's death (status
        1 unless ``frontend.exit_on_engine_death`` is false)."""
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
        loop = asyncio.get_running_loop()
        signals: asyncio.Queue[int] = asyncio.Queue()
        previous = {sig: signal.signal(sig, lambda sig, _: loop.call_soon_threadsafe(
            signals.put_nowait, sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
        state = ServerState()
        app = None
        status = 1                    # unless the server starts and stops as asked
        unfilter = None
        flusher = None
        try:
            from .connections import RepeatFilter, connection_cap

            # After the engine core started: its files are counted, and it keeps the limit.
            cap = connection_cap(opts.max_connections)
            app = build_app(engine, opts, self.model_name, state)
            engine.finished_callbacks.append(app.state.metrics.observe_finished)
            await app.state.metrics.start()       # one get_stats: gauges before the first step
            # Under the corellm command (corellm.logs), uvicorn's loggers write through its
            # handler, in its format; elsewhere uvicorn installs its own handlers.
            own_logs = {"log_config": None} if logs_configured() else {}
            config = uvicorn.Config(
                app, log_level=opts.log_level, timeout_graceful_shutdown=SETTLE_S,
                access_log=opts.log_level == "debug", http="h11", ws="none",
                timeout_keep_alive=opts.keep_alive_timeout_s,
                **own_logs)   # type: ignore[arg-type]
            # After uvicorn.Config, which replaces uvicorn's log handlers.
            repeats = RepeatFilter(LOG_REPEAT_WINDOW_S)
            unfilter = repeats.install()
            flusher = asyncio.create_task(_flush_log_repeats(repeats))

            def announce() -> None:
                logger.info("holding up to %d connections (frontend.max_connections; open-file "
                            "limit %s)", cap, _file_limit())
                host = f"[{opts.host}]" if ":" in opts.host else opts.host
                logger.info("serving %r on http://%s:%d (engine core pid %d)%s", self.model_name,
                            host, port, engine.engine_pid,
                            "; /v1 requires an API key" if opts.api_key
                            or os.environ.get(API_KEY_ENV) else "")
                logger.info(TEMPERATURE_HINT)

            server = _uvicorn_server(config, sock, cap, opts.header_timeout_s, announce)
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if server.started:
                status = await self._until_stopped(engine, state, signals, task)
                server.should_exit = True
                if not signals.empty():
                    server.force_exit = True
            await task
        finally:
            sock.close()                # the listener closes it; not if the server never started
            if flusher is not None:
                flusher.cancel()
            if unfilter is not None:
                unfilter()
            if app is not None:
                app.state.serving.close()
            logger.info("shutting down the engine core")
            try:
                await engine.shutdown(timeout=ENGINE_STOP_TIMEOUT_S)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        return status

    async def _until_stopped(self, engine: AsyncLLM, state: ServerState,
                             signals: asyncio.Queue[int], server_task: asyncio.Task) -> int:
        """Wait for a signal (then drain) or the engine's death; return the exit status."""
        opts = self.options
        death: asyncio.Future | None = asyncio.ensure_future(engine.wait_dead())
        got_signal = asyncio.ensure_future(signals.get())
        try:
            while True:
                waiting = {got_signal, server_task} | ({death} if death else set())
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if got_signal.done():
                    await self._drain(engine, state, signal.Signals(got_signal.result()).name,
                                      signals)
                    return 0
                if server_task.done():
                    return 1
                if death is not None and death.done():
                    if not opts.exit_on_engine_death:
                        logger.error("engine core died (%s); answering 503 until stopped "
                                     "(frontend.exit_on_engine_death: false)", death.result())
                        death = None
                        continue
                    logger.error("engine core died (%s); exiting with status 1 "
                                 "(frontend.exit_on_engine_death)", death.result())
                    state.draining = True
                    await state.wait_idle(SETTLE_S)     # in-flight requests send their error
                    return 1
        finally:
            got_signal.cancel()
            if death is not None:
                death.cancel()

    async def _drain(self, engine: AsyncLLM, state: ServerState, name: str,
                     signals: asyncio.Queue[int]) -> None:
        timeout = self.options.drain_timeout_s
        state.draining = True
        if state.inflight:
            logger.info("%s: draining %d requests in flight (up to %g s, "
                        "frontend.drain_timeout_s; new requests get 503; signal again to stop "
                        "now)", name, state.inflight, timeout)
            again = asyncio.Event()
            forced = asyncio.ensure_future(signals.get())
            forced.add_done_callback(lambda f: again.set())
            try:
                await state.wait_idle(timeout, again)
            finally:
                forced.cancel()
            if again.is_set():
                signals.put_nowait(signal.SIGTERM)       # tells serve() to force uvicorn's exit
        else:
            logger.info("%s: shutting down", name)
        if state.inflight or engine.output_processor.has_unfinished_requests():
            why = "signalled again" if not signals.empty() else \
                f"the drain timeout of {timeout:g} s (frontend.drain_timeout_s) passed"
            n = engine.abort_all(RequestAbortedError(
                "shutdown", f"the server is shutting down ({why}); request not finished"),
                "shutdown")
            logger.warning("ended %d requests still running at shutdown (%s)", n, why)
            await state.wait_idle(SETTLE_S)
