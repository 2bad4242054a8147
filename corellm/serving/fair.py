"""A fair queue for work that many clients share: the cheapest job first, with aging, on two
threads, one of them kept for small jobs. The server's preprocessing (tokenizing prompts,
rendering chat templates) runs on one; constraint checks and grammar compiles run on others,
whose threads each drive a child process that a deadline can kill (``corellm.serving.sandbox``)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[float, int, float, Future, Callable[[], Any]]    # key, order, cost, future, work


class FairExecutor:
    """Runs preprocessing jobs (parsing large bodies, chat templates, tokenizing) off the event
    loop, cheapest first, with aging.

    Each job comes with an estimate of its cost (about a microsecond a unit: a character to
    tokenize). It is queued under the key ``AGING * W + cost``, where ``W`` is the work clock:
    the total cost of the jobs started so far; the smallest key runs first. So a small job
    passes the large ones queued before it, which keeps a one-token completion from waiting
    behind twenty 1 MiB chat bodies; yet a large job is passed by a later, smaller one only
    while the work started since it arrived is less than ``1 / AGING`` times the difference in
    their costs, so it is never starved: it waits for at most about ``1 / AGING`` times its own
    cost in later clients' work.

    Neither FIFO nor a round-robin per connection or per client address would do: requests
    from one host each come on a connection of their own, and the victim of a FIFO waits for
    everything queued before it. Keys counted from the key of the last job started (the virtual
    time of start-time fair queueing) would not do either: when twenty jobs of equal cost
    arrive together, starting the first moves that clock to their common key, and a small job
    arriving next queues behind the other nineteen. The work clock moves by the work actually
    started, and only ``AGING`` of it counts against a newcomer.

    The jobs of one request (the prompts of a completions request) are chained: each one's key
    adds its cost to the previous one's, so a request of 128 prompts counts as one large job
    that other clients' small jobs pass, and not as 128 small ones.

    A job runs to its end once started. Two threads run them: one takes any job, the other only
    jobs of at most ``SMALL_COST`` (about 4 ms), so a small job never waits for a large one that
    is running (a 1 MiB prompt that fits the context of a large model, or a 1 MiB /tokenize
    prompt, keeps the tokenizer busy for many small jobs' worth). Not more threads, and no large
    jobs on the second: parsing JSON and rendering Jinja hold the GIL (only the Rust tokenizer's
    encode releases it), so two large jobs at once take no less time than one after the other,
    and each thread that holds the GIL delays every step of the event loop.
    """

    AGING = 1 / 8
    SMALL_COST = 4_096

    def __init__(self, name: str, small_cost: float | None = None) -> None:
        if small_cost is not None:
            self.SMALL_COST = small_cost
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._small: list[_Job] = []
        self._large: list[_Job] = []
        self._work = 0.0                    # the work clock: the cost of every job started
        self._order = itertools.count()     # equal keys run in arrival order
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(small_only,), daemon=True,
                             name=f"{name}-{'small' if small_only else 'any'}")
            for small_only in (False, True)]
        for t in self._threads:
            t.start()

    def submit(self, jobs: Sequence[Callable[[], Any]], costs: Sequence[float]) -> list[Future]:
        """Queue one request's jobs, chained (see the class); a cost counts as at least 1."""
        futures: list[Future] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the preprocessing pool is shut down")
            key = self.AGING * self._work
            for job, cost in zip(jobs, costs, strict=True):
                cost = max(cost, 1.0)
                key += cost
                fut: Future = Future()
                heapq.heappush(self._small if cost <= self.SMALL_COST else self._large,
                               (key, next(self._order), cost, fut, job))
                futures.append(fut)
            self._wake.notify_all()
        return futures

    async def run(self, job: Callable[[], T], cost: float) -> T:
        fut, = self.submit([job], [cost])
        return await asyncio.wrap_future(fut)

    async def run_all(self, jobs: Sequence[Callable[[], T]], costs: Sequence[float]) -> list[T]:
        """The results of one request's jobs, in order; the first failure cancels the rest."""
        waits = [asyncio.wrap_future(f) for f in self.submit(jobs, costs)]
        try:
            return list(await asyncio.gather(*waits))
        finally:
            for w in waits:
                w.cancel()            # queued jobs of a failed or cancelled request never run

    def _next(self, small_only: bool) -> _Job | None:
        """The queued job of the smallest key this thread may run (under the lock)."""
        queues = [q for q in ((self._small,) if small_only else (self._small, self._large)) if q]
        if not queues:
            return None
        return heapq.heappop(min(queues, key=lambda q: q[0][:2]))

    def _serve(self, small_only: bool) -> None:
        while True:
            with self._lock:
                while not self._closed and (job := self._next(small_only)) is None:
                    self._wake.wait()
                if self._closed:
                    return
                _, _, cost, fut, work = job
                if not fut.set_running_or_notify_cancel():
                    continue
                self._work += cost
            try:
                result = self._execute(work, small_only)
            except BaseException as exc:        # noqa: BLE001 - handed to the waiting request
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _execute(self, work: Callable[[], Any], small_only: bool) -> Any:
        """Run one job on the calling worker thread (``small_only``: the thread kept for small
        jobs); a subclass may run it elsewhere."""
        return work()

    def shutdown(self) -> None:
        """Stop the threads once their running jobs end; queued jobs are cancelled."""
        with self._lock:
            self._closed = True
            queued = self._small + self._large
            self._small, self._large = [], []
            self._wake.notify_all()
        for *_, fut, _ in queued:
            fut.cancel()
