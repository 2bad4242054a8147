"""The engine core: components composed from the config, and the step loop."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from corellm.clock import WALL_CLOCK, Clock
from corellm.components import BuildContext
from corellm.config.compose import EngineConfig
from corellm.errors import ConfigError, PluginError
from corellm.interfaces import (Executor, ExecutorError, KVCacheManager,
                                ModelInfo, Scheduler)
from corellm.config.logits_processors import enabled_logits_processors
from corellm.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, EngineCoreOutput, EngineStats, FinishedRequestStats,
                             ModelRunnerOutput, SchedulerOutput, StepStats)
from corellm.engine.ipc import EngineDeadError
from corellm.plugins.conformance import check_kv_cache_manager
from corellm.plugins.discovery import Registry
from corellm.request import EngineCoreRequest, Request, RequestStatus
from corellm.config.setup import EngineSetup, resolve_setup

logger = logging.getLogger(__name__)


_ENGINE_SEQ = itertools.count()


class _Launched:
    """A step handed to the executor: its plan, its output (or a future of it), and when:
    ``start`` the engine clock's monotonic() when planning began (None while nothing observes
    steps), ``t0`` / ``t1`` / ``t2`` perf_counter() then, once the plan was made, once the
    executor had it."""

    __slots__ = ("plan", "result", "start", "t0", "t1", "t2")

    def __init__(self, plan: SchedulerOutput,
                 result: ModelRunnerOutput | Future[ModelRunnerOutput], start: float | None,
                 t0: float, t1: float, t2: float) -> None:
        self.plan, self.result = plan, result
        self.start, self.t0, self.t1, self.t2 = start, t0, t1, t2


def _call_each(registry: Registry, hook_name: str, kwargs: dict[str, Any]) -> None:
    """Call every implementation of a lifecycle hook on its own (most recently registered
    first, as pluggy does). An ``Exception`` from one is raised as a PluginError naming its
    plugin after the rest have run; anything else (KeyboardInterrupt, SystemExit) is re-raised
    after the rest have run."""
    first: BaseException | None = None
    for impl in reversed(getattr(registry.hook, hook_name).get_hookimpls()):
        try:
            impl.function(*[kwargs[name] for name in impl.argnames])
        except Exception as exc:
            info = registry.plugins.get(impl.plugin_name)
            owner = info.describe() if info is not None else f"plugin {impl.plugin_name!r}"
            err = PluginError(f"{owner}: {hook_name} raised {exc!r}")
            err.__cause__ = exc
            first = first or err
        except BaseException as exc:     # noqa: B036 - re-raised below, after the others ran
            first = exc if first is None or isinstance(first, PluginError) else first
    if first is not None:
        raise first


def _notify_stopped(registry: Registry, engine_id: str, config: EngineConfig,
                    state: dict[str, BaseException | None]) -> None:
    """``corellm_engine_stopped`` for every implementation, each even if another raised: a
    sink's failure to flush is logged, never raised, so it cannot mask the engine's own error
    or keep another sink from flushing."""
    try:
        _call_each(registry, "corellm_engine_stopped",
                   {"engine_id": engine_id, "config": config, "error": state["error"]})
    except PluginError as exc:
        logger.error("%s", exc, exc_info=exc.__cause__)


class EngineCore:
    """Owns the scheduler, the KV-cache manager and the executor; ``step()`` is the whole loop."""

    def __init__(self, config: EngineConfig, registry: Registry,
                 setup: EngineSetup | None = None) -> None:
        self.config = config
        self.registry = registry
        # Unique among the engines of this host's processes; repeated in every observer call.
        self.engine_id = f"engine-{os.getpid()}-{next(_ENGINE_SEQ)}"
        # Resolved once, here, and handed to the executor and through it to every worker.
        self.setup = setup or resolve_setup(config, registry)
        ctx = BuildContext(config=config, registry=registry, setup=self.setup)
        self.executor: Executor = ctx.build(config.executor)
        try:
            self.model_info: ModelInfo = self.executor.model_info
            num_blocks = self.executor.determine_num_kv_blocks()
            self._check_capacity(num_blocks)
            self.executor.initialize_kv_cache(num_blocks)
            ctx.num_kv_blocks = num_blocks
            self.kv_cache_manager: KVCacheManager = ctx.build(config.kv_cache)
            check_kv_cache_manager(self.kv_cache_manager,
                                    registry.get("kv_cache", config.kv_cache.name).describe())
            ctx.kv_cache_manager = self.kv_cache_manager
            self.scheduler: Scheduler = ctx.build(config.scheduler)
            if config.lora.enable:
                self._enable_lora(config)
            # The executor's clock when it keeps one (a simulated executor's virtual time),
            # else the wall clock; the scheduler reads the same one.
            self.clock: Clock = WALL_CLOCK
            self.set_clock(getattr(self.executor, "clock", None) or WALL_CLOCK)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_steps = 0
        self.timings: dict[str, float] = defaultdict(float)
        # Every unfinished request, for the records of StepStats.finished.
        self._requests: dict[str, Request] = {}
        # Overlapped steps: the step handed to the executor and not yet updated.
        self.async_scheduling = self._resolve_async_scheduling()
        self._in_flight: _Launched | None = None
        self.num_overlapped_steps = 0       # steps planned while the one before ran
        self._early_outputs: list[EngineCoreOutput] = []    # of a step updated out of turn
        # The enabled logits processors, and the unfinished requests one of them constrains:
        # while any runs, steps run one at a time.
        self._processors = [e.spec for e in enabled_logits_processors(config, registry)]
        self._constrained: set[str] = set()
        self._observe_steps = registry.implements("corellm_step_finished")
        self._stats_listeners: list[Callable[[StepStats], None]] = []
        # Whether anything hears of steps (then each step builds its StepStats).
        self._observed = self._observe_steps
        # From here on corellm_engine_stopped is owed exactly once: on shutdown(), or at exit
        # (or garbage collection) for an engine nobody shut down. At exit it runs before Python
        # joins non-daemon threads, so a sink may stop its own writer thread there.
        self._stop_state: dict[str, BaseException | None] = {"error": None}
        self._stopped = weakref.finalize(self, _notify_stopped, registry, self.engine_id, config,
                                         self._stop_state)
        try:
            threading._register_atexit(self._stopped)     # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):             # interpreter already shutting down
            pass
        try:
            _call_each(registry, "corellm_engine_started",
                       {"config": config, "engine_id": self.engine_id})
        except BaseException as exc:
            # Not started: the plugins that did start hear of it, the workers go.
            self.shutdown(error=exc)
            raise

    def _check_capacity(self, num_blocks: int) -> None:
        block_size = self.config.kv_cache.block_size
        max_len = self.model_info.max_model_len
        if num_blocks * block_size < max_len:
            raise ConfigError([("kv_cache.num_blocks",
                                f"{num_blocks} blocks x {block_size} tokens cannot hold one "
                                f"request of model.max_model_len={max_len} tokens; raise "
                                "kv_cache.num_blocks / kv_cache.memory_gib or lower "
                                "model.max_model_len")])
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
            raise ConfigError([("scheduler.max_num_batched_tokens",
                                f"{sched.max_num_batched_tokens} < model.max_model_len={max_len} "
                                "with chunked prefill disabled: long prompts could never run")])

    def _resolve_async_scheduling(self) -> bool:
        """Overlapped steps when the executor runs two at once (``max_concurrent_batches``,
        which follows ``scheduler.async_scheduling``) and the scheduler can plan ahead."""
        wanted = self.config.scheduler.async_scheduling
        executor = type(self.executor).__name__
        if self.executor.max_concurrent_batches < 2:
            if wanted:
                logger.warning("scheduler.async_scheduling is on, but the executor %r (%s) "
                               "runs one step at a time: steps run synchronously",
                               self.config.executor.name, executor)
            return False
        if not getattr(self.scheduler, "supports_async_scheduling", False):
            entry = self.registry.get("scheduler", self.config.scheduler.name)
            logger.warning("%s (%s) was written for the synchronous loop "
                           "(supports_async_scheduling is not set): steps run synchronously",
                           entry.describe(), type(self.scheduler).__name__)
            return False
        return True

    def _enable_lora(self, config: EngineConfig) -> None:
        """Give the scheduler the device's adapter slots (it admits a request for an adapter
        only when the adapter has one)."""
        from corellm.lora.slots import LoRASlots
        if not hasattr(self.scheduler, "lora"):
            entry = self.registry.get("scheduler", config.scheduler.name)
            raise ConfigError([("lora.enable", f"scheduler {entry.describe()} "
                                f"({type(self.scheduler).__name__}) does not schedule LoRA "
                                "adapters (a corellm.scheduling.BatchScheduler does)")])
        self.scheduler.lora = LoRASlots(config.lora.max_loras)  # type: ignore[attr-defined]

    def set_clock(self, clock: Clock) -> None:
        """Run the engine (and its scheduler) on ``clock`` from now on."""
        try:
            self.scheduler.clock = clock             # type: ignore[attr-defined]
        except AttributeError as exc:
            raise PluginError(f"scheduler {self.config.scheduler.name!r} "
                              f"({type(self.scheduler).__name__}) does not accept the engine's "
                              f"clock: {exc}") from exc
        self.clock = clock

    # ------------------------------------------------------------------ observability
    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        """Call ``listener`` with every ``StepStats`` this engine produces, in this process,
        after the ``corellm_step_finished`` hook. The one channel every metric comes from: the
        engine-core process ships the records to the API process this way (``/metrics``), and
        ``corellm bench`` counts with them."""
        self._stats_listeners.append(listener)
        self._observed = True

    def _emit(self, stats: StepStats) -> None:
        if self._observe_steps and stats.kind == "step":
            self.registry.hook.corellm_step_finished(stats=stats)
        for listener in self._stats_listeners:
            listener(stats)

    def _finished_records(self, outputs: list[EngineCoreOutput], now: float,
                          ) -> list[FinishedRequestStats]:
        records = []
        requests = self._requests
        for o in outputs:
            if o.finish_reason is None:
                continue
            r = requests.pop(o.request_id, None)
            if self._constrained:
                self._constrained.discard(o.request_id)
            if r is None or not self._observed:
                continue
            records.append(FinishedRequestStats(
                o.request_id, o.finish_reason, r.arrival_time, now, r.first_scheduled_time,
                r.first_token_time, r.num_prompt_tokens, r.num_output_tokens,
                max(r.num_cached_tokens, 0), r.num_preemptions))
        return records

    def _emit_event(self, outputs: list[EngineCoreOutput]) -> None:
        """A change between steps (aborts, a prefix-cache reset): one ``kind="event"`` record."""
        finished = self._finished_records(outputs, self.clock.time())
        if self._observed:
            self._emit(StepStats(step=self.num_steps, num_scheduled_reqs=0,
                                 num_scheduled_tokens=0, num_finished_reqs=len(finished),
                                 timings={}, scheduler=self.scheduler.get_stats(),
                                 engine_id=self.engine_id, timestamp=self.clock.time(),
                                 kind="event", finished=finished))

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest) -> None:
        if not self._stopped.alive:
            raise EngineDeadError("this engine was shut down (its model and KV cache are "
                                  "released): build a new one")
        r = Request(request, self.model_info.max_model_len)
        rid = r.request_id
        constrained = bool(self._processors) and any(
            p.constrains_request(r.sampling_params) for p in self._processors)
        launched = self._in_flight
        if launched is not None and rid in launched.plan.num_scheduled_tokens:
            # The id of a request that ended while its next step runs: that step is updated
            # first (its outputs come with the next step's), so none of its tokens can reach
            # the new request.
            self._in_flight = None
            self._early_outputs += self._finish(launched)
        self.scheduler.add_request(r)
        self._requests[rid] = r
        if constrained:
            self._constrained.add(rid)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(request_ids)
        if outputs:
            self._emit_event(outputs)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while any request holds KV blocks."""
        done = self.kv_cache_manager.reset_prefix_cache()
        if done:
            self._emit_event([])
        return done

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[EngineCoreOutput]:
        """schedule -> execute model -> sample -> update: the outputs of one step.

        With overlapped steps (``async_scheduling``), the next step is planned and handed to
        the executor before this one's output is taken and applied, so the executor runs it
        while the host updates this one; the first call of a run launches two steps, and each
        call returns the outputs of the step before the one it left running. While a request a
        logits processor constrains is unfinished, steps run one at a time."""
        launched = self._in_flight
        self._in_flight = None
        if launched is None:
            launched = self._launch()
        if self.async_scheduling and not self._constrained \
                and self.scheduler.has_unfinished_requests():
            try:
                self._in_flight = self._launch()
                self.num_overlapped_steps += 1
            except BaseException:
                self._drain(launched)
                raise
        try:
            outputs = self._finish(launched)
            if self._early_outputs:
                outputs, self._early_outputs = self._early_outputs + outputs, []
            return outputs
        except BaseException:
            if self._in_flight is not None:
                launched, self._in_flight = self._in_flight, None
                self._drain(launched)
            raise

    def _launch(self) -> _Launched:
        """Plan a step and hand it to the executor."""
        start = self.clock.monotonic() if self._observed else None  # (for StepStats.duration)
        t0 = time.perf_counter()
        try:
            plan = self.scheduler.schedule()
        except BaseException:
            # A half-built plan leaves no request in a known state: end them all.
            self._fail(self.scheduler.get_request_ids())
            raise
        t1 = time.perf_counter()
        if not plan.total_num_scheduled_tokens and not plan.finished_req_ids \
                and not plan.preempted_req_ids:
            return _Launched(plan, EMPTY_MODEL_RUNNER_OUTPUT, start, t0, t1, t1)
        try:
            result = self.executor.execute_model(plan)
        except BaseException as exc:
            self._failed(plan, exc)
            raise
        return _Launched(plan, result, start, t0, t1, time.perf_counter())

    def _drain(self, launched: _Launched) -> None:
        """A step left behind by a failure: waited for (its error too), its requests ended."""
        try:
            if not isinstance(launched.result, ModelRunnerOutput):     # a future of it
                launched.result.exception()
        except BaseException:       # noqa: B036 - a second failure adds nothing
            pass
        self._fail(launched.plan.num_scheduled_tokens)

    def _finish(self, launched: _Launched) -> list[EngineCoreOutput]:
        """The rest of a step once launched: take its output, update, count, observe."""
        plan, sampled = launched.plan, launched.result
        t0, t1 = launched.t0, launched.t1
        t2 = time.perf_counter()
        try:
            if not isinstance(sampled, ModelRunnerOutput):        # a future of it
                sampled = sampled.result()
            t3 = time.perf_counter()
            ended = self._end_failed(sampled.failed) if sampled.failed else None
            outputs = self.scheduler.update_from_output(plan, sampled)
            if ended:
                outputs = ended + outputs
        except BaseException as exc:
            self._failed(plan, exc)
            raise
        t4 = time.perf_counter()

        self.num_steps += 1
        tm = self.timings
        tm["schedule"] += t1 - t0
        for phase, seconds in sampled.timings.items():
            tm[phase] += seconds
        execute = (launched.t2 - t1) + (t3 - t2)      # handing over, and waiting
        tm["execute"] += execute
        tm["update"] += t4 - t3
        tm["step"] += (t1 - t0) + execute + (t4 - t3)
        now = self.clock.time() if self._observed else 0.0    # (records only when observed)
        finished = self._finished_records(outputs, now)
        if self._observed and plan.total_num_scheduled_tokens:
            scheduled = plan.num_scheduled_tokens
            decodes = sum(1 for n in scheduled.values() if n == 1)
            self._emit(StepStats(
                step=self.num_steps, num_scheduled_reqs=len(scheduled),
                num_scheduled_tokens=plan.total_num_scheduled_tokens,
                num_finished_reqs=sum(o.finished for o in outputs),
                timings={"schedule": t1 - t0, **sampled.timings, "update": t4 - t3},
                scheduler=self.scheduler.get_stats(), engine_id=self.engine_id,
                timestamp=now, duration=(self.clock.monotonic() - launched.start
                                         if launched.start is not None else 0.0),
                num_prefill_tokens=plan.total_num_scheduled_tokens - decodes,
                num_decode_reqs=decodes, finished=finished))
        return outputs

    def _failed(self, plan: SchedulerOutput, exc: BaseException) -> None:
        """A plan's execution or update raised ``exc``: what that ends."""
        if isinstance(exc, ExecutorError):
            # The workers are gone: no request can make progress, so none is left waiting.
            self._fail(self.scheduler.get_request_ids())
        else:
            self._fail(plan.num_scheduled_tokens)

    def _end_failed(self, failed: dict[str, str]) -> list[EngineCoreOutput]:
        """Requests the worker could not serve (a logits processor's ``RequestsFailed``): they
        end with reason "error" before the step's update, which then passes them by."""
        for rid, why in failed.items():
            logger.warning("request %s ended: %s", rid, why)
        outputs = self.scheduler.abort_requests(list(failed), RequestStatus.FINISHED_ERROR)
        for out in outputs:
            out.stop_reason = failed[out.request_id]      # why, for its client
        return outputs

    def _fail(self, request_ids: Iterable[str]) -> None:
        """Nothing is lost when a step raises: the requests it touched end with reason "error"
        and their blocks return to the pool; the caller sees the original exception."""
        try:
            outputs = self.scheduler.abort_requests(list(request_ids),
                                                    RequestStatus.FINISHED_ERROR)
            self._finished_records(outputs, self.clock.time())
        except Exception:  # never mask the step's own exception
            logger.exception("could not finish the requests of a failed step")

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(**vars(s), num_steps=self.num_steps, timings=dict(self.timings))

    def shutdown(self, error: BaseException | None = None) -> None:
        """Release the executor, then call ``corellm_engine_stopped`` (once, whatever the number
        of calls). ``error`` is the exception bringing the engine down, if one is."""
        try:
            self.executor.shutdown()
        finally:
            if self._stopped.alive and error is not None:
                self._stop_state["error"] = error
            self._stopped()
