"""What a scheduling policy sees when it decides: the waiting queue, the step's context and
what a prefix-cache lookup found.

The queue and the context are views the mechanism (``corellm.scheduling.BatchScheduler``) builds
and owns. A policy reads them and answers; it never changes a request's state or a block. They
sit below the interfaces (``SchedulingPolicy`` and ``KVCacheManager`` are written in their
terms), so the scheduler they view is seen through the few attributes they read.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from corellm.request import Request


@dataclass(frozen=True)
class CachedPrefix:
    """What a prefix-cache lookup found for a waiting request.

    ``block_ids`` hold the KV of the request's first ``num_tokens`` tokens (whole blocks, and
    always fewer than all its tokens, so at least one token is left to compute and yield logits).
    ``pending`` says the next block of the request's prefix is being computed by another request
    in the current step: waiting one step would make the hit longer.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    pending: bool = False


NO_CACHED_PREFIX = CachedPrefix()


class _Prefixes(Protocol):
    block_size: int
    num_free_blocks: int

    def find_cached_prefix(self, request: Request) -> CachedPrefix: ...


class _Owner(Protocol):
    """The scheduler a ``SchedulingContext`` views (``BatchScheduler``)."""

    running: list[Request]
    waiting: WaitingQueue
    max_num_batched_tokens: int
    kv: _Prefixes


class _Round(Protocol):
    """The scheduling round in progress (the scheduler's plan of the step)."""

    num_scheduled: dict[str, int]
    admitted: list[Request]
    budget: int
    changes: int


# A heap item: (policy key, arrival_seq, request). arrival_seq is unique, so comparison never
# reaches the request, and equal keys are served in arrival order.
_Item = tuple[Any, int, "Request"]


