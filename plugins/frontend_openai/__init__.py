"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): ``frontend: {name: openai}``."""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import BuildContext, FrontendSpec
from corellm.interfaces import Frontend

from .options import OpenAIServerOptions


def _make(options: OpenAIServerOptions, ctx: BuildContext) -> Frontend:
    from .server import OpenAIServer       # heavy imports (fastapi, zmq) only when selected
    return OpenAIServer(options, ctx)


@hookimpl
def corellm_frontends() -> Iterator[FrontendSpec]:
    yield FrontendSpec(name="openai", factory=_make, options=OpenAIServerOptions,
                       summary="OpenAI-compatible HTTP server: /v1/completions, "
                               "/v1/chat/completions, streaming, /metrics")
