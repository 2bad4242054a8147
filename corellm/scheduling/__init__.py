"""Shared scheduling mechanism: continuous batching with one token budget, chunked prefill and
recompute preemption. Scheduler plugins compose ``BatchScheduler`` with a ``SchedulingPolicy``."""

from corellm.interfaces import SchedulingPolicy
from corellm.scheduling.batch_scheduler import BatchScheduler

__all__ = ["BatchScheduler", "SchedulingPolicy"]
