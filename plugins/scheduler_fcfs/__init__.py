"""First-come, first-served: admit in arrival order, preempt the most recently admitted."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from corellm import hookimpl
from corellm.components import BuildContext, SchedulerOptions, SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import BatchScheduler


class FCFSPolicy(SchedulingPolicy):
    def waiting_key(self, request: Request) -> int:
        return request.arrival_seq

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


def _make(options: SchedulerOptions, ctx: BuildContext) -> BatchScheduler:
    assert ctx.kv_cache_manager is not None
    return BatchScheduler(options, ctx.kv_cache_manager, FCFSPolicy())


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield SchedulerSpec(name="fcfs", factory=_make, options=SchedulerOptions,
                        summary="First come, first served; preempts the most recently admitted.")
