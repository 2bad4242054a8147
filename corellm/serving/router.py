"""Which replica serves a request: the router of a data-parallel server, and its live A/B split.

Two choices per request, both cheap (a hash and a scan of the arm's replicas):

1. **The arm** (an A/B split: replica groups with configs of their own, ``weights`` by name).
   Deterministic: the ``user``, else the ``session_id``, else the request id is hashed
   (BLAKE2b, so the same on every process and after a restart) to a point in [0, 1) that falls
   in one arm's share of the weights. A user, or a conversation, stays in one arm; requests
   without either spread by the weights.
2. **The replica** within the arm: the one with the least outstanding requests (ties taken in
   turn), except that a request of a conversation (``session_id``) goes back to the replica
   that served the conversation before, whose prefix cache holds its turns, while that
   replica is up and has at most ``affinity_slack`` requests more than the least loaded one.
   Beyond that slack the load wins and the conversation moves (its next turns follow it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def unit_hash(key: str) -> float:
    """``key`` as a point in [0, 1), the same in every process."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


class NoReplicaError(RuntimeError):
    """No replica of the arm can take a request now (every one is dead or restarting)."""


class Router:
    """``weights``: arm name -> weight (> 0), in order; ``affinity``: keep conversations on
    their replica; ``max_sessions``: conversations remembered (least recent forgotten)."""

    def __init__(self, weights: dict[str, float], *, affinity: bool = True,
                 affinity_slack: int = 4, max_sessions: int = 100_000) -> None:
        if not weights or any(w <= 0 for w in weights.values()):
            raise ValueError(f"arm weights must be positive, got {weights}")
        self.arms = list(weights)
        total = float(sum(weights.values()))
        self.shares = {a: w / total for a, w in weights.items()}
        self._bounds: list[tuple[float, str]] = []
        acc = 0.0
        for arm, w in weights.items():
            acc += w / total
            self._bounds.append((acc, arm))
        self.affinity = affinity
        self.affinity_slack = affinity_slack
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._turn: dict[str, int] = {}
        self.affine_hits = 0          # requests sent back to their conversation's replica

    def arm_for(self, user: str | None, session_id: str | None, request_id: str) -> str:
        """The arm of a request (see the module's docstring)."""
        if len(self.arms) == 1:
            return self.arms[0]
        point = unit_hash(user or session_id or request_id)
        for bound, arm in self._bounds:
            if point < bound:
                return arm
        return self._bounds[-1][1]

    def pick(self, arm: str, load: Sequence[int], up: Sequence[bool],
             session_id: str | None = None) -> int:
        """The index (within the arm) of the replica to serve a request, given each replica's
        outstanding requests and whether it is up."""
        live = [i for i, ok in enumerate(up) if ok]
        if not live:
            raise NoReplicaError(f"no replica of {arm!r} is up")
        least = min(load[i] for i in live)
        key = (arm, session_id) if session_id is not None and self.affinity else None
        if key is not None:
            prev = self._sessions.get(key)
            if prev is not None and prev < len(up) and up[prev] \
                    and load[prev] <= least + self.affinity_slack:
                self._sessions.move_to_end(key)
                self.affine_hits += 1
                return prev
        tied = [i for i in live if load[i] == least]
        turn = self._turn.get(arm, 0)
        choice = tied[turn % len(tied)]
        self._turn[arm] = turn + 1
        if key is not None:
            self._sessions[key] = choice
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return choice
