"""The FastAPI app: the guard, the routes and ``/openapi.json`` over one ``OpenAIServing``, each
route's failures answered in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

import corellm
from corellm.engine.async_llm import AsyncLLM
from corellm.engine.ipc import EngineDeadError
from corellm.engine.replicas import ROUTED, ReplicaUnavailableError
from corellm.errors import InvalidRequestError, RequestAbortedError

from .body import _OpenAIRoute
from .errors import APIError, _aborted, _invalid
from .guard import _KEYED_ROUTES, ServerState, _Guard, default_allowed_hosts
from .metrics import EngineMetrics
from .openapi import (HEALTH_ERRORS, HOST_ERROR, REQUEST_ERRORS, ChatCompletion,
                      ChatCompletionChunk, Completion, CompletionChunk, DetokenizeResponse,
                      ModelList, TokenizeResponse, Version, json_body, responses)
from .openapi import install as install_openapi
from .options import API_KEY_ENV, OpenAIServerOptions
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeChatRequest, TokenizeCompletionRequest)
from .serving import OpenAIServing

logger = logging.getLogger("corellm.server")


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


async def _group_health(group: Any, timeout: float) -> Response:
    """A data-parallel server's /health: 200 while any replica answers (the router sends
    around the others), 503 when none does; the body lists each replica."""
    from fastapi.responses import JSONResponse
    health = await group.replica_health(timeout)
    replicas = [{"replica": rep.index, **({"arm": rep.arm} if rep.arm else {}),
                 "state": "up" if ok else rep.state if rep.state != "up" else "unresponsive",
                 **({"where": rep.where} if rep.where else {}),
                 **({"error": why} if why else {})} for rep, ok, why in health]
    if any(ok for _, ok, _ in health):
        return JSONResponse({"status": "ok", "replicas": replicas})
    return APIError(503, "engine unavailable: no replica answers: " + "; ".join(
        f"replica {r['replica']}: {r.get('error', r['state'])}" for r in replicas),
        code="engine_dead").response()


def _route_headers(response: Response, routed: dict[str, Any]) -> Response:
    """The arm (of an A/B split) and the replica that served the request, as headers."""
    if routed.get("arm"):
        response.headers["X-Corellm-Arm"] = routed["arm"]
    if routed.get("replica") is not None:
        response.headers["X-Corellm-Replica"] = str(routed["replica"])
    return response


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
        routed: dict[str, Any] = {}
        ROUTED.set(routed)         # the work's task shares the dict: the replicas fill it
        return _route_headers(await _run(request, work), routed)

    async def _run(request: Request, work: Awaitable[Response]) -> Response:
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
            status = 503 if was_dead or isinstance(exc, ReplicaUnavailableError) else 500
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
        return metrics.count_response(await run(request, serving.completions(body)))

    @app.post("/v1/chat/completions", responses=responses(json_body(
        "The chat completion; with stream: true, its chunks as server-sent events.",
        ChatCompletion, stream=ChatCompletionChunk), REQUEST_ERRORS))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return metrics.count_response(await run(request, serving.chat(body)))

    @app.post("/tokenize", openapi_extra=_tokenize_body_schema(), responses=responses(
        json_body("The token ids.", TokenizeResponse), REQUEST_ERRORS))
    async def tokenize(request: Request) -> Response:
        return await run(request, serving.tokenize(await request.json()))

    @app.post("/detokenize", responses=responses(
        json_body("The text of the tokens.", DetokenizeResponse), REQUEST_ERRORS))
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await run(request, serving.detokenize(body))

    @app.get("/v1/models", response_model=None, responses=responses(
        json_body("The served model, then its LoRA adapters (their parent: the model).",
                  ModelList), HOST_ERROR))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": serving.loras.cards(serving.created,
                                                              serving.max_model_len)}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=responses(
        {"description": "The adapter is served under its name."}, REQUEST_ERRORS))
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: ``{"lora_name", "lora_path"}``; 404 unless runtime updating is on."""
        return PlainTextResponse(serving.loras.load(await _json_body(request)))

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=responses(
        {"description": "The adapter's name is no longer served."}, REQUEST_ERRORS))
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: ``{"lora_name"}``; requests already running on it finish."""
        return PlainTextResponse(serving.loras.unload(await _json_body(request)))

    # response_class: a 200 without a body, which FastAPI would document as JSON.
    @app.get("/health", response_class=Response, responses=responses(
        {"description": "The engine is alive and its loop answers."}, HEALTH_ERRORS))
    async def health() -> Response:
        if getattr(engine, "replicas", None):
            return await _group_health(engine, options.health_timeout_s)
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


async def _json_body(request: Request) -> Any:
    """The request's JSON body; a 400 when it is not JSON."""
    import json
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the body is not valid JSON") from None
