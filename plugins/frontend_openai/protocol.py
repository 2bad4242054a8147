"""Request bodies of the OpenAI API (the fields corellm implements), as pydantic models.

Unknown fields are rejected, naming the field and the closest known one: a misspelt
``max_token`` silently ignored would generate 16 tokens and leave the user puzzled. Fields of
the OpenAI API that corellm does not implement are accepted only at their neutral value.
Ranges are checked once, by ``SamplingParams``, whose errors name the field; what one request
may ask for in total (samples, stop strings, tokens) by the server against ``frontend.limits``.
These models are the routes' typed bodies, so ``/openapi.json`` describes every field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI clients send explicit nulls for "not set": treat them as absent.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Strict):
    model: str | None = None
    n: StrictInt = 1                                 # at most frontend.limits.max_samples
    temperature: float | None = None
    top_p: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None                          # tenant, for scheduling policies
    logit_bias: dict[str, float] | None = None       # not implemented: only empty accepted
    # vLLM's extensions
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    priority: StrictInt = 0
    session_id: str | None = None                    # corellm's: for session-aware policies
    cache_salt: str | None = None
    # Echoed in the id of every response (and every chunk of every sample of a stream): bounded
    # like user and session_id, so a client cannot multiply its own bytes into the output.
    request_id: str | None = Field(None, min_length=1, max_length=256)


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False                         # not implemented: only false accepted
    best_of: StrictInt | None = None                 # accepted when equal to n
    suffix: str | None = None                        # not implemented: only null accepted


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, ...) on history messages are ignored, as OpenAI does.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None              # deprecated by OpenAI, still sent by many
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None    # only {"type": "text"}
    tools: list[Any] | None = None                   # not implemented: only null / []
    tool_choice: Any = None                          # only "none" / "auto"
    parallel_tool_calls: StrictBool | None = None    # meaningless without tools
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


# --------------------------------------------------------------------------- vLLM's extras
class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a ``prompt``: the ids the model would see for it."""
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with ``messages``: rendered by the chat template, as
    /v1/chat/completions renders them."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False           # only false: the template writes them
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None                   # not implemented: only null / []
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]
