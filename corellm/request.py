"""A request's identity and live state.

``EngineCoreRequest`` is what crosses into the engine core (plain data, serializable);
``Request`` is the scheduler's live view of it.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from corellm.lora.request import LoRARequest
from corellm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request inside the engine core.

    WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED -> WAITING -> RUNNING. A preempted
    request's KV blocks are freed and it rejoins the waiting queue under the policy's ordering, to
    be recomputed; it reads PREEMPTED until the next ``schedule()``, which makes it WAITING again
    before admitting anything.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0               # lower runs first under a priority policy (vLLM's convention)
    user: str | None = None         # tenant / end user (OpenAI's `user` field)
    session_id: str | None = None   # conversation the request continues, for session-aware policies
    # The client request this one belongs to: the samples (n) and prompts of one API call share
    # it, so the scheduler can keep one call from taking every seat. None: a group of its own.
    group_id: str | None = None
    lora_request: LoRARequest | None = None   # the adapter it runs (None: the base model)


_arrival_counter = itertools.count()


class Request:
    """Live state of one request inside the scheduler.

    ``all_token_ids`` is prompt + output so far; ``num_computed_tokens`` counts the leading tokens
    whose KV entries are in the cache or being computed by a planned step (it advances when a step
    is planned, as in vLLM); ``num_output_placeholders`` the tokens planned steps are sampling,
    not yet known. Between steps of the synchronous loop a running decode has
    ``num_tokens - num_computed_tokens == 1``; under overlapped steps, while the next step is
    planned, ``num_tokens + num_output_placeholders - num_computed_tokens == 1``.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "all_token_ids", "sampling_params", "eos_token_id",
        "arrival_time", "arrival_seq", "priority", "status", "num_computed_tokens",
        "num_preemptions", "stop_reason", "max_model_len", "num_cached_tokens",
        "first_scheduled_time", "first_token_time", "user", "session_id", "group_id",
        "num_output_placeholders", "lora_request", "lora_slot",
    )

    def __init__(self, core_request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.all_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params = core_request.sampling_params
        self.eos_token_id = core_request.eos_token_id
        self.arrival_time = core_request.arrival_time
        self.arrival_seq = next(_arrival_counter)  # total order for ties, cheaper than floats
        self.priority = core_request.priority
        self.user = core_request.user
        self.session_id = core_request.session_id
        self.group_id = core_request.group_id or core_request.request_id
        self.lora_request = core_request.lora_request
        self.lora_slot = -1             # the adapter's device slot while running (-1: none)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens being sampled by steps planned but not yet updated (1 between a step's plan
        # and its update; 2 under overlapped steps): scheduled as if known.
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.max_model_len = max_model_len
        self.num_cached_tokens = -1     # prompt tokens found in the prefix cache at first admission
        self.first_scheduled_time = 0.0  # engine clock time() at first admission
        self.first_token_time = 0.0      # engine clock time() when its first token was sampled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_output_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token and return the finished status it causes, if any."""
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        params = self.sampling_params
        num_tokens = len(all_ids)
        n_out = num_tokens - len(self.prompt_token_ids)
        if n_out >= params.min_tokens:
            if token_id == self.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
