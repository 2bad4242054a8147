"""Driving an in-process engine through a workload in real (or virtual) time.

``LLM(config)`` validates and builds the engine, and ``drive_engine`` drives ``llm.engine`` (the
``EngineCore``) itself: each request is processed by ``llm.processor`` and added when its arrival
time comes, the loop steps while anything runs and sleeps until the next arrival when idle, and
every output token is timestamped when the step that produced it returns. Offline a follow-up's
history is the exact output ids. A request that comes due while a step runs has arrived at its
due time (its latency counts from then, as a server's would); one that waits for a
``max_concurrency`` slot arrives when the slot frees.
"""

from __future__ import annotations

import collections
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .metrics import RequestRecord
from .progress import progress_bar
from .sessions import Sessions, length_error, record_for, warmup_workload
from .env import gc_paused
from .targets import (COUNTERS, RunOptions, RunResult, Target, config_data, config_model_dir,
                      loaded_tokenizer)
from .workload import Workload


@dataclass
class _Live:
    index: int
    request: Any            # the scheduler's Request when the scheduler exposes it, else None
    record: RequestRecord
    keep: bool              # its output ids are needed (kept outputs, or a follow-up's history)
    output_ids: list[int] = field(default_factory=list)


def lora_requests(workload: Workload) -> dict[str | None, Any]:
    """The workload's LoRA adapters as an in-process engine takes them (name -> LoRARequest,
    ids in order of first appearance); a ValueError names an adapter without a path."""
    from corellm.lora.request import LoRARequest
    loras: dict[str | None, Any] = {None: None}
    for r in workload.requests:
        if r.lora_name is not None and r.lora_name not in loras:
            if r.lora_path is None:
                raise ValueError(f"lora_adapters: adapter {r.lora_name!r} has no path, which "
                                 "an in-process engine loads it from")
            loras[r.lora_name] = LoRARequest(r.lora_name, len(loras), r.lora_path)
    return loras


def drive_engine(llm: Any, workload: Workload, options: RunOptions, *, salt: str,
                 desc: str = "run", progress: bool | None = None,
                 ) -> tuple[list[RequestRecord], float]:
    """Run a workload through ``llm.engine`` in real time; returns the records (workload order)
    and the duration. Anything still in the engine when this raises is aborted."""
    from corellm.errors import InvalidRequestError
    from corellm.sampling_params import SamplingParams

    engine = llm.engine
    if engine is None:
        raise ValueError("drive_engine needs an in-process engine (LLM(engine_process=False))")
    sessions = Sessions(workload)
    records = {r.index: record_for(r) for r in workload.requests}
    limit = options.max_concurrency or math.inf
    live: dict[str, _Live] = {}
    ready: collections.deque[tuple[float, int]] = collections.deque()
    scheduler_requests = getattr(engine.scheduler, "requests", None)
    prefix = f"bench-{salt}-"
    bar = progress_bar(len(records), desc, options.progress if progress is None else progress)
    # The engine's clock: the wall clock, or a simulated executor's virtual time (then sleeps
    # and steps take no real time, and every timestamp below is virtual).
    clock = engine.clock
    t0 = clock.monotonic()
    wall0 = clock.time()
    step_start: float | None = None     # set when the previous iteration ran a step
    free_during_step = 0
    params_for: dict[tuple[int, bool], SamplingParams] = {}   # requests share them
    loras = lora_requests(workload)

    def finish(i: int, now: float, ok: bool, output_ids: list[int]) -> None:
        bar.update(1)
        for c in sessions.finished(i, now, ok, output_ids):
            records[c].error = f"previous turn (request {i}) failed"
            bar.update(1)

    def dispatch(now: float) -> None:
        nonlocal step_start
        sent = 0
        while ready and len(live) < limit:
            due, i = ready.popleft()
            rec = records[i]
            # Due while a step ran and a slot was free: it arrived at its due time. Waiting for
            # a slot, or dispatched after an idle sleep: it arrives now.
            rec.arrival_s = due if step_start is not None and sent < free_during_step else now
            sent += 1
            req = sessions.requests[i]
            ids = sessions.prompt(i)
            rec.prompt_tokens = len(ids)
            key = (req.output_len, req.ignore_eos)
            params = params_for.get(key)
            if params is None:      # one per length: building and validating one per request adds up
                params = params_for[key] = SamplingParams(
                    max_tokens=req.output_len, temperature=options.temperature,
                    ignore_eos=req.ignore_eos, cache_salt=salt)
            rid = f"{prefix}{i}"
            try:
                _, core = llm.processor.process(rid, {"prompt_token_ids": ids}, params,
                                                req.priority, user=req.user,
                                                session_id=req.session_id,
                                                arrival_time=wall0 + rec.arrival_s,
                                                lora_request=loras.get(req.lora_name))
            except InvalidRequestError as exc:
                rec.error = f"invalid request: {exc}"
                finish(i, now, False, [])
                continue
            engine.add_request(core)
            live[rid] = _Live(i, scheduler_requests.get(rid)
                              if isinstance(scheduler_requests, Mapping) else None, rec,
                              options.keep_outputs or bool(sessions.children.get(i)))
        step_start = None

    try:
        woke_at = 0.0       # the due time an idle wait slept until
        while not sessions.done:
            # Never before the due time slept until: on a virtual clock, t0 + (due - t0) can
            # round below due, and a loop sleeping the rounding error away never ends.
            now = max(clock.monotonic() - t0, woke_at)
            ready.extend(sessions.pop_due(now))
            if ready:
                dispatch(now)
            else:
                step_start = None
            if live:
                step_start = now
                free_during_step = (len(records) if limit == math.inf
                                    else int(limit) - len(live))
                outputs = engine.step()
                # (asked only when a step returns nothing: an engine with no unfinished
                # request has nothing to return)
                if not outputs and not engine.has_unfinished_requests():
                    raise RuntimeError(f"the engine has no unfinished requests but {len(live)} "
                                       "were never finished")
                now = clock.monotonic() - t0
                for out in outputs:
                    state = live.get(out.request_id)
                    if state is None:
                        continue
                    rec = state.record
                    new_ids = out.new_token_ids
                    if new_ids:
                        rec.chunk_times_s.append(now)
                        rec.output_tokens += len(new_ids)
                        if state.keep:
                            state.output_ids.extend(new_ids)
                    # (with a request's first token and its last)
                    if out.num_cached_tokens:
                        rec.cached_tokens = max(rec.cached_tokens or 0, out.num_cached_tokens)
                    if out.first_scheduled_time and rec.queue_time_s is None:
                        rec.queue_time_s = out.first_scheduled_time - (wall0 + rec.arrival_s)
                    if out.finish_reason is not None:
                        del live[out.request_id]
                        rec.end_s = now
                        rec.cached_tokens = rec.cached_tokens or 0
                        if state.request is not None:
                            rec.num_preemptions = state.request.num_preemptions
                        if options.keep_outputs:
                            rec.output_token_ids = list(state.output_ids)
                        if out.finish_reason not in ("length", "stop"):
                            rec.error = f"finish_reason {out.finish_reason}"
                        else:
                            rec.error = length_error(
                                rec.output_tokens, rec.expected_output_tokens,
                                sessions.requests[state.index].ignore_eos, out.finish_reason)
                        finish(state.index, now, rec.ok, state.output_ids)
            elif not ready:
                due = sessions.next_due()
                if due is None:
                    raise RuntimeError(f"{sessions.outstanding} requests can never be sent")
                clock.sleep(max(0.0, due - (clock.monotonic() - t0)))
                woke_at = due
        duration = clock.monotonic() - t0
    except BaseException:
        if live:
            engine.abort_requests(list(live))
        raise
    finally:
        bar.close()
    return [records[i] for i in sorted(records)], duration


