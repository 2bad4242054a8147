"""The paged KV-cache manager: per-request block tables over the core's BlockPool."""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.block_pool import BlockPool
from corellm.components import BuildContext, KVCacheManagerSpec, KVCacheOptions
from corellm.interfaces import KVCacheManager
from corellm.request import Request


class PagedKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        table = self._tables.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        needed = -(-total // self.block_size) - len(table)
        if needed <= 0:
            return []
        if needed > self.pool.num_free_blocks:
            if not table:
                del self._tables[request.request_id]
            return None
        new = self.pool.allocate(needed)
        table.extend(new)
        return new

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        if table:
            # Tail first, so the blocks of a request's start are the last to be reused.
            self.pool.free(reversed(table))

    def get_block_ids(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = [b for t in self._tables.values() for b in t]
        assert len(held) == len(set(held)), "a block is held by two requests"
        assert len(held) + self.pool.num_free_blocks == self.num_blocks, "a block is lost"


def _make(options: KVCacheOptions, ctx: BuildContext) -> PagedKVCacheManager:
    assert ctx.num_kv_blocks is not None
    return PagedKVCacheManager(ctx.num_kv_blocks, options.block_size)


@hookimpl
def corellm_kv_cache_managers() -> Iterator[KVCacheManagerSpec]:
    yield KVCacheManagerSpec(name="paged", factory=_make, options=KVCacheOptions,
                             summary="Block pool with per-request block tables.")
