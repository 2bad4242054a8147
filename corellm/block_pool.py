"""Block pool bookkeeping shared by KV-cache manager plugins: a free list and reference counts.

A block is either free (ref count 0, in the free list exactly once) or held (ref count >= 1,
not in the free list). ``check_invariants`` verifies that, and tests call it after every step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] = 1
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was held")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        for b in range(self.num_blocks):
            in_free = b in free
            assert in_free == (self.ref_cnt[b] == 0), f"block {b}: ref {self.ref_cnt[b]}, free {in_free}"
