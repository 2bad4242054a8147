"""The interfaces every plugin kind implements.

The engine core talks to components only through these. Shared mechanism that several
implementations need (the batching scheduler, the block pool) lives in the core as a library
(``corellm.scheduling``, ``corellm.kv.block_pool``) that plugins compose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corellm.clock import WALL_CLOCK, Clock
# Public here too: the KV-cache manager's prefix lookup returns it.
from corellm.policy_view import NO_CACHED_PREFIX, CachedPrefix  # noqa: F401
from corellm.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from corellm.attention import AttentionBuildLimits, AttentionMetadataBuilder, KVCacheSpec
    from corellm.outputs import (EngineCoreOutput, ModelRunnerOutput,
                                 SchedulerOutput, SchedulerStats)
    from corellm.request import Request
    from corellm.policy_view import SchedulingContext, WaitingQueue
    from corellm.sampling import SamplerOutput, SamplingMetadata
    from corellm.sampling_params import SamplingParams
    from corellm.tool_calls import ParsedReasoning, ParsedToolCalls


class Scheduler(ABC):
    """Decides, each step, which requests run and how many tokens each computes.

    The engine assigns ``clock`` (its own ``corellm.clock.Clock``) once the scheduler is built:
    a scheduler reads the time from it, never from ``time``, so it runs unchanged on the
    virtual time of a simulated executor. ``schedule()`` fills every field of the plan,
    ``num_computed_tokens`` and ``sampling_req_ids`` included: executors rely on them.
    """

    clock: Clock = WALL_CLOCK
    #: Plugin API 1.6: whether ``schedule()`` may plan step N+1 before step N's output is
    #: given to ``update_from_output`` (overlapped steps, ``scheduler.async_scheduling``). Such
    #: a scheduler counts a step's tokens as computed when it plans them, and schedules the
    #: tokens its planned steps are sampling (``Request.num_output_placeholders``) as if they
    #: were known; ``update_from_output`` may then see a request the next plan preempted.
    #: False (the default, a scheduler written for the synchronous loop): the engine runs
    #: steps one at a time, and logs why.
    supports_async_scheduling: bool = False

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       ) -> list[EngineCoreOutput]:
        """Finish the named unfinished requests with ``status`` (aborted, or error when a step
        failed), free their KV blocks, and return their final outputs. Unknown ids are ignored."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_request_ids(self) -> list[str]:
        """Ids of every unfinished request (waiting, preempted or running)."""

    @abstractmethod
    def get_stats(self) -> SchedulerStats: ...


