"""Prefix-aware residual shortest-job-first: a corellm scheduling policy, packaged as an
out-of-tree plugin.

Once the package is installed, corellm registers the scheduler ``residual_sjf`` (select it with
``scheduler: {name: residual_sjf}``). Among the waiting requests, the one with the fewest tokens
left to compute after its prefix-cache hit goes first, and waiting earns credit so that nothing
starves. See the README for the idea and ``ResidualSJFPolicy`` for the reasoning.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from pydantic import Field

from corellm import hookimpl
from corellm.components import SchedulerOptions, SchedulerSpec
from corellm.interfaces import SchedulingPolicy
from corellm.request import Request
from corellm.scheduling import SchedulingContext, WaitingQueue, policy_scheduler

__version__ = "0.1.0"

SCHEDULER_NAME = "residual_sjf"


class ResidualSJFOptions(SchedulerOptions):
    """The knobs of ``residual_sjf``, next to the shared batching ones."""

    aging_tokens_per_s: float = Field(
        100.0, ge=0, le=1e6,
        description="How many uncached tokens one second of waiting is worth. A request is "
                    "admitted before any request that arrived more than (its tokens / this) "
                    "seconds after it, so nothing starves; 0 is pure shortest-job-first.")
    rerank_window: int = Field(
        32, ge=1, le=4096,
        description="How many of the best waiting requests (by the key taken at enqueue) are "
                    "re-ranked with the prefix cache as it is now at each admission.")


class ResidualSJFPolicy(SchedulingPolicy):
    """Admit the waiting request with the least prefill work left, aged by its wait.

    The *residual* of a waiting request is the tokens it must compute before it yields its next
    token: ``num_tokens`` (the prompt, plus the outputs of a preempted request) minus the leading
    tokens the prefix cache already holds. Ordering by residual rather than by prompt length is
    what makes the policy prefix-aware: a long prompt whose system prompt is cached is a short
    job.

    Its score is ``residual + aging * (arrival_time - epoch)``, the smallest first. This orders
    exactly as ``residual - aging * waited``, the usual linear aging, but it does not change while
    the request waits, so it can be a heap key (O(log n) per enqueue, whatever the queue length).
    It bounds starvation: a request of ``N`` tokens goes before every request that arrived more
    than ``N / aging`` seconds after it, because that one's score exceeds ``N`` plus the first
    one's arrival term even with a residual of zero.

    The residual changes while the request waits: other requests fill the cache, LRU eviction
    empties it. The heap key takes the cache hit at enqueue; ``select`` re-ranks the
    ``rerank_window`` best keys with the hit as it is now (``ctx.cached_tokens``, one memoized
    lookup per candidate and round). A request outside the window whose hit grew since enqueue
    is not seen until it enters the window: the price of not rescoring 10,000 requests a step.
    The starvation bound above still holds, since the window always holds the best static keys
    and a live residual is at most ``num_tokens``.
    """

    def __init__(self, aging_tokens_per_s: float = 100.0, rerank_window: int = 32) -> None:
        self.aging_tokens_per_s = aging_tokens_per_s
        self.rerank_window = rerank_window
        # Arrival times are epoch seconds; measuring them from here keeps the aging term small
        # enough that a float still resolves a fraction of a token.
        self.epoch = time.time()

    def score(self, request: Request, cached_tokens: int) -> float:
        """The aged residual: the smaller, the sooner the request is admitted."""
        residual = request.num_tokens - cached_tokens
        return residual + self.aging_tokens_per_s * (request.arrival_time - self.epoch)

    def waiting_key(self, request: Request, ctx: SchedulingContext) -> float:
        # Ties (equal scores) go in arrival order: the queue breaks them by arrival_seq.
        return self.score(request, ctx.cached_tokens(request))

    def select(self, waiting: WaitingQueue, ctx: SchedulingContext) -> Request | None:
        candidates = waiting.best(self.rerank_window)
        return min(candidates,
                   key=lambda r: (self.score(r, ctx.cached_tokens(r)), r.arrival_seq))

    def choose_victim(self, running: Sequence[Request], ctx: SchedulingContext) -> Request:
        """Preempt the running request this policy would admit last: the largest
        ``score(request, cached_tokens=0)``, of equal scores the latest arrival.

        - It is the policy's own order, so the starvation bound carries over to preemption: an
          old request has a small aged score and is preempted only after the younger ones of
          comparable size. A victim chosen by size alone could be the same aged long request
          again and again.
        - No cache credit: under KV pressure the victim's freed blocks are the first to be
          evicted by the allocations that follow (its tail first), so its whole ``num_tokens``
          is the realistic cost of bringing it back. (It re-enters the queue scored with what
          is still cached at that moment; the re-rank in ``select`` sees what survives.) Among
          requests of one age the largest goes first: the SJF choice (the large job yields to
          the small ones), and it frees the most blocks, so one preemption usually relieves the
          pressure.
        - Remaining output is not used: ``max_tokens`` is an upper bound, not a length.

        ``preempt_for`` keeps its default (never preempt for a waiting request): preemption is by
        recomputation, so preempting a running request for a shorter waiting one throws away
        computed work, and with aging the two could trade places repeatedly.
        """
        return max(running, key=lambda r: (self.score(r, 0), r.arrival_seq))


def _build(options: SchedulerOptions) -> ResidualSJFPolicy:
    assert isinstance(options, ResidualSJFOptions)
    return ResidualSJFPolicy(options.aging_tokens_per_s, options.rerank_window)


@hookimpl
def corellm_schedulers() -> Iterator[SchedulerSpec]:
    yield policy_scheduler(
        SCHEDULER_NAME, _build, options=ResidualSJFOptions,
        summary="Fewest uncached tokens first (prefix-aware SJF), aged so nothing starves.")