def _stats_delta(before: Any, after: Any) -> dict[str, float]:
    return {name: getattr(after, attr) - getattr(before, attr)
            for name, (attr, _) in COUNTERS.items() if hasattr(after, attr)}


def _executor_name(config: Any) -> str | None:
    executor = getattr(config, "executor", None)           # an EngineConfig
    if executor is None:
        executor = config_data(config).get("executor")
        executor = executor.get("name") if isinstance(executor, Mapping) else executor
    else:
        executor = executor.name
    return executor if isinstance(executor, str) else None


def run_engine(target: Target, workload: Workload, options: RunOptions, *, repeat: int = 0,
               seed: int | None = None) -> RunResult:
    """Build the engine from the target's config, warm it up, run the workload, shut it down.
    A fresh engine per run: every run starts from the same state (empty prefix cache, nothing
    left over from the other target), and only one engine's memory is held at a time."""
    from corellm.engine.llm import LLM

    config = dict(target.config) if isinstance(target.config, Mapping) else target.config
    # The driver sends token ids and reads token ids. The simulator's samples are one fixed
    # token that ends nothing, so its engine needs no tokenizer (nor a second of transformers
    # import); a model's engine keeps its own, for its end-of-sequence id (the one that drew
    # the prompts when it is the same model, loaded once for every run).
    simulated = _executor_name(config) == "sim"
    tokenizer = None if simulated else loaded_tokenizer(config_model_dir(config))
    t0 = time.perf_counter()
    llm = LLM(config, tokenizer=tokenizer, skip_tokenizer_init=simulated)
    load_s = time.perf_counter() - t0
    salt = f"{target.label}-{repeat}-{uuid.uuid4().hex[:8]}"
    try:
        if options.warmup_requests:
            warm = warmup_workload(workload, options.warmup_requests, options.warmup_output_len)
            drive_engine(llm, warm, replace(options, max_concurrency=None),
                         salt=f"{salt}-warmup", progress=False)
        before = llm.engine.get_stats()
        cpu0 = time.process_time()
        with gc_paused():
            records, duration = drive_engine(llm, workload, options, salt=salt,
                                             desc=f"{target.label} #{repeat + 1}")
        cpu_s = time.process_time() - cpu0
        after = llm.engine.get_stats()
        max_num_seqs = llm.config.scheduler.max_num_seqs
        scheduler = llm.config.scheduler.name
    finally:
        llm.shutdown()
    return RunResult(target.label, repeat, seed, records, duration, _stats_delta(before, after),
                     info={"kind": target.kind, "load_s": load_s, "cpu_s": cpu_s,
                           "scheduler": scheduler, "max_num_seqs": max_num_seqs})
