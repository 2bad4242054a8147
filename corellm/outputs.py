"""The data that flows through one engine step, and what callers receive.

SchedulerOutput (the plan) -> ModelRunnerOutput (sampled ids, logprobs) -> EngineCoreOutput
(per-request delta) -> RequestOutput / CompletionOutput.
The step-plan types are plain data so an executor can ship them to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from corellm.lora.request import LoRARequest
from corellm.sampling_params import SamplingParams


# --------------------------------------------------------------------------- the step plan
@dataclass
class NewRequestData:
    """A request the workers have no state for: first scheduled, or resumed after preemption."""

    req_id: str
    token_ids: list[int]          # prompt + output so far: everything that may need computing
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    lora_slot: int = -1           # the device slot of its LoRA adapter (-1: the base model)


@dataclass
class CachedRequestData:
    """A running request the workers already hold that got new KV blocks this step (a request
    that got none is not listed: its context is in ``SchedulerOutput.num_computed_tokens``)."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    """The plan for one step: which requests run, with how many new tokens each."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]      # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # Requests whose worker-side state must be dropped before this step runs: finished, aborted
    # or preempted since the last step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # What an executor needs to know of each scheduled request without keeping state of its own
    # (a simulated executor prices a step from these alone): the tokens of its context already in
    # the KV cache before this step (same keys, same order as num_scheduled_tokens), and the
    # requests that reach the end of their known tokens this step, so a token is sampled for
    # each (a partial prefill chunk samples nothing), in plan order.
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    sampling_req_ids: list[str] = field(default_factory=list)
    # LoRA adapters to load into device slots before this step runs: slot -> adapter (a slot
    # is reassigned only when no running request uses its adapter).
    lora_loads: dict[int, LoRARequest] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# --------------------------------------------------------------------------- worker results
