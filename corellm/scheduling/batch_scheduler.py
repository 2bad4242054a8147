"""Continuous batching with a unified token budget (vLLM v1's shape).

Each step: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting requests in the policy's order while the token budget, ``max_num_seqs`` and the KV
pool allow. There is no prefill/decode phase distinction: a request simply has
``num_tokens - num_computed_tokens`` tokens to compute and gets up to the remaining budget.

A waiting request starts at its longest cached prefix (``find_cached_prefix``): its
``num_computed_tokens`` begins at the cached length and only the rest is computed. After each step
the KV-cache manager registers the blocks the step completed (``cache_computed_blocks``).

When the pool cannot hold a running request's next tokens, the policy picks a victim, which is
preempted by recomputation: its blocks are freed and it rejoins the waiting queue with
``num_computed_tokens = 0``. The policy decides only order and victims; every state transition,
block allocation and release happens here, so a policy can neither leak a block nor lose a request.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from typing import Any

from corellm.components import SchedulerOptions
from corellm.interfaces import KVCacheManager, Scheduler, SchedulingPolicy
from corellm.outputs import (CachedRequestData, EngineCoreOutput, LogprobsLists, ModelRunnerOutput,
                             NewRequestData, SchedulerOutput, SchedulerStats)
from corellm.request import Request, RequestStatus


class BatchScheduler(Scheduler):
    def __init__(self, options: SchedulerOptions, kv_cache_manager: KVCacheManager,
                 policy: SchedulingPolicy) -> None:
        self.max_num_seqs = options.max_num_seqs
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.enable_chunked_prefill = options.enable_chunked_prefill
        self.kv = kv_cache_manager
        self.policy = policy
        self.requests: dict[str, Request] = {}      # every unfinished request
        self.running: list[Request] = []            # in admission order
        self._waiting: list[tuple[Any, int, Request]] = []   # heap; aborted entries skipped lazily
        self._num_waiting = 0
        self._finished_ids: set[str] = set()        # to tell the workers at the next step
        self._preempted: list[Request] = []         # PREEMPTED until the next schedule()
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefill_tokens = 0

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.policy.waiting_key(request), request.arrival_seq,
                                       request))
        self._num_waiting += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            request = self._waiting[0][2]
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                return request
            heapq.heappop(self._waiting)        # aborted while waiting
        return None

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       ) -> list[EngineCoreOutput]:
        assert status.is_finished
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                if request in self.running:
                    self.running.remove(request)
            else:
                self._num_waiting -= 1
            self._finish(request, status)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=status.finish_reason))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        self._preempted.append(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        # Requests preempted by the previous step rejoin the queue as WAITING.
        for request in self._preempted:
            if request.status == RequestStatus.PREEMPTED:
                request.status = RequestStatus.WAITING
        self._preempted.clear()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: set[str] = set()

        # 1. Running requests, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while True:
                blocks = self.kv.allocate_slots(request, n)
                if blocks is not None:
                    break
                victim = self.policy.choose_victim(tuple(self.running))
                try:
                    v = self.running.index(victim)
                except ValueError:
                    raise RuntimeError(f"{type(self.policy).__name__}.choose_victim returned "
                                       f"{victim!r}, which is not running") from None
                self.running.pop(v)
                if victim.request_id in num_scheduled:     # undo its place in this step's plan
                    budget += num_scheduled.pop(victim.request_id)
                    new_blocks.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.add(victim.request_id)
                if v < i:
                    i -= 1
                if victim is request:
                    break
            if blocks is None:
                continue                               # `request` itself was preempted
            num_scheduled[request.request_id] = n
            new_blocks[request.request_id] = blocks
            budget -= n
            i += 1
        cached = [CachedRequestData(rid, new_blocks[rid],
                                    self.requests[rid].num_computed_tokens)
                  for rid in num_scheduled]

        # 2. Waiting requests in policy order, unless this step already had to preempt.
        new: list[NewRequestData] = []
        while not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._peek_waiting()
            if request is None:
                break
            # With nothing running, the head is admitted whatever the policy says: otherwise a
            # policy could stall the engine forever.
            if self.running and not self.policy.can_admit(request, tuple(self.running)):
                break
            prefix = self.kv.find_cached_prefix(request)
            if prefix.pending:
                # Its next block is being computed by a request in this step: admitted next
                # step, it finds that block cached instead of computing a copy. Admission stops
                # here, like for any head that does not fit, so the policy's order holds.
                break
            n = request.num_tokens - prefix.num_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if self.kv.allocate_slots(request, n, prefix) is None:
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            if request.num_cached_tokens < 0:          # first admission
                request.num_cached_tokens = prefix.num_tokens
                request.first_scheduled_time = time.time()
                self.num_prompt_tokens += request.num_prompt_tokens
            self.running.append(request)
            num_scheduled[request.request_id] = n
            budget -= n
            new.append(NewRequestData(
                req_id=request.request_id, token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=list(self.kv.get_block_ids(request)),
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params, eos_token_id=request.eos_token_id))

        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=finished, preempted_req_ids=preempted)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        row_of = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        lp = runner_output.logprobs
        outputs: list[EngineCoreOutput] = []
        finished_any = False
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue                                   # aborted since it was scheduled
            before = request.num_computed_tokens
            request.num_computed_tokens += n
            self.kv.cache_computed_blocks(request)
            if n > 1 or before < request.num_prompt_tokens:     # not a decode
                self.num_prefill_tokens += n
            row = row_of.get(rid)
            if row is None:
                if request.num_computed_tokens >= request.num_tokens:
                    raise RuntimeError(f"request {rid} completed its tokens but nothing was "
                                       "sampled for it")
                continue                                   # a partial prefill chunk
            token = runner_output.sampled_token_ids[row]
            self.num_generation_tokens += 1
            status = request.append_output_token(token)
            logprobs = None
            if lp is not None and request.sampling_params.logprobs is not None:
                k = request.sampling_params.logprobs + 1
                logprobs = LogprobsLists([lp.token_ids[row][:k]], [lp.logprobs[row][:k]],
                                         [lp.sampled_ranks[row]])
            if status is not None:
                self._finish(request, status)
                finished_any = True
            outputs.append(EngineCoreOutput(rid, [token], logprobs,
                                            finish_reason=status.finish_reason if status else None,
                                            stop_reason=request.stop_reason,
                                            num_cached_tokens=max(request.num_cached_tokens, 0),
                                            first_scheduled_time=request.first_scheduled_time))
        if finished_any:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    # ------------------------------------------------------------------ introspection
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_ids(self) -> list[str]:
        return list(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=self._num_waiting,
            kv_blocks_total=self.kv.num_blocks, kv_blocks_free=self.kv.num_free_blocks,
            num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            kv_blocks_cached=self.kv.num_cached_blocks)
