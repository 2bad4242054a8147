"""Shared scheduling mechanism: continuous batching with one token budget, chunked prefill and
recompute preemption. Scheduler plugins compose ``BatchScheduler`` with a ``SchedulingPolicy``,
which decides with a ``SchedulingContext`` and the ``WaitingQueue``; ``policy_scheduler`` turns a
policy class into the spec a plugin yields."""

from __future__ import annotations

from collections.abc import Callable

from corellm.components import BuildContext, SchedulerOptions, SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.scheduling.batch_scheduler import BatchScheduler
from corellm.policy_view import SchedulingContext, WaitingQueue

__all__ = ["BatchScheduler", "SchedulingContext", "SchedulingPolicy", "WaitingQueue",
           "policy_scheduler"]


def policy_scheduler(name: str, policy: Callable[[SchedulerOptions], SchedulingPolicy], *,
                     summary: str = "",
                     options: type[SchedulerOptions] = SchedulerOptions) -> SchedulerSpec:
    """A ``SchedulerSpec`` whose factory composes ``BatchScheduler`` with ``policy(options)``.

    ``policy`` is called with the section's validated options (an instance of ``options``), so a
    policy can read its own knobs; a policy class whose ``__init__`` takes no options can be
    wrapped as ``lambda options: MyPolicy()``.
    """
    def build(opts: SchedulerOptions, ctx: BuildContext) -> BatchScheduler:
        if ctx.kv_cache_manager is None:
            raise ValueError("a scheduler needs ctx.kv_cache_manager")
        return BatchScheduler(opts, ctx.kv_cache_manager, policy(opts))
    return SchedulerSpec(name=name, factory=build, options=options, summary=summary)
