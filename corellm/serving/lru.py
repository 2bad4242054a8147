"""``ByteLRU``: a mapping bounded by the bytes of what it keeps, not by its number of entries.

A cache bounded by a count keeps as many large entries as small ones: 512 cached JSON schemas
are a few hundred kilobytes or, each padded to 900 KB by a client, 460 MB. Here every entry is
put with its size (its key's and its value's, as the caller counts them) and the least recently
used entries leave until the total is within ``limit_bytes``; an entry larger than the limit
is not kept at all. Thread-safe."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# What an entry costs beyond the sizes given: the ordered dict's node, the key's and the tuple
# holding the value and its size (measured with sys.getsizeof on CPython 3.11, rounded up).
ENTRY_OVERHEAD = 160


class ByteLRU(Generic[K, V]):
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.nbytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Keep ``value`` under ``key``, counting ``size`` bytes for it (plus the entry's own
        overhead); the least recently used entries leave to make room."""
        size += ENTRY_OVERHEAD + (sys.getsizeof(key) if not isinstance(key, bytes)
                                  else len(key) + 33)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if size > self.limit_bytes:
                return
            self._entries[key] = (value, size)
            self.nbytes += size
            while self.nbytes > self.limit_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.nbytes -= freed

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0
