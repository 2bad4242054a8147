"""The ``frontend`` section's options for ``name: openai``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from corellm.components import FrontendOptions

API_KEY_ENV = "CORELLM_API_KEY"


class ConstraintLimits(BaseModel):
    """What one request's output constraint (``structured_outputs``, ``response_format``) may
    ask for (``frontend.limits.constraints``): each bound is checked on the constraint's text
    before anything parses or compiles it, a 400 naming the field and the key. Parsing and
    compiling cost grows with these, some of it faster than linearly (figures: docs/server.md);
    what passes them is then checked in a process that is killed at ``check_timeout_s``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(
        1 << 20, ge=1, description="Largest constraint, in bytes of its JSON or text.")
    max_depth: int = Field(
        64, ge=1, description="Deepest nesting of objects and lists in a JSON schema, "
                              "wherever they are (a $ref may point anywhere; a property's "
                              "subschema is two deeper than its object, its name under "
                              "properties and then its schema), and in vllm_xargs.")
    max_properties: int = Field(
        1024, ge=1, description="Most object properties in a JSON schema, counted over all its "
                                "subschemas (compiling against the vocabulary grows faster "
                                "than linearly with them).")
    max_repetition: int = Field(
        2048, ge=0, description="Most atoms the counted repetitions ({m,n}) of a constraint's "
                                "regular expressions unroll to, summed over them, nested ones "
                                "multiplying: a JSON schema's patterns and patternProperties, "
                                "a regex, a grammar.")
    check_timeout_s: float = Field(
        5.0, gt=0, description="A constraint that the structured-output backend has not "
                               "finished checking (parsing) in this long is refused with a 400; "
                               "the check runs in a child process, killed then.")


class RequestLimits(BaseModel):
    """What one request may ask for (``frontend.limits``). Each bound keeps a single request
    from taking the server from everyone else; a request over one is a 400 naming the field and
    the key. ``samples`` are prompts x ``n``: each is one engine request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_samples: int = Field(
        128, ge=1, description="Most samples (prompts x n) in one request.")
    max_generated_tokens: int = Field(
        1 << 17, ge=1, description="Most tokens one request may generate: the sum of max_tokens "
                                   "over its samples (the rest of the context for each sample "
                                   "when max_tokens is not set).")
    max_stop_strings: int = Field(
        64, ge=0, description="Most stop strings in one request (OpenAI's API: 4).")
    max_stop_string_chars: int = Field(
        256, ge=1, description="Longest stop string, in characters (a stream holds back this "
                               "many characters, in case they begin a stop string).")
    max_stop_token_ids: int = Field(256, ge=0, description="Most stop_token_ids.")
    max_logprobs_total: int = Field(
        1024, ge=0, description="Most log-probability alternatives per generated position "
                                "over all samples: (logprobs or top_logprobs) x samples.")
    # What a response can grow to: each generated position is the token and, with logprobs, one
    # entry per alternative (~60 bytes each in a chat stream). max_generated_tokens and
    # max_logprobs_total bound the two factors, not their product: n=51 x 2,570 tokens x 21
    # entries passes both and streams ~274 MB from a 200-byte body.
    max_output_entries: int = Field(
        1 << 19, ge=1, description="Most entries one response may carry: the sum over its "
                                   "samples of max_tokens, times (2 + logprobs or top_logprobs) "
                                   "when log-probabilities are asked for (the token, its own "
                                   "and the alternatives'), about 60 bytes an entry (the "
                                   "default, 524,288, is about 30 MB).")
    # Each message costs the chat template's work and its framing tokens (ChatML's are five), so
    # 2048 messages already spend 10k tokens on framing: more than conversations hold. Without
    # a bound, a body under the size limit could hold tens of thousands of tiny messages, whose
    # validation and templating grow with their count and run before any length check (the
    # figures: docs/server.md).
    max_messages: int = Field(
        2048, ge=1, description="Most messages in one chat request (/v1/chat/completions, "
                                "/tokenize); a content given as a list of parts counts each "
                                "part.")
    constraints: ConstraintLimits = Field(default_factory=ConstraintLimits,
                                          description="What one output constraint may ask for.")


class ArmOptions(BaseModel):
    """One arm of a live A/B split (``frontend.arms.<name>``): replicas with a config of their
    own, and their share of the traffic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str | None = Field(
        None, description="The arm's config file; default: the server's own config.")
    set: dict[str, Any] = Field(
        default_factory=dict, description="Config keys set over it (dotted, as --set: "
                                          "{'scheduler.name': 'priority'}).")
    weight: float = Field(1.0, gt=0, le=1e9, allow_inf_nan=False,
                          description="The arm's share of the traffic, relative to the other "
                                      "arms' weights.")
    replicas: int | None = Field(
        None, ge=1, description="Engine replicas of the arm; default: its config's "
                                "parallel.data_parallel_size.")