class SchedulingPolicy(ABC):
    """The decisions of a scheduling policy; the core's ``BatchScheduler`` does the rest.

    A policy decides four things, each with the live state in ``ctx`` (a
    ``corellm.scheduling.SchedulingContext``: the time, the running and waiting requests, this
    round's admissions and remaining token budget, lazily looked-up cached prefixes):

    * **order**: ``waiting_key`` ranks a request when it enters the waiting queue (a heap, so
      static orders cost O(log n)); ``select`` picks the request to admit next, by default the
      best key, and may re-rank a few candidates with live state;
    * **admission**: ``can_admit`` may hold the chosen request back while others run;
    * **preemption under pressure**: ``choose_victim`` picks the running request to preempt when
      KV blocks run out;
    * **preemption for a waiting request**: ``preempt_for`` may name a running request to make
      room for the chosen waiting one when the batch or the KV pool is full.

    The mechanism owns every state transition and block: whatever a policy returns, no block
    leaks and no request is lost, and with nothing running the best waiting request is
    admitted whatever the policy says, so a policy cannot stall the engine. An answer that is
    not one of the offered requests is an error that names the policy.

    The mechanism also keeps one client request from taking the batch, whatever the policy:
    while requests of other groups wait, a group (``Request.group_id``: the samples and prompts
    of one API call) at its share of seats (``scheduler.max_num_seqs_per_request``) is passed
    over by admission, and one over its share gives up its newest running request to a
    request that does not fit when ``preempt_for`` names no victim.
    """

    @abstractmethod
    def waiting_key(self, request: Request, ctx: SchedulingContext) -> Any:
        """Sort key of ``request`` in the waiting queue: the smallest key is admitted first.

        Called each time the request enters the queue (on arrival and after a preemption).
        Keys must be comparable among themselves; ties are broken by arrival order.
        """

    @abstractmethod
    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        """Pick the request to preempt when KV blocks run out. ``running`` is a read-only
        snapshot (a tuple) in admission order; the answer must be one of it. While one client
        request (``Request.group_id``) holds more than its share of seats
        (``scheduler.max_num_seqs_per_request``) and others run or wait, only its requests are
        offered."""

    def queue_group(self, request: Request) -> Hashable:
        """Partition of the waiting queue ``request`` joins (e.g. its tenant), so ``select`` can
        see each group's best request with ``waiting.heads()`` in O(groups). Default: one
        group."""
        return None

    def select(self, waiting: WaitingQueue, ctx: SchedulingContext) -> Request | None:
        """The waiting request to consider for admission next (called while ``waiting`` is not
        empty); None admits nothing more this step. Default: the best key, ``waiting.first()``.

        A live-state policy re-ranks a bounded set of candidates here, such as
        ``waiting.best(k)`` or ``waiting.heads()``, with ``ctx.cached_tokens`` or ``ctx.now``.
        """
        return waiting.first()

    def can_admit(self, request: Request, ctx: SchedulingContext) -> bool:
        """Whether the selected request may start now, given ``ctx.running``. Default: whenever
        it fits. Consulted only while something is running, so a policy can delay a request but
        never stall the engine."""
        return True

    def preempt_for(self, request: Request, running: Sequence[Request],
                    ctx: SchedulingContext) -> Request | None:
        """The selected waiting ``request`` does not fit (``max_num_seqs`` running, or too few
        free KV blocks): return a request of ``running`` to preempt for it, or None to wait.
        Called again after each preemption until it fits or the answer is None. Default: None.
        """
        return None

    def on_scheduled(self, scheduled: Sequence[tuple[Request, int]],
                     ctx: SchedulingContext) -> None:
        """After each ``schedule()``, the requests planned for the step and how many tokens each
        computes (accounting such as tokens served per tenant). Not called when not
        overridden."""

    def on_finished(self, request: Request, ctx: SchedulingContext) -> None:
        """``request`` left the scheduler for good (finished, aborted or failed): drop any state
        kept for it. Not called when not overridden."""


