"""The ``frontend`` section's options for ``name: openai``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corellm.components import FrontendOptions

API_KEY_ENV = "CORELLM_API_KEY"


class OpenAIServerOptions(FrontendOptions):
    name: str = "openai"
    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 exposes the server "
                                               "to the network.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    api_key: str | None = Field(
        None, min_length=1, description=f"Require 'Authorization: Bearer <key>' on every /v1 route "
                          f"(also read from ${API_KEY_ENV}).")
    served_model_name: str | None = Field(
        None, description="The model name clients send; default: the checkpoint directory's "
                          "name, or a GGUF file's without its quantization suffix "
                          "(corellm-demo for the random demo model).")
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger is HTTP 413.")
    health_timeout_s: float = Field(
        5.0, gt=0, description="/health answers 503 when the engine loop does not respond "
                               "within this time.")
    log_level: str = Field("info", description="uvicorn log level.")
    metrics_prefix: Literal["corellm", "vllm"] = Field(
        "corellm", description="Names on /metrics: corellm:* (default), or vLLM's own vllm:* "
                               "names and labels, so vLLM's Grafana dashboard works unchanged.")
