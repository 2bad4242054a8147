"""Streaming stop-string matching: one Aho-Corasick automaton per stop list, one integer state
per sample.

``RequestState`` (``corellm.engine.output_processor``) feeds every detokenized delta of every
sample through the automaton of its request's stop list. Each character of a sample's text is
fed exactly once over the whole stream, at O(1) amortized cost whatever the number and the length
of the stop strings; the automaton is built once per distinct stop list (O(total characters)) and
shared, read-only, by every sample and every request that sends the same list.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

# Stop lists up to this many characters in all are cached (built once per distinct list); larger
# ones are built per request, so that a few huge lists cannot pin hundreds of MB in the cache.
_CACHE_MAX_CHARS = 1 << 16
_CACHE_SIZE = 64


class StopStringMatcher:
    """An immutable Aho-Corasick automaton over ``stops``, fed in streaming fashion.

    States are ints; ``0`` (``INITIAL``) is the state before any text. The caller keeps one state
    per text stream and passes it back in: the automaton holds no per-stream data, so one instance
    serves any number of streams (a request's ``n`` samples, every request with the same stop list).

    The state after some text encodes the longest suffix of that text that is a prefix of some
    stop string; it is a function of the whole text so far, not of how the text was split into
    deltas, so matches that span any number of deltas are found.

    What :meth:`feed` reports, for a delta appended to the text already fed (from ``state``):
    among the occurrences of stop strings that END inside the delta (those wholly in earlier text
    were not reported then, e.g. because they came before ``min_tokens``, and are never reported
    later), the one that STARTS first; on equal starts (which come from different ends: a longer
    string that ends later), the one listed first in ``stops``. Duplicate stop strings are allowed
    (the first index wins). This is, exactly, taking for every stop string the first occurrence
    that ends in the delta and keeping the earliest start, ties to the earlier list entry.

    Structure: a trie of the stop strings (``goto``: one dict per state, character -> state), the
    failure link of every state (the state of its longest proper suffix that is in the trie), and,
    per state, the precomputed best output: the longest stop string that is a suffix of the state's
    string (it has the smallest start among all stop strings ending at this character; equal
    lengths at one end mean equal strings, so the lowest index breaks the tie), as its length and
    index (length 0: none). Build: O(total characters of ``stops``); feed: O(len(delta))
    amortized (each character moves at most one level down the trie, and every failure-link step
    moves up one), independent of the number and length of the stop strings (dict operations
    taken as O(1)).
    """

    INITIAL = 0

    __slots__ = ("stops", "max_len", "_goto", "_fail", "_out_len", "_out_idx")

    def __init__(self, stops: Sequence[str]) -> None:
        """``stops``: non-empty strings (an empty one would match everywhere; refused)."""
        self.stops: tuple[str, ...] = tuple(stops)
        if not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError("stop strings must be non-empty strings")
        self.max_len = max(map(len, self.stops), default=0)
        goto: list[dict[str, int]] = [{}]
        out_len = [0]
        out_idx = [0]
        for k, stop in enumerate(self.stops):
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][ch] = nxt
                    goto.append({})
                    out_len.append(0)
                    out_idx.append(0)
                state = nxt
            if not out_len[state]:                 # a duplicate keeps the first index
                out_len[state], out_idx[state] = len(stop), k
        fail = [0] * len(goto)
        # Breadth first, so that a state's failure link (a shorter string) is done before it.
        queue = list(goto[0].values())
        for u in queue:                            # the list grows as it is walked
            for ch, v in goto[u].items():
                queue.append(v)
                f = fail[u]
                while True:
                    t = goto[f].get(ch)
                    if t is not None:
                        break
                    if not f:
                        t = 0
                        break
                    f = fail[f]
                fail[v] = t
                # v's own string (if a stop) is longer than any suffix of it: keep it; else the
                # best output of its longest suffix in the trie, which covers all shorter ones.
                if not out_len[v]:
                    out_len[v], out_idx[v] = out_len[t], out_idx[t]
        self._goto = tuple(goto)
        self._fail = tuple(fail)
        self._out_len = tuple(out_len)
        self._out_idx = tuple(out_idx)

    def __repr__(self) -> str:
        return f"StopStringMatcher({len(self.stops)} stops, {len(self._goto)} states)"

    def advance(self, state: int, text: str) -> int:
        """Feed ``text`` from ``state`` without reporting matches (text before ``min_tokens``);
        returns the new state."""
        return self.feed(state, text)[0]

    def feed(self, state: int, text: str) -> tuple[int, tuple[int, int] | None]:
        """Feed ``text`` (the next delta) from ``state``; returns ``(new_state, match)``.

        ``match`` is None, or ``(start, k)``: the stop string ``self.stops[k]`` occurs at offset
        ``start`` relative to the beginning of ``text`` (negative when it begins in earlier text)
        and is the match to report, chosen as the class docstring says. The whole of ``text`` is
        fed either way, so ``new_state`` is the state after it."""
        goto, fail, out_len, out_idx = self._goto, self._fail, self._out_len, self._out_idx
        best_start = best_k = 0
        found = False
        pos = 0
        for ch in text:
            pos += 1
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            n = out_len[state]
            if n:
                start = pos - n
                if not found or start < best_start or (start == best_start
                                                       and out_idx[state] < best_k):
                    best_start, best_k, found = start, out_idx[state], True
        return state, ((best_start, best_k) if found else None)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached_matcher(stops: tuple[str, ...]) -> StopStringMatcher:
    return StopStringMatcher(stops)


def stop_string_matcher(stops: Sequence[str]) -> StopStringMatcher:
    """The matcher for ``stops``: from a small LRU cache keyed by the tuple of stop strings (so
    the usual case, every request of an application sending the same list, builds it once), or
    built afresh for lists of more than 64K characters in all (never cached)."""
    key = tuple(stops)
    if sum(map(len, key)) > _CACHE_MAX_CHARS:
        return StopStringMatcher(key)
    return _cached_matcher(key)