class KVCacheManager(ABC):
    """Owns the mapping from requests to KV-cache blocks (bookkeeping only: the tensors live in
    the workers). Every block a request holds returns to the pool on ``free``.

    The scheduler drives it in this order for each request: ``find_cached_prefix`` (admission
    only), ``allocate_slots`` before every step that computes tokens for the request,
    ``cache_computed_blocks`` after it, ``free`` when the request finishes or is preempted.
    A manager without prefix caching keeps the defaults of the three prefix-cache methods.
    """

    block_size: int
    num_blocks: int
    #: Plugin API 1.6: True for a manager whose ``allocate_slots`` for a running request
    #: changes nothing unless the new tokens reach past the blocks it holds or complete a
    #: block, and whose ``cache_computed_blocks`` changes nothing unless a block was completed
    #: since its last call: the scheduler then makes those calls only at block boundaries (a
    #: decode step of a request in the middle of a block makes neither). False (the default):
    #: every step, in the order above.
    block_calls_only: bool = False
    prefix_cache_queries: int = 0     # tokens of the admitted requests looked up in the cache
    prefix_cache_hits: int = 0        # tokens of those found there (not computed)

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now, including evictable cached ones."""

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable in the prefix cache, held or free."""
        return 0

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Look up a waiting request's longest cached prefix. Changes nothing: the hit is taken
        only by ``allocate_slots(request, n, prefix)``, right after."""
        return NO_CACHED_PREFIX

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        For a running request the computed tokens are ``request.num_computed_tokens``. At
        admission the scheduler passes the ``prefix`` it looked up: the request holds nothing yet,
        its blocks become ``prefix.block_ids`` plus fresh ones for ``prefix.num_tokens +
        num_new_tokens`` tokens, and the scheduler then sets ``num_computed_tokens`` to
        ``prefix.num_tokens``. Returns the fresh block ids (possibly empty), or ``None`` when the
        pool cannot satisfy the request, in which case nothing changed.
        """

    def cache_computed_blocks(self, request: Request) -> None:
        """Called after each step that computed tokens for ``request`` (``num_computed_tokens``
        already advanced): make its newly completed blocks findable by later requests."""

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Returns False, changing nothing, while blocks are held."""
        return True

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release every block the request holds. Idempotent."""

    @abstractmethod
    def get_block_ids(self, request: Request) -> list[int]: ...


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Static facts about one attention layer, given to the backend at every call.

    ``sliding_window``: the query at position p attends to the keys at positions
    ``p - sliding_window + 1 .. p`` (the window counts the query's own token, as in Hugging
    Face's Mistral and Qwen2); None for full attention. ``logit_soft_cap``: scores become
    ``cap * tanh(scores / cap)`` before the softmax (Gemma 2, Grok); None for none. A backend
    that does not support a feature a layer uses says so in ``AttentionBackend.supports``, and
    the model runner refuses the model at start-up.
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    logit_soft_cap: float | None = None


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and computes attention over it.

    At start-up the model runner asks the backend, for every layer of the model, whether it
    ``supports`` it (head size, dtype, device, features), what its KV cache is
    (``kv_cache_spec``), and for the step's metadata builder (``make_metadata_builder``); then,
    each step, the builder turns the runner's common facts into the metadata every layer's
    ``forward`` receives.
    """

    def supports(self, layer: AttentionLayerSpec, dtype: torch.dtype,
                 device: torch.device) -> str | None:
        """Why the backend cannot run ``layer`` in ``dtype`` on ``device`` (naming the value and
        what is supported), or None when it can. Called once per layer at start-up: a refusal
        there is a config error, never a failure mid-serving. The default refuses the optional
        features (sliding window, logit soft-cap), which a backend supporting them must declare
        by overriding this."""
        if layer.sliding_window is not None:
            return (f"sliding_window={layer.sliding_window} is not supported (the backend "
                    "computes full attention)")
        if layer.logit_soft_cap is not None:
            return f"logit_soft_cap={layer.logit_soft_cap:g} is not supported"
        return None

    @abstractmethod
    def kv_cache_spec(self, layer: AttentionLayerSpec, num_blocks: int, block_size: int,
                      dtype: torch.dtype) -> KVCacheSpec:
        """One layer's KV cache (``corellm.attention.KVCacheSpec``: shape in the backend's own
        layout, K and V together; dtype; whether it must be zero-filled) for ``num_blocks``
        blocks of ``block_size`` tokens, for a model running in ``dtype``.

        The model runner allocates one tensor per layer on the worker's device and the model
        binds it to the layer. It also calls this with ``num_blocks=1`` to size the pool, so
        the size must be proportional to ``num_blocks``. ``layer.num_kv_heads`` is per
        worker."""

    def make_metadata_builder(self, limits: AttentionBuildLimits) -> AttentionMetadataBuilder:
        """The per-step metadata builder (called once per worker). Default: the core's
        ``CommonMetadataBuilder``, whose ``AttentionMetadata`` holds the common facts as int64
        device tensors and host lists."""
        from corellm.attention import CommonMetadataBuilder
        return CommonMetadataBuilder(limits)

    @abstractmethod
    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> output [T, H, D] in the query's dtype
        (T: tokens this step, in the builder's batch order; inputs may be non-contiguous
        views; ``metadata``: what the builder returned this step).

        Writes key/value into ``kv_cache`` at the step's slots first, then attends over each
        request's cached context plus its new tokens, causally, with grouped-query attention
        (query head h reads KV head h // (H // Hkv)), ``layer.scale`` and the layer's window
        and soft-cap. One backend object serves every layer: per-layer state is keyed by
        ``layer.layer_idx``."""