class WaitingQueue:
    """Requests waiting for admission, ordered by the policy's ``waiting_key`` and partitioned
    by its ``queue_group``.

    Each group is a binary heap of ``(key, arrival_seq, request)``. Removal is lazy: a removed
    request's item stays in its heap until it surfaces (or until removed items outnumber live
    ones, when the heaps are rebuilt), so ``push``, ``remove`` and ``first`` cost O(log n) and a
    policy can take any waiting request, not only the head.

    Read methods for policies: ``first()``, ``heads()``, ``best(k)``, ``len()``, ``in``,
    iteration (O(n), unordered: avoid it per step with thousands waiting).
    """

    _REBUILD_MIN = 256           # never rebuild tiny heaps: lazy deletion is cheaper there

    def __init__(self) -> None:
        self._heaps: dict[Hashable, list[_Item]] = {}
        self._live: dict[str, tuple[Hashable, _Item]] = {}   # request_id -> (group, its item)
        self._dead = 0

    # ------------------------------------------------------------------ the mechanism's side
    def push(self, request: Request, key: Any, group: Hashable = None) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        item = (key, request.arrival_seq, request)
        heapq.heappush(self._heaps.setdefault(group, []), item)
        self._live[request.request_id] = (group, item)

    def remove(self, request: Request) -> bool:
        """Take ``request`` out of the queue; False if it was not waiting."""
        if self._live.pop(request.request_id, None) is None:
            return False
        self._dead += 1
        if self._dead > self._REBUILD_MIN and self._dead > len(self._live):
            self._rebuild()
        return True

    def set_aside(self, request: Request) -> tuple[Hashable, _Item]:
        """Take a waiting ``request`` out of the queue for a while (the mechanism's, within one
        round); ``restore`` puts it back under the same key and arrival order."""
        entry = self._live.pop(request.request_id)
        self._dead += 1              # its heap item is dropped lazily, like a removal's
        return entry

    def restore(self, entry: tuple[Hashable, _Item]) -> None:
        group, (key, seq, request) = entry
        # A new item: the old one, still in the heap, must read as removed.
        item = (key, seq, request)
        heapq.heappush(self._heaps.setdefault(group, []), item)
        self._live[request.request_id] = (group, item)

    def _rebuild(self) -> None:
        heaps: dict[Hashable, list[_Item]] = {}
        for group, item in self._live.values():
            heaps.setdefault(group, []).append(item)
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps, self._dead = heaps, 0

    def _is_live(self, group: Hashable, item: _Item) -> bool:
        entry = self._live.get(item[2].request_id)
        return entry is not None and entry[1] is item

    def _head(self, group: Hashable) -> _Item | None:
        heap = self._heaps[group]
        while heap and not self._is_live(group, heap[0]):
            heapq.heappop(heap)
            self._dead -= 1
        if not heap:
            del self._heaps[group]
            return None
        return heap[0]

    # ------------------------------------------------------------------ the policy's side
    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, request: object) -> bool:
        rid = getattr(request, "request_id", None)
        return rid is not None and rid in self._live and self._live[rid][1][2] is request

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no particular order (O(n))."""
        return (item[2] for _, item in list(self._live.values()))

    def groups(self) -> list[Hashable]:
        """The groups that have waiting requests."""
        return [g for g in list(self._heaps) if self._head(g) is not None]

    def heads(self) -> dict[Hashable, Request]:
        """The best request of each group (O(groups))."""
        out = {}
        for group in list(self._heaps):
            item = self._head(group)
            if item is not None:
                out[group] = item[2]
        return out

    def first(self) -> Request | None:
        """The best request by key over all groups (O(groups)); None when empty."""
        best = None
        for group in list(self._heaps):
            item = self._head(group)
            if item is not None and (best is None or item[:2] < best[:2]):
                best = item
        return None if best is None else best[2]

    def best(self, k: int) -> list[Request]:
        """The ``k`` best requests by key, best first, over all groups: O(k log k) (a
        best-first walk of the heaps, which never sorts the whole queue)."""
        out: list[Request] = []
        frontier: list[tuple[Any, int, int, Hashable]] = []   # key, seq, index, group
        for group in list(self._heaps):
            if self._head(group) is not None:
                item = self._heaps[group][0]
                frontier.append((item[0], item[1], 0, group))
        heapq.heapify(frontier)
        while frontier and len(out) < k:
            _, _, i, group = heapq.heappop(frontier)
            heap = self._heaps[group]
            item = heap[i]
            if self._is_live(group, item):
                out.append(item[2])
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    c = heap[child]
                    heapq.heappush(frontier, (c[0], c[1], child, group))
        return out


class SchedulingContext:
    """The live state a policy decides with, built by the mechanism for each decision round
    (once per ``schedule()``, and for each request entering the queue or finishing).

    * ``now``: ``time.time()`` when the round began (the clock of ``Request.arrival_time``);
      ``waited(request)`` is ``now - arrival_time``.
    * ``step``: the ``schedule()`` round the decision belongs to (1 for the first); a request
      that arrives between rounds N-1 and N is keyed in round N.
    * ``running``: a fresh read-only snapshot (a tuple, in admission order) on every access.
    * ``waiting``: the waiting queue (read it, never change it).
    * ``admitted``: ``(request, num_tokens)`` of the requests this round admitted so far, and
      ``token_budget``: the round's tokens still unplanned (outside ``schedule()``: none and the
      whole budget).
    * ``cached_prefix(request)`` / ``cached_tokens(request)``: the prefix-cache lookup of a
      waiting request, done only when a policy asks and memoized for the round, so a policy that
      looks at a few candidates pays for a few lookups, not for the whole queue (the memo is
      dropped at each admission or preemption of the round, which change the cache). ``pending`` in
      the result means the next block is being computed in this round: admitting the request
      now would stop admission for the round (it waits one step to find that block cached).
    """

    __slots__ = ("now", "step", "_scheduler", "_plan", "_memo", "_memo_at")

    def __init__(self, now: float, step: int, scheduler: _Owner,
                 plan: _Round | None = None) -> None:
        self.now = now
        self.step = step
        self._scheduler = scheduler
        self._plan = plan
        self._memo: dict[str, CachedPrefix] = {}
        self._memo_at = 0                 # the plan's changes the memo was filled at

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._scheduler.running)

    @property
    def waiting(self) -> WaitingQueue:
        return self._scheduler.waiting

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def admitted(self) -> tuple[tuple[Request, int], ...]:
        if self._plan is None:
            return ()
        return tuple((r, self._plan.num_scheduled[r.request_id]) for r in self._plan.admitted)

    @property
    def token_budget(self) -> int:
        return self._scheduler.max_num_batched_tokens if self._plan is None else self._plan.budget

    @property
    def num_free_blocks(self) -> int:
        return self._scheduler.kv.num_free_blocks

    @property
    def block_size(self) -> int:
        return self._scheduler.kv.block_size

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The prefix-cache lookup of a *waiting* request (no side effects)."""
        if self._plan is not None and self._plan.changes != self._memo_at:
            # An admission or preemption since the memo was filled may have evicted or pinned
            # blocks, or announced pending ones: look up again.
            self._memo.clear()
            self._memo_at = self._plan.changes
        prefix = self._memo.get(request.request_id)
        if prefix is None:
            prefix = self._memo[request.request_id] = \
                self._scheduler.kv.find_cached_prefix(request)
        return prefix

    def cached_tokens(self, request: Request) -> int:
        """Leading tokens of a *waiting* request found in the prefix cache (0 without prefix
        caching). A running request's computed tokens are ``request.num_computed_tokens``."""
        return self.cached_prefix(request).num_tokens

    def waited(self, request: Request) -> float:
        """Seconds since the request arrived."""
        return self.now - request.arrival_time