class RouterOptions(BaseModel):
    """How a data-parallel server spreads requests over its replicas (``frontend.router``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session_affinity: bool = Field(
        True, description="Send a conversation's requests (same session_id) back to the "
                          "replica that served it, whose prefix cache holds its turns.")
    affinity_slack: int = Field(
        4, ge=0, description="...while that replica has at most this many outstanding "
                             "requests more than the least loaded one; else the load wins.")
    restart_replicas: bool = Field(
        True, description="Start a replica that died again (after a back-off of 1 s, 2 s, "
                          "5 s, 10 s, then 30 s).")
    max_restarts: int = Field(
        5, ge=0, description="Restarts in a row a replica may fail before it is given up.")


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
    limits: RequestLimits = Field(default_factory=RequestLimits,
                                  description="What one request may ask for.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="A connection that has not sent a complete request head this "
                                "long after it opened (or after the first byte of a next "
                                "request) is closed; 408 when part of a head came.")
    body_timeout_s: float = Field(
        10.0, gt=0, description="A request body must arrive within this long after its head, "
                                "plus a second for every body_min_rate bytes received; else "
                                "408 and the connection is closed.")
    body_min_rate: int = Field(
        500, ge=0, description="Bytes a second a request body must keep arriving at after "
                               "body_timeout_s (each this many bytes extend its deadline by "
                               "1 s, as Apache's mod_reqtimeout MinRate); 0: the whole body "
                               "within body_timeout_s.")
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle connection is closed this long after its last "
                               "response (keep it above a proxy's idle timeout for its "
                               "connections to this server).")
    max_connections: int | None = Field(
        None, ge=1, description="Most connections held at once; at the cap the one waiting "
                                "longest for a request head is closed to take a new one, else "
                                "the one receiving a body longest, or, if all have their whole "
                                "request in and a response in progress, the new one gets 503. "
                                "Default: "
                                "what the open-file limit (raised toward the hard limit, up to "
                                "65536) leaves after the files in use and 64 more.")
    health_timeout_s: float = Field(
        5.0, gt=0, description="/health answers 503 when the engine loop does not respond "
                               "within this time.")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM/SIGINT: how long running requests may go on "
                                "finishing (new ones get 503) before the rest are ended with an "
                                "error naming the shutdown.")
    exit_on_engine_death: bool = Field(
        True, description="Exit with status 1 when the engine core dies, so a restart-on-exit "
                          "supervisor recovers the server; false keeps answering 503.")
    allowed_hosts: list[str] | None = Field(
        None, description="Host header values served (port ignored; '*' any, '*.example.com' a "
                          "domain's hosts); others get 400. Default: the bind address, plus "
                          "localhost, 127.0.0.1 and ::1 on loopback; any host when bound to "
                          "0.0.0.0 or ::.")
    cors_allow_origins: list[str] = Field(
        default_factory=list, description="Origins allowed cross-origin requests (CORS); empty: "
                                          "CORS off.")
    log_level: str = Field("info", description="uvicorn log level.")
    tool_call_parser: str | None = Field(
        None, description="The format the model writes tool calls in: a tool_parser plugin "
                          "(built in: hermes, llama3_json, mistral, pythonic), which reads "
                          "them from the output of requests with tool_choice 'auto'.")
    enable_auto_tool_choice: bool = Field(
        False, description="Let requests with tools use tool_choice 'auto' (the default with "
                           "tools): the model decides, its calls read by tool_call_parser. "
                           "Off, such requests get a 400 (vLLM's --enable-auto-tool-choice).")
    reasoning_parser: str | None = Field(
        None, description="Split a reasoning model's thinking from its answer in every chat "
                          "response (reasoning_content): a reasoning_parser plugin (built in: "
                          "qwen3, deepseek_r1).")
    chat_template: str | None = Field(
        None, description="A Jinja chat template replacing the tokenizer's: a file's path, or "
                          "the template itself (one with '{' in it); e.g. a tool-aware "
                          "template for a model whose own template ignores tools.")
    allow_runtime_lora_updating: bool = Field(
        False, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(with lora.enable; also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as "
                           "vLLM reads it).")
    allowed_lora_paths: list[str] = Field(
        default_factory=list, description="Directories adapters may be loaded from at run "
                                          "time (a path is resolved first: no '..' or link "
                                          "leads out); empty: none.")
    arms: dict[str, ArmOptions] = Field(
        default_factory=dict, description="A live A/B split: replica groups with their own "
                                          "configs, each request's arm chosen by a weighted "
                                          "hash of its user (else session_id), so a user stays "
                                          "in one arm (corellm serve --config a=A.yaml --config "
                                          "b=B.yaml --split a=50,b=50).")
    router: RouterOptions = Field(default_factory=RouterOptions,
                                  description="Routing over data-parallel replicas.")
    metrics_prefix: Literal["corellm", "vllm"] = Field(
        "corellm", description="Names on /metrics: corellm:* (default), or vLLM's own vllm:* "
                               "names and labels, so vLLM's Grafana dashboard works unchanged.")