class Sampler(ABC):
    """Turns the logits of the rows that sample into token ids (and logprobs when asked).

    ``__call__(logits, metadata)``: ``logits`` [N, V] float32 on the worker's device, one row
    per request that samples this step, in the order of ``metadata``'s per-row fields. Returns
    ``SamplerOutput`` with ``sampled_token_ids`` [N] int64 on the same device and, when
    ``metadata.max_num_logprobs`` is not None, ``LogprobsTensors`` with that many top tokens.
    A sampler must never sample a token of ``metadata.banned_token_ids[row]`` (that is how
    ``min_tokens`` holds stop tokens back): the model runner checks every output and fails the
    step, naming the plugin, when one was. It applies the penalties (``apply_penalties``),
    treats rows of temperature 0 as greedy (the first maximum, ``greedy``) and draws seeded rows
    from their own generator. ``corellm.sampling`` has each of these as a function; the factory
    runs in every worker, and only rank 0 calls the sampler. docs/plugins.md, "A sampler", has
    the whole contract."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput: ...


class LogitsProcessor(ABC):
    """Plugin API 1.4: changes the logits of the requests that use it, before the sampler.

    Built once in the worker that samples (rank 0), by its spec's factory. Each request it
    constrains has a state of its own, made by ``new_request`` when the request reaches the
    worker: at its first step, and again after a preemption (the worker drops a preempted
    request and recomputes it), when ``output_token_ids`` holds the tokens it kept, which the
    state replays. Each step, ``apply`` gets the logits of the rows that sample (float32
    [N, V] on the worker's device) and constrains its own rows in place, all of them in one
    call; rows of other requests are not its to touch. After the sampler, ``accept`` advances a
    state by the token its row sampled. A state that is not ``ready`` (a grammar still
    compiling) holds its request back a step without holding the batch. An exception from a
    method ends the requests it concerns (finish reason "error"), not the batch.
    docs/plugins.md, "A logits processor", has the whole contract.
    """

    @abstractmethod
    def new_request(self, req_id: str, params: SamplingParams,
                    prompt_token_ids: Sequence[int],
                    output_token_ids: Sequence[int]) -> Any | None:
        """The state of a request this processor constrains, None for one it leaves alone (it
        decides from ``params``: ``structured_outputs``, its own keys of ``extra_args``). Must
        be quick: slow preparation (compiling a grammar) belongs in the background, awaited by
        ``apply`` when the request first samples."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[Any]) -> None:
        """Constrain ``logits[rows[i]]`` for ``states[i]``, in place (a banned token's logit
        becomes ``-inf``). A request that cannot be served (its grammar failed to compile, or
        took longer than the processor allows) is named in a ``RequestsFailed``: those requests
        end with finish reason "error", the rest of the batch samples as usual."""

    def ready(self, state: Any) -> bool:
        """Whether ``state`` can constrain its row this step (its grammar is compiled). A row
        that is not ready is not sampled: the request computes its last token again next step,
        while the rest of the batch goes on. Answer at once; never wait here. Default: True."""
        return True

    def accept(self, state: Any, token_id: int) -> bool:
        """Advance ``state`` by the token its row sampled; False when the state rejects it (the
        request then goes on unconstrained, and the worker logs it). Default: True."""
        return True

    def free(self, state: Any) -> None:
        """The request finished, was aborted or preempted: release what ``state`` holds."""


class RequestsFailed(Exception):
    """Raised by ``LogitsProcessor.apply`` for requests it cannot serve: ``failed`` maps their
    ids to the reason, and only they end (finish reason "error").

    Plugin API 1.5: ``invalid`` maps the ids of requests that cannot be served because of what
    they ask (a grammar that does not compile within the processor's deadline) to a reason that
    starts with the request field at fault (``"structured_outputs.json: ..."``), and ``busy``
    those that could not be served in time because of others' work (a compile queue too long):
    they end the same way, and a server answers them with a 400, or a 503 to retry, not a 500.
    """

    def __init__(self, failed: dict[str, str], invalid: dict[str, str] | None = None,
                 busy: dict[str, str] | None = None) -> None:
        everything = {**failed, **(invalid or {}), **(busy or {})}
        super().__init__("; ".join(f"{rid}: {why}" for rid, why in everything.items()))
        self.failed = failed
        self.invalid = invalid or {}
        self.busy = busy or {}


class Executor(ABC):
    """Runs the workers: one in-process, one process per tensor-parallel rank, or none at all
    (a simulation). The engine core makes one call per step, ``execute_model``, and reaches the
    workers for everything else through ``collective_rpc``.

    ``clock``: None for an executor that runs a model (the engine runs on the wall clock); an
    executor that simulates its steps returns a ``corellm.clock.VirtualClock`` it advances by
    each step's duration, and the engine (scheduler, statistics, ``corellm bench``) runs on it.
    """

    clock: Clock | None = None

    @property
    def max_concurrent_batches(self) -> int:
        """Plugin API 1.6: how many steps the engine may have in this executor at once. 2
        (overlapped steps, ``scheduler.async_scheduling``): ``execute_model`` is called for
        step N+1 before step N's output is taken, and the executor runs the steps in order,
        each worker appending step N's sampled tokens to its requests before it prepares step
        N+1 (the plan of step N+1 schedules those tokens without knowing them). 1 (the
        default): one step at a time."""
        return 1

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call ``method`` of every worker (``corellm.worker.Worker``) and return their results,
        rank 0 first: loading, memory profiling, KV-cache set-up, anything a plugin adds."""

    def determine_num_kv_blocks(self) -> int:
        """KV blocks every worker can hold: the smallest of what each measures (its share of
        the heads, its memory)."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run the step: forward pass on every worker and sampling on rank 0. Returns rank 0's
        output, or a future of it (the engine waits on it; an executor with worker processes
        hands the wait back, so a failure can surface as the future's exception)."""

    @property
    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    def shutdown(self) -> None:
        """Release workers. Idempotent."""


class ExecutorError(RuntimeError):
    """The executor cannot go on (a worker died or raised): the engine fails every unfinished
    request with it and stops. The message names the rank and the cause."""


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about the loaded model."""

    vocab_size: int
    max_model_len: int
    architecture: str
    # With LoRA on: the modules an adapter may target (checkpoint module name -> its full
    # (in_features, out_features)), what a request's adapter is checked against before it runs.
    lora_targets: dict[str, tuple[int, int]] | None = None


class Frontend(ABC):
    """Serves the engine to the outside world (e.g. an OpenAI-compatible HTTP server)."""

    @abstractmethod
    def run(self) -> int | None:
        """Serve until asked to stop; return the process's exit status (None: 0). A front end
        whose engine died returns non-zero, so a restart-on-exit supervisor recovers it."""


class ToolParser(ABC):
    """Plugin API 1.8: turns a model's generated text into tool calls, in the model family's
    format (``<tool_call>`` JSON, ``[TOOL_CALLS]``, Python calls...). One instance per choice,
    made by the spec's ``factory(tools)`` with the request's ``tools`` (OpenAI's list of
    ``{"type": "function", "function": {name, description, parameters}}``).

    ``parse`` is all a parser implements: the core calls it on the whole text so far, each time
    the text grows while streaming and once at the end (``final``), and makes OpenAI's deltas
    and message of the results (``corellm.serving.chat_output``), so the streamed deltas
    concatenate to the message. The prefix rule (``corellm.tool_calls.ParsedToolCalls``) is
    the parser's one obligation; ``corellm.serving.partial_json`` reads JSON that is still
    being generated.
    """

    def __init__(self, tools: Sequence[dict] | None = None) -> None:
        self.tools = list(tools or ())

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        """The calls and the content in ``text``. While not ``final``, ``content`` leaves out
        a trailing part that could still become a call (a partial start tag) and a call's
        ``arguments`` hold its JSON text so far. When ``final``, raise
        ``corellm.tool_calls.ToolParseError`` saying why for text with a malformed call."""


class ReasoningParser(ABC):
    """Plugin API 1.8: splits a reasoning model's thinking from its answer (``<think>`` ...
    ``</think>``). One instance per choice, made by the spec's ``factory()``. ``parse`` as
    ``ToolParser.parse``: called on the whole text so far, prefix-stable while not final.

    ``end_marker``: the text that ends the reasoning (``"</think>"``), for structured outputs
    and tool calls that apply to the answer only."""

    end_marker: str = ""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedReasoning:
        """The reasoning and the answer in ``text``."""


class CausalLM(ABC):
    """What a model plugin's factory returns: a ``torch.nn.Module`` that also derives from this.

    The model runner owns the KV-cache tensors and hands each attention layer its slice through
    ``bind_kv_caches``; attention metadata travels as a forward argument, never as global state.
    """

    num_layers: int
    num_kv_heads: int       # per worker (after tensor-parallel sharding)
    head_size: int

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] (float32)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (checkpoint name, tensor) pairs; raise on anything missing or unexpected."""

    @abstractmethod
    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None: ...

    def attention_layers(self) -> list[AttentionLayerSpec]:
        """The spec of every attention layer, by ``layer_idx`` (the runner checks each against
        the backend and allocates each its KV cache). Default: those of the model's
        ``corellm.layers.Attention`` modules; a model attending through other modules
        overrides this."""
        return attention_layer_specs(self)


def attention_layer_specs(model: Any) -> list[AttentionLayerSpec]:
    """The specs of ``model``'s ``corellm.layers.Attention`` modules, by layer index. (Known by
    the class attribute ``is_attention_layer`` that ``Attention`` sets, which its subclasses
    inherit: this layer cannot import the layer library.)"""
    layers = sorted((m.spec for m in model.modules()
                     if getattr(type(m), "is_attention_layer", False)),
                    key=lambda s: s.layer_idx)
    if [s.layer_idx for s in layers] != list(range(len(layers))) or not layers:
        raise ValueError(f"{type(model).__name__}: attention layers "
                         f"{[s.layer_idx for s in layers]}; expected 0..n-1, one each (a model "
                         "that attends through other modules overrides attention_layers())")
    return layers
