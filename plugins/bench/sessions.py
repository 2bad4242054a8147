"""When each request of a workload is due, and the prompt it is sent with.

Shared by the two drivers (``engine_driver`` and ``server_client``): both follow the workload
contract (``workload``), under which a follow-up turn is due its think time after its previous
turn finished and is sent with the session's whole history.
"""

from __future__ import annotations

import collections
import heapq

from .metrics import RequestRecord
from .workload import BenchRequest, Workload


class Sessions:
    """When each request of a workload is due, and the prompt it is sent with.

    First turns are due at their ``delay_s``; a follow-up becomes due ``delay_s`` after its
    previous turn finished, and fails (never sent) when that turn failed.
    """

    def __init__(self, workload: Workload) -> None:
        reqs = workload.requests
        if sorted(r.index for r in reqs) != list(range(len(reqs))):
            raise ValueError("workload request indices must be 0..N-1, each once")
        self.requests: dict[int, BenchRequest] = {r.index: r for r in reqs}
        self.children: dict[int, list[int]] = collections.defaultdict(list)
        self._due: list[tuple[float, int]] = []
        for r in reqs:
            if r.follows is None:
                self._due.append((r.delay_s, r.index))
            elif r.follows not in self.requests or r.follows == r.index:
                raise ValueError(f"request {r.index} follows {r.follows}, which is not another "
                                 "request of the workload")
            else:
                self.children[r.follows].append(r.index)
        self._check_acyclic()
        heapq.heapify(self._due)
        self.outstanding = len(reqs)
        self.full_prompts: dict[int, list[int]] = {}
        self.outputs: dict[int, list[int]] = {}

    def _check_acyclic(self) -> None:
        for r in self.requests.values():
            seen, cur = set(), r
            while cur.follows is not None:
                if cur.index in seen:
                    raise ValueError(f"request {r.index}: its chain of previous turns loops")
                seen.add(cur.index)
                cur = self.requests[cur.follows]

    @property
    def done(self) -> bool:
        return self.outstanding == 0

    def next_due(self) -> float | None:
        return self._due[0][0] if self._due else None

    def pop_due(self, now: float) -> list[tuple[float, int]]:
        out = []
        while self._due and self._due[0][0] <= now:
            out.append(heapq.heappop(self._due))
        return out

    def prompt(self, index: int) -> list[int]:
        """The whole prompt of a request (a follow-up's includes its session's history)."""
        r = self.requests[index]
        if r.follows is None:
            ids = list(r.prompt_token_ids)
        else:
            ids = (self.full_prompts[r.follows] + self.outputs[r.follows]
                   + list(r.prompt_token_ids))
        if self.children.get(index):
            self.full_prompts[index] = ids
        return ids

    def finished(self, index: int, end: float, ok: bool, output_ids: list[int] | None = None,
                 ) -> list[int]:
        """Record that a request ended; its follow-ups become due, or (when it failed) fail
        too: returns those failed follow-ups, transitively."""
        self.outstanding -= 1
        children = self.children.get(index, [])
        if ok:
            if children:
                self.outputs[index] = list(output_ids or [])
            for c in children:
                heapq.heappush(self._due, (end + self.requests[c].delay_s, c))
            return []
        failed, stack = [], list(children)
        while stack:
            c = stack.pop()
            failed.append(c)
            stack.extend(self.children.get(c, []))
        self.outstanding -= len(failed)
        return sorted(failed)


def length_error(got: int | None, expected: int, ignore_eos: bool,
                 finish_reason: str | None) -> str | None:
    """Why a finished request's output length is wrong, or None: with ``ignore_eos`` it must be
    exactly ``expected`` tokens; without, it may stop early at EOS (finish_reason "stop") but
    never run past it, nor end short for another reason (a length limit of the server's)."""
    if got == expected or (not ignore_eos and got is not None and got < expected
                           and finish_reason == "stop"):
        return None
    if not ignore_eos and got is not None and got < expected:
        return (f"got {got} output tokens of {expected} with finish_reason {finish_reason} "
                "(only an EOS stop may end a request early)")
    return (f"got {got} output tokens, expected {'' if ignore_eos else 'at most '}{expected} "
            f"(finish_reason {finish_reason})")


def record_for(r: BenchRequest) -> RequestRecord:
    return RequestRecord(index=r.index, expected_output_tokens=r.output_len,
                         priority=r.priority, user=r.user, session_id=r.session_id,
                         follows=r.follows)


def warmup_workload(workload: Workload, n: int, output_len: int) -> Workload:
    """``n`` first turns of the workload, all at once and short: exercises the same prompt
    lengths (and so the same kernels) without warming the prefix cache for the timed run."""
    firsts = [r for r in workload.requests if r.follows is None][:n]
    reqs = [BenchRequest(index=i, prompt_token_ids=list(r.prompt_token_ids),
                         output_len=min(r.output_len, output_len)) for i, r in enumerate(firsts)]
    return Workload(reqs, f"warm-up, {len(reqs)} requests")
