"""The engine's clock: wall time for a real run, virtual time for a simulated one.

Everything in the core that asks "what time is it" asks the engine's clock: the scheduler (its
``SchedulingContext.now`` and each request's ``first_scheduled_time``), the engine core (the
``timestamp`` of every ``StepStats`` and of every finished request's record) and the offline
benchmark runner (arrivals, token timestamps). An executor that simulates its steps (the ``sim``
executor) brings a ``VirtualClock`` and advances it by each step's predicted duration, so the
same scheduler, KV-cache manager and runner code sees hours of traffic go by in seconds.

Two readings, as in the standard library: ``time()`` is seconds since the epoch (the clock of
``Request.arrival_time``), ``monotonic()`` measures intervals. A virtual clock starts at the
wall time of its creation and both readings advance together.
"""

from __future__ import annotations

import time as _time


class Clock:
    """The wall clock. ``sleep`` really sleeps."""

    is_virtual = False

    def time(self) -> float:
        return _time.time()

    def monotonic(self) -> float:
        return _time.perf_counter()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            _time.sleep(seconds)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


WALL_CLOCK = Clock()


class VirtualClock(Clock):
    """Time that passes only when told to: ``advance`` (a simulated step) or ``sleep`` (an idle
    wait for the next arrival) move it forward, instantly."""

    is_virtual = True

    def __init__(self, start: float | None = None) -> None:
        self._epoch = _time.time() if start is None else float(start)
        self._now = 0.0

    def time(self) -> float:
        return self._epoch + self._now

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:            # also refuses NaN
            raise ValueError(f"a clock cannot go back or stand still at {seconds!r} s")
        self._now += seconds

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._now += seconds

    def __repr__(self) -> str:
        return f"VirtualClock(at {self._now:.6f} s)"
