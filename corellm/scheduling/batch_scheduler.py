"""Continuous batching with a unified token budget (vLLM v1's shape).

Each step: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting requests in the policy's order while the token budget, ``max_num_seqs`` and the KV
pool allow. There is no prefill/decode phase distinction: a request simply has
``num_tokens - num_computed_tokens`` tokens to compute and gets up to the remaining budget.

A waiting request starts at its longest cached prefix (``find_cached_prefix``): its
``num_computed_tokens`` begins at the cached length and only the rest is computed. After each step
the KV-cache manager registers the blocks the step completed (``cache_computed_blocks``).

A request's ``num_computed_tokens`` advances when its step is planned (vLLM's rule), and each
step that samples for it holds a placeholder (``num_output_placeholders``) until its update
appends the token: the next plan may be made before the previous step's tokens are known
(overlapped steps, ``supports_async_scheduling``), and schedules them all the same.

When the pool cannot hold a running request's next tokens, the policy picks a victim
(``choose_victim``), which is preempted by recomputation: its blocks are freed and it rejoins the
waiting queue with ``num_computed_tokens = 0``. When the request the policy selects for admission
does not fit (the batch is full, or the pool is short), the policy may name a running request to
preempt for it (``preempt_for``). The policy decides only order, admission and victims; every
state transition, block allocation and release happens here, so a policy can neither leak a block
nor lose a request.

Whatever the policy, one client request cannot take the batch from the others: the requests of
one group (``Request.group_id``: the ``n`` samples and prompts of one API call) hold at most
``max_num_seqs_per_request`` seats while requests of other groups wait. Its further waiting
requests are set aside for the round, so the policy's next choice is considered instead, and
when a request of a group under its share does not fit and the policy names no victim, the
newest running request of the group furthest over its share is preempted for it. With no other
group waiting, a group may use every seat (the share costs a lone request nothing).
With LoRA on, a request whose adapter can get no device slot is set aside likewise, and waits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from corellm.clock import WALL_CLOCK, Clock
from corellm.specs import SchedulerOptions
from corellm.interfaces import CachedPrefix, KVCacheManager, Scheduler, SchedulingPolicy
from corellm.lora.slots import LoRASlots
from corellm.outputs import (CachedRequestData, EngineCoreOutput, LogprobsLists, ModelRunnerOutput,
                             NewRequestData, SchedulerOutput, SchedulerStats)
from corellm.request import Request, RequestStatus
from corellm.policy_view import SchedulingContext, WaitingQueue
from corellm.plugins.conformance import check_policy, overrides


class _Plan:
    """The step being planned: undone piece by piece when a scheduled request is preempted.
    ``new_blocks``: of running requests only; ``changes``: admissions and preemptions so far
    (they change the prefix cache)."""

    __slots__ = ("budget", "num_scheduled", "new_blocks", "admitted", "preempted", "changes")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.new_blocks: dict[str, list[int]] = {}
        self.admitted: list[Request] = []
        self.preempted: set[str] = set()
        self.changes = 0


class BatchScheduler(Scheduler):
    clock: Clock = WALL_CLOCK       # the engine sets its own (virtual for a simulated run)
    supports_async_scheduling = True
    lora: LoRASlots | None = None   # the adapter slots (corellm.lora.slots), set by the engine

    def __init__(self, options: SchedulerOptions, kv_cache_manager: KVCacheManager,
                 policy: SchedulingPolicy) -> None:
        check_policy(policy)
        self.max_num_seqs = options.max_num_seqs
        self.max_num_batched_tokens = options.max_num_batched_tokens
        self.enable_chunked_prefill = options.enable_chunked_prefill
        self.seats_per_request = options.seats_per_request
        self.kv = kv_cache_manager
        self.policy = policy
        self.requests: dict[str, Request] = {}      # every unfinished request
        self.running: list[Request] = []            # in admission order
        self.waiting = WaitingQueue()               # waiting and preempted requests
        self._seats: Counter[str] = Counter()       # group_id -> its RUNNING requests
        self._queued: Counter[str] = Counter()      # group_id -> its requests in `waiting`
        self._finished_ids: set[str] = set()        # to tell the workers at the next step
        self._preempted: list[Request] = []         # PREEMPTED until the next schedule()
        self._notify = overrides(policy, "on_scheduled")
        self._notify_finished = overrides(policy, "on_finished")
        self._finished_notices: list[Request] = []
        self._grouped = overrides(policy, "queue_group")
        self._preempts_for = overrides(policy, "preempt_for")
        # With a manager that needs calls only at block boundaries: request id -> the tokens
        # its blocks hold, and -> the full blocks it had at its last cache_computed_blocks.
        self._capacity: dict[str, int] | None = (
            {} if getattr(kv_cache_manager, "block_calls_only", False) else None)
        self._cached_blocks: dict[str, int] = {}
        self.num_schedules = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefill_tokens = 0

    def _context(self, plan: _Plan | None = None) -> SchedulingContext:
        # Between rounds, decisions belong to the next round.
        step = self.num_schedules if plan is not None else self.num_schedules + 1
        return SchedulingContext(self.clock.time(), step, self, plan)

    def _policy_error(self, method: str, answer: object, what: str) -> RuntimeError:
        return RuntimeError(f"{type(self.policy).__name__}.{method} returned {answer!r:.200}, "
                            f"which is not {what}")

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._push_waiting(request, self._context())    # the policy may raise: nothing held yet
        self.requests[request.request_id] = request

    def _push_waiting(self, request: Request, ctx: SchedulingContext) -> None:
        key = self.policy.waiting_key(request, ctx)
        group = self.policy.queue_group(request) if self._grouped else None
        self.waiting.push(request, key, group)
        self._queued[request.group_id] += 1

    def _unqueue(self, request: Request) -> None:
        if self.waiting.remove(request):
            _decrement(self._queued, request.group_id)

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
                self._unqueue(request)
            self._finish(request, status)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=status.finish_reason))
        self._deliver_finished()
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            _decrement(self._seats, request.group_id)
        if request.lora_slot >= 0:
            self.lora.leave(request)                   # type: ignore[union-attr]
        request.status = status
        self.kv.free(request)
        if self._capacity is not None:
            self._capacity.pop(request.request_id, None)
            self._cached_blocks.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        if self._notify_finished:
            self._finished_notices.append(request)

    def _deliver_finished(self) -> None:
        """Tell the policy which requests finished, once every state change is done: a policy
        that raises here cannot leave a finished request half-removed."""
        error = None
        while self._finished_notices:
            request = self._finished_notices.pop(0)
            try:
                self.policy.on_finished(request, self._context())
            except Exception as exc:           # the others are still told
                error = error or exc
        if error is not None:
            raise error

    def _preempt(self, victim: Request, plan: _Plan, ctx: SchedulingContext) -> None:
        """Preempt a running request by recomputation, undoing its place in this step's plan."""
        self.running.remove(victim)
        rid = victim.request_id
        if rid in plan.num_scheduled:
            plan.budget += plan.num_scheduled.pop(rid)
            plan.new_blocks.pop(rid, None)
            if victim in plan.admitted:
                plan.admitted.remove(victim)
        plan.preempted.add(rid)
        plan.changes += 1
        self.kv.free(victim)
        if self._capacity is not None:
            self._capacity.pop(rid, None)
            self._cached_blocks.pop(rid, None)
        _decrement(self._seats, victim.group_id)
        if victim.lora_slot >= 0:
            self.lora.leave(victim)                    # type: ignore[union-attr]
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted.append(victim)
        self._push_waiting(victim, ctx)

    def _running_victim(self, method: str, answer: object,
                        offered: tuple[Request, ...] | None = None) -> Request:
        if not any(answer is r for r in (self.running if offered is None else offered)):
            raise self._policy_error(
                method, answer, "running" if offered is None or len(offered) == len(self.running)
                else "one of the running requests offered (those of the client request over "
                     "its share of seats)")
        return answer  # type: ignore[return-value]

    def _victim_candidates(self) -> tuple[Request, ...]:
        """The running requests offered to ``choose_victim``: those of the group furthest over
        its share while another group runs or waits (so memory pressure never makes the others
        pay for one client request), else all of them."""
        seats, over = max(((n, g) for g, n in self._seats.items()), default=(0, None))
        if seats > self.seats_per_request and (
                len(self.running) > seats or len(self.waiting) > self._queued[over]):
            return tuple(r for r in self.running if r.group_id == over)
        return tuple(self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        # Requests preempted by the previous step rejoin the queue as WAITING.
        if self._preempted:
            for request in self._preempted:
                if request.status == RequestStatus.PREEMPTED:
                    request.status = RequestStatus.WAITING
            self._preempted.clear()
        self.num_schedules += 1
        plan = _Plan(self.max_num_batched_tokens)
        # The policy's view of this round, made when a decision needs it.
        ctx = self._context(plan) if self.waiting or self._notify else None

        # 1. Running requests, in admission order. A request's tokens to compute: those known
        # and those its planned steps are sampling (placeholders), less those computed or
        # planned. One whose planned steps already end it by length is left out.
        i = 0
        running, allocate_slots = self.running, self.kv.allocate_slots
        num_scheduled, new_blocks = plan.num_scheduled, plan.new_blocks
        # With a manager that only needs block boundaries (block_calls_only), the tokens each
        # request's blocks hold: a step within them allocates nothing, and is not asked for.
        capacity, bs = self._capacity, self.kv.block_size
        # What the executor is told of each scheduled request, gathered as it is scheduled
        # (a preemption in this step has them gathered again below).
        computed: dict[str, int] = {}
        sampling: list[str] = []
        # The same, as requests: (request, tokens) in plan order, and the requests sampling.
        planned: list[tuple[Request, int]] = []
        samplers: list[Request] = []
        while i < len(running) and plan.budget > 0:
            request = running[i]
            rid = request.request_id
            c = request.num_computed_tokens
            end = len(request.all_token_ids)
            ahead = request.num_output_placeholders
            if ahead:
                end += ahead
                if end - len(request.prompt_token_ids) >= request.sampling_params.max_tokens \
                        or end >= request.max_model_len:
                    i += 1
                    continue
            n = end - c
            if n > plan.budget:
                n = plan.budget
            # Within the blocks it holds, completing none: nothing to allocate or announce.
            if capacity is None or c % bs + n >= bs or c + n > capacity.get(rid, 0):
                blocks = allocate_slots(request, n)
                while blocks is None:
                    if ctx is None:
                        ctx = self._context(plan)
                    offered = self._victim_candidates()
                    victim = self._running_victim("choose_victim", self.policy.choose_victim(
                        offered, ctx), offered)
                    if self.running.index(victim) < i:
                        i -= 1
                    self._preempt(victim, plan, ctx)
                    if victim is request:
                        break
                    blocks = self.kv.allocate_slots(request, n)
                if blocks is None:
                    continue                           # `request` itself was preempted
                if capacity is not None:
                    capacity[rid] = len(self.kv.get_block_ids(request)) * bs
                if blocks:
                    new_blocks[rid] = blocks
            num_scheduled[rid] = n
            computed[rid] = c
            planned.append((request, n))
            if c + n >= end:
                sampling.append(rid)
                samplers.append(request)
            plan.budget -= n
            i += 1

        # 2. Waiting requests in policy order, unless this step already had to preempt.
        if not plan.preempted and self.waiting:
            self._admit(plan, ctx or self._context(plan))

        admitted = plan.admitted
        if admitted:
            now = self.clock.time()
            for request in admitted:                   # recorded once the admission holds
                if request.num_cached_tokens < 0:      # first admission
                    request.num_cached_tokens = request.num_computed_tokens
                    request.first_scheduled_time = now
                    self.num_prompt_tokens += request.num_prompt_tokens
        # (Most steps admit and preempt nothing: no list built for nothing.)
        more: list[tuple[Request, int]] | tuple[()] = ()
        if plan.preempted:
            computed.clear()
            sampling.clear()
            samplers.clear()
            requests = self.requests
            planned = more = [(requests[rid], n) for rid, n in num_scheduled.items()]
        elif admitted:
            more = [(r, num_scheduled[r.request_id]) for r in admitted]
            planned += more
        for request, n in more:
            rid = request.request_id
            c = computed[rid] = request.num_computed_tokens
            if c + n >= len(request.all_token_ids) + request.num_output_placeholders:
                sampling.append(rid)
                samplers.append(request)
        # The policy hears of the plan as made, before its tokens count as computed.
        if ctx is not None and self._notify:
            self.policy.on_scheduled(list(planned), ctx)
        # The plan holds: its tokens count as computed (those computed other than as a decode
        # as prefill tokens), its samples as placeholders.
        prefill = 0
        for request, n in planned:
            c = request.num_computed_tokens
            if n != 1 or c < len(request.prompt_token_ids):
                prefill += n
            request.num_computed_tokens = c + n
        self.num_prefill_tokens += prefill
        for request in samplers:
            request.num_output_placeholders += 1
        cached = [CachedRequestData(rid, blocks, computed[rid])
                  for rid, blocks in plan.new_blocks.items()] if plan.new_blocks else []
        new = [NewRequestData(r.request_id, list(r.all_token_ids), r.num_prompt_tokens,
                              list(self.kv.get_block_ids(r)), computed[r.request_id],
                              r.sampling_params, r.eos_token_id, r.lora_slot)
               for r in admitted] if admitted else []
        finished, self._finished_ids = self._finished_ids, set()
        # (positional, the fields in SchedulerOutput's order: once per step, keywords cost
        # twice as much)
        loads = self.lora.take_loads() if self.lora is not None else {}
        return SchedulerOutput(new, cached, plan.num_scheduled,
                               self.max_num_batched_tokens - plan.budget, finished,
                               plan.preempted, computed, sampling, loads)

    def _admit(self, plan: _Plan, ctx: SchedulingContext) -> None:
        # Requests of groups at their share, set aside for this round while others wait.
        aside: list[tuple[Request, Any]] = []
        try:
            self._admit_loop(plan, ctx, aside)
        finally:
            for request, entry in aside:
                self.waiting.restore(entry)
                self._queued[request.group_id] += 1

    def _at_share(self, request: Request) -> bool:
        """Whether ``request``'s group holds its share of seats while another group waits."""
        group = request.group_id
        return (self._seats[group] >= self.seats_per_request
                and len(self.waiting) > self._queued[group])

    def _admit_loop(self, plan: _Plan, ctx: SchedulingContext,
                    aside: list[tuple[Request, Any]]) -> None:
        while plan.budget > 0 and self.waiting:
            request = self.policy.select(self.waiting, ctx)
            if request is None:
                if self.running:
                    return
                # With nothing running the best waiting request is admitted whatever the policy
                # says: otherwise a policy could stall the engine forever.
                request = self.waiting.first()
            elif request not in self.waiting:
                raise self._policy_error("select", request, "waiting")
            if request.request_id in plan.preempted:
                return                                 # not back in the step that preempted it
            if self._at_share(request) or (self.lora is not None and self.lora.waits(request)):
                aside.append((request, self.waiting.set_aside(request)))
                _decrement(self._queued, request.group_id)
                continue
            if self.running and not self.policy.can_admit(request, ctx):
                return
            fit = self._fit(request, plan, ctx)
            if fit is None:
                # Admission stops at a request that does not fit (or whose next block another
                # request is computing this step), so the policy's order holds.
                return
            prefix, n = fit
            self._unqueue(request)
            self._seats[request.group_id] += 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = prefix.num_tokens
            self.running.append(request)
            if self.lora is not None:
                self.lora.admit(request)
            plan.num_scheduled[request.request_id] = n
            plan.admitted.append(request)
            plan.changes += 1
            plan.budget -= n

    def _fit(self, request: Request, plan: _Plan, ctx: SchedulingContext,
             ) -> tuple[CachedPrefix, int] | None:
        """Allocate a seat and KV blocks for a waiting request, preempting the running requests
        the policy names (``preempt_for``) until it fits; None when it cannot fit this step."""
        if len(self.running) >= self.max_num_seqs and not self._preempts_for \
                and self._over_share_victim(request) is None:
            return None         # no seat and none to take: what the loop answers, sooner
        while True:
            prefix = self.kv.find_cached_prefix(request)
            if prefix.pending:
                # Its next block is being computed by a request in this step: admitted next
                # step, it finds that block cached instead of computing a copy.
                return None
            n = request.num_tokens - prefix.num_tokens
            if n > plan.budget:
                if not self.enable_chunked_prefill:
                    return None
                n = plan.budget
            if len(self.running) < self.max_num_seqs \
                    and self.kv.allocate_slots(request, n, prefix) is not None:
                return prefix, n
            answer = self.policy.preempt_for(request, tuple(self.running), ctx)
            if answer is not None:
                victim = self._running_victim("preempt_for", answer)
            else:
                victim = self._over_share_victim(request)
                if victim is None:
                    return None
            self._preempt(victim, plan, ctx)

    def _over_share_victim(self, request: Request) -> Request | None:
        """The newest running request of the group furthest over its share, when ``request``'s
        own group is under it: the seat (and blocks) ``request`` may take."""
        group, share = request.group_id, self.seats_per_request
        if self._seats[group] >= share or max(self._seats.values(), default=0) <= share:
            return None                 # (no group over its share: asked at every full step)
        seats, over = max(((n, g) for g, n in self._seats.items() if g != group),
                          default=(0, None))
        if seats <= share:
            return None
        return next(r for r in reversed(self.running) if r.group_id == over)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        unfinished = len(self.requests)
        try:
            if len(scheduler_output.sampling_req_ids) != \
                    len(scheduler_output.num_scheduled_tokens):
                self._update_unsampled(scheduler_output, runner_output)
            self._update(scheduler_output, runner_output, outputs)
        except BaseException:
            unfinished = -1
            raise
        finally:
            # Even when the update raised part-way, no finished request stays in `running`
            # (a request leaves `running` here only by finishing, which takes it out of
            # `requests`).
            if len(self.requests) != unfinished:
                running = RequestStatus.RUNNING
                self.running = [r for r in self.running if r.status is running]
        if self._finished_notices:
            self._deliver_finished()
        return outputs

    def _update_unsampled(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput,
                          ) -> None:
        """The scheduled requests that sample nothing this step: partial prefill chunks."""
        samplers = set(plan.sampling_req_ids)
        computed = plan.num_computed_tokens
        for rid, n in plan.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if rid in samplers or request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self._cache_blocks(request, computed[rid] + n)

    def _update(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput,
                outputs: list[EngineCoreOutput]) -> None:
        """The requests that sampled (or were to sample) this step, in plan order."""
        now = 0.0           # the clock's time(), read at the first first token
        requests, running_status = self.requests, RequestStatus.RUNNING
        sampling, req_ids = plan.sampling_req_ids, runner_output.req_ids
        tokens, lp = runner_output.sampled_token_ids, runner_output.logprobs
        # The worker's rows, in plan order unless some were not sampled (or it reordered).
        row_of = None if req_ids == sampling else dict(zip(req_ids, range(len(req_ids))))
        capacity, cached_blocks = self._capacity, self._cached_blocks
        computed, scheduled = plan.num_computed_tokens, plan.num_scheduled_tokens
        bs = self.kv.block_size
        append = outputs.append
        for row, rid in enumerate(sampling):
            request = requests.get(rid)
            if request is None:
                continue                        # finished or aborted since it was scheduled
            if row_of is not None:
                row = row_of.get(rid)
                if row is None:
                    if rid in runner_output.deferred:
                        # A logits processor was not ready for it: its last token is
                        # computed again next step (its KV is rewritten, the same).
                        request.num_computed_tokens -= 1
                        request.num_output_placeholders -= 1
                        continue
                    raise RuntimeError(f"request {rid} completed its tokens but nothing was "
                                       "sampled for it")
            token = tokens[row]
            request.num_output_placeholders -= 1
            first = not request.first_token_time
            if first:
                request.first_token_time = now = now or self.clock.time()
            status = request.append_output_token(token)
            logprobs = None
            if lp is not None and request.sampling_params.logprobs is not None:
                k = request.sampling_params.logprobs + 1
                logprobs = LogprobsLists([lp.token_ids[row][:k]], [lp.logprobs[row][:k]],
                                         [lp.sampled_ranks[row]])
            if request.status is running_status:
                # The blocks this step completed (with a paged manager, only when it completed
                # one: most steps skip the call).
                if capacity is None or request.num_computed_tokens // bs > cached_blocks.get(
                        rid, 0):
                    self._cache_blocks(request, computed[rid] + scheduled[rid])
            elif status is not None:
                # Preempted by the plan made while this step ran (overlapped steps): it waits,
                # and ends there.
                self._unqueue(request)
            if status is None and not first:
                append(EngineCoreOutput(rid, [token], logprobs))    # most outputs: the token
                continue
            if status is not None:
                self._finish(request, status)
            cached = request.num_cached_tokens
            # (positional: the fields in EngineCoreOutput's order, a third cheaper than keywords)
            append(EngineCoreOutput(
                rid, [token], logprobs, status.finish_reason if status else None,
                request.stop_reason, cached if cached > 0 else 0, request.first_scheduled_time))
        self.num_generation_tokens += len(outputs)

    def _cache_blocks(self, request: Request, through: int) -> None:
        """``cache_computed_blocks`` after a step that computed ``request``'s tokens up to
        ``through``: every time, or (``block_calls_only``) when it completed a block since the
        last call. The manager sees ``num_computed_tokens == through``, as in the synchronous
        loop: under overlapped steps the next step's planned tokens are not registered before
        that step has run (a step that fails must leave no block in the cache it did not
        write)."""
        if self._capacity is not None:
            full = through // self.kv.block_size
            if full <= self._cached_blocks.get(request.request_id, 0):
                return
            self._cached_blocks[request.request_id] = full
        ahead = request.num_computed_tokens
        if ahead == through:
            self.kv.cache_computed_blocks(request)
            return
        request.num_computed_tokens = through
        try:
            self.kv.cache_computed_blocks(request)
        finally:
            request.num_computed_tokens = ahead

    # ------------------------------------------------------------------ introspection
    def check_invariants(self) -> None:
        """The seat and queue counts per group agree with ``running`` and ``waiting`` (tests)."""
        seats = Counter(r.group_id for r in self.running)
        queued = Counter(r.group_id for r in self.waiting)
        assert seats == self._seats, (seats, self._seats)
        assert queued == self._queued, (queued, self._queued)
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        if self.lora is not None:
            self.lora.check_invariants(self.running, self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_ids(self) -> list[str]:
        return list(self.requests)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_blocks_total=self.kv.num_blocks, kv_blocks_free=self.kv.num_free_blocks,
            num_preemptions=self.num_preemptions, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits, kv_blocks_cached=self.kv.num_cached_blocks,
            **(self.lora.stats(self.running, self.waiting) if self.lora is not None else {}))


def _decrement(counter: Counter[str], key: str) -> None:
    if counter[key] <= 1:
        counter.pop(key, None)
    else:
        counter[key] -= 1