class LogprobsLists(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per sampled row: ``token_ids[i][0]`` is the sampled token, the rest the top-N, best first.

    A msgspec struct (like ``EngineCoreOutput``): it crosses the engine-core process boundary
    every step, encoded as a compact msgpack array.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_ranks: list[int]      # 1-based rank of the sampled token in the full distribution


@dataclass
class ModelRunnerOutput:
    """What the workers return for one step: a sampled token for every request that reached the
    end of its known tokens (a partial prefill chunk samples nothing)."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: LogprobsLists | None = None
    # Seconds spent in the worker's phases this step: "prepare_inputs", "forward", "sample".
    timings: dict[str, float] = field(default_factory=dict)
    # Plugin API 1.4: requests the worker could not serve this step (a logits processor's
    # RequestsFailed), with why; they are not in req_ids, and the engine ends them ("error"),
    # the reason as their stop_reason. A reason that starts with INVALID_REQUEST blames the
    # request, one with SERVER_BUSY the server's load (plugin API 1.5).
    failed: dict[str, str] = field(default_factory=dict)
    # Plugin API 1.4: requests whose row was not sampled because a logits processor was not
    # ready for it (a grammar still compiling): not in req_ids; the scheduler has them compute
    # their last token again next step.
    deferred: list[str] = field(default_factory=list)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

# The start of the reason (the stop_reason of a request that ended with finish reason "error")
# when the request itself is at fault, followed by the field and why: "invalid_request:
# structured_outputs.json: ...". A server answers it with a 400 naming the field.
INVALID_REQUEST = "invalid_request: "
# ... and when the server was too busy with other requests' work to serve it in time: a 503.
SERVER_BUSY = "server_busy: "


# --------------------------------------------------------------------------- core -> client
class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The per-step delta of one request. ``num_cached_tokens`` and ``first_scheduled_time``
    come with a request's first token and its final output (0 in the others, which are most:
    a step's outputs carry only what changed)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0           # prompt tokens served from the prefix cache
    # time.time() when the core first scheduled the request (queue time = this - arrival);
    # 0.0 for a request that was never scheduled (aborted while waiting).
    first_scheduled_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine-core iteration produced (what an engine-core client receives)."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    stats: list[StepStats] = []     # the engine's observability records since the last send


# --------------------------------------------------------------------------- what callers get
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) of one request, as its caller observed them."""

    arrival_time: float
    first_token_time: float | None = None     # first token of any of the n samples
    finished_time: float | None = None        # last sample finished
    first_scheduled_time: float | None = None  # the core first scheduled it (end of queueing)
    last_token_time: float | None = None
    num_generation_tokens: int = 0            # over the n samples
    # Gaps between consecutive arrivals of new tokens (one per engine output that carried
    # tokens after the first); they sum to last_token_time - first_token_time.
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return (None if self.first_scheduled_time is None
                else self.first_scheduled_time - self.arrival_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Mean inter-token time after the first token (TPOT); None below two tokens."""
        if self.first_token_time is None or self.last_token_time is None \
                or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # Prompt tokens whose KV came from the prefix cache (the most over the n samples).
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


# --------------------------------------------------------------------------- observability
@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and its KV pool."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    num_prompt_tokens: int = 0          # prompt tokens of the admitted requests, each once
    num_generation_tokens: int = 0
    # Tokens run through the model other than decodes: prompts, minus prefix-cache hits, plus
    # recomputation after preemption.
    num_prefill_tokens: int = 0
    prefix_cache_queries: int = 0       # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0          # tokens of those found there
    kv_blocks_cached: int = 0           # blocks findable in the prefix cache (held or free)
    # With LoRA on: adapter name -> its running requests, and its waiting ones.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class EngineStats(SchedulerStats):
    """What ``LLM.get_stats()`` returns: the scheduler snapshot plus engine counters."""

    num_steps: int = 0
    # Cumulative seconds per phase of the step loop: schedule, prepare_inputs, forward, sample,
    # update; "execute" is prepare_inputs + forward + sample as the engine sees them (executor
    # overhead included) and "step" is the whole of EngineCore.step().
    timings: dict[str, float] = field(default_factory=dict)


class FinishedRequestStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's life as the engine core saw it, on its clock (``StepStats.finished``).

    Times are the engine clock's ``time()``: wall time for a real run, virtual time for a
    simulated one; 0.0 means "never" (a request aborted while waiting was never scheduled)."""

    request_id: str
    finish_reason: str                    # "stop" | "length" | "abort" | "error"
    arrival_time: float
    finished_time: float
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float | None:
        return self.first_scheduled_time - self.arrival_time if self.first_scheduled_time \
            else None

    @property
    def time_to_first_token(self) -> float | None:
        return self.first_token_time - self.arrival_time if self.first_token_time else None

    @property
    def e2e_latency(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first; None below two tokens."""
        if not self.first_token_time or self.num_generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


class StepStats(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The engine's one observability record: produced by the engine core after every step
    that scheduled work (``kind="step"``) and after aborts and prefix-cache resets between steps
    (``kind="event"``, nothing scheduled), so the last one always describes the engine as it is.

    Every consumer reads these: plugins through ``corellm_step_finished`` (in the engine's
    process), and, through ``EngineCore.add_stats_listener``, the server's ``/metrics`` (the
    records cross to the API process with the outputs) and ``corellm bench``, whether the
    executor is real or simulated. A msgspec struct: it crosses the process boundary every step.
    """

    step: int
    num_scheduled_reqs: int
    num_scheduled_tokens: int
    num_finished_reqs: int
    timings: dict[str, float]
    scheduler: SchedulerStats
    engine_id: str = ""          # the engine that ran the step (EngineCore.engine_id)
    timestamp: float = 0.0       # the engine clock's time() when the step ended
    duration: float = 0.0        # seconds the step took on the engine clock (simulated: predicted)
    kind: str = "step"           # "step", or "event" for a change between steps
    num_prefill_tokens: int = 0  # of num_scheduled_tokens: tokens of requests computing > 1
    num_decode_reqs: int = 0     # requests computing exactly one token (decodes)
    finished: list[FinishedRequestStats] = []    # requests that ended in this step or event
