"""First-come, first-served: admit in arrival order, preempt the most recently admitted."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from corellm import hookimpl
from corellm.components import SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import SchedulingContext, policy_scheduler


class FCFSPolicy(SchedulingPolicy):
    def waiting_key(self, request: Request, ctx: SchedulingContext) -> int:
        return request.arrival_seq

    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        return running[-1]


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield policy_scheduler("fcfs", lambda options: FCFSPolicy(),
                           summary="First come, first served; preempts the most recently admitted.")
