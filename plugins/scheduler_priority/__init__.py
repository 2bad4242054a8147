"""Priority scheduling: lower ``priority`` runs first, ties by arrival (vLLM's convention).

The waiting queue is ordered by (priority, arrival); under KV pressure the worst running request
by (priority, arrival) is preempted; and, unless ``preempt_lower_priority`` is off, a selected
waiting request preempts the worst running request when that one has a strictly worse priority
and the batch or the KV pool is full, as vLLM v0's priority scheduling did (vLLM v1 preempts only
under KV pressure: ``preempt_lower_priority: false``). It does so only when preempting the worse
requests could make room. Equal priorities never preempt each other, so nothing thrashes between
two requests of one class.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pydantic import Field

from corellm import hookimpl
from corellm.components import SchedulerOptions, SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import SchedulingContext, policy_scheduler


class PrioritySchedulerOptions(SchedulerOptions):
    preempt_lower_priority: bool = Field(
        True, description="A waiting request preempts a running one of strictly worse priority "
                          "when the batch or the KV pool is full.")


def _rank(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_seq


class PriorityPolicy(SchedulingPolicy):
    def __init__(self, preempt_lower_priority: bool = True) -> None:
        self.preempt_lower_priority = preempt_lower_priority

    def waiting_key(self, request: Request, ctx: SchedulingContext) -> int:
        return request.priority          # the queue breaks ties by arrival

    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        return max(running, key=_rank)

    def preempt_for(self, request: Request, running: Sequence[Request],
                    ctx: SchedulingContext) -> Request | None:
        if not self.preempt_lower_priority:
            return None
        lower = [r for r in running if r.priority > request.priority]
        if not lower or not self._room_after_preempting(request, lower, ctx):
            return None
        return max(lower, key=_rank)

    @staticmethod
    def _room_after_preempting(request: Request, lower: Sequence[Request],
                               ctx: SchedulingContext) -> bool:
        """Whether preempting every lower-priority request could fit this step's chunk of
        ``request``: otherwise their work would be thrown away for nothing. An estimate: a
        request's blocks are taken as its computed tokens' (shared prefix blocks, which free
        nothing, make it optimistic)."""
        def blocks(tokens: int) -> int:
            return -(-tokens // ctx.block_size)
        chunk = min(request.num_tokens - ctx.cached_tokens(request), ctx.token_budget)
        return blocks(chunk) <= ctx.num_free_blocks + sum(blocks(r.num_computed_tokens)
                                                          for r in lower)


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield policy_scheduler(
        "priority", lambda options: PriorityPolicy(options.preempt_lower_priority),
        options=PrioritySchedulerOptions,
        summary="Lowest priority value first, ties by arrival; better priority preempts worse.")
