"""Least-frequently-used eviction for corellm's paged KV cache, packaged as an out-of-tree plugin.

The package's ``pyproject.toml`` lists this module in the ``corellm`` entry-point group, so once
the package is installed corellm registers the KV-cache manager ``lfu``. Select it with
``kv_cache: {name: lfu}`` in the config. It is corellm's paged manager with one part replaced:
the choice of which free cached block gives up its contents when the pool needs a fresh block.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from corellm import hookimpl
from corellm.kv.block_pool import EvictionPolicy
from corellm.components import BuildContext, KVCacheManagerSpec
from corellm.kv.paged import PagedKVCacheManager, PagedKVCacheOptions

CORELLM_PLUGIN_API = "1.7"
__version__ = "0.1.0"


class LFUEviction(EvictionPolicy):
    """Evict the free cached block whose contents had the fewest prefix-cache hits since they
    were cached; of equally used blocks, the least recently freed."""

    def __init__(self) -> None:
        self.hits: dict[int, int] = {}               # cached block -> hits on its contents
        self.freed: dict[int, int] = {}              # evictable block -> when it was freed
        self.heap: list[tuple[int, int, int]] = []   # (hits, freed, block), some stale
        self.clock = itertools.count()

    def on_hit(self, block: int) -> None:
        self.hits[block] = self.hits.get(block, 0) + 1

    def on_free(self, block: int) -> None:
        # A hit revives a free block first, so its key cannot change while it is evictable.
        self.freed[block] = when = next(self.clock)
        heapq.heappush(self.heap, (self.hits.get(block, 0), when, block))
        if len(self.heap) > 2 * len(self.freed) + 64:     # mostly revived entries: drop them
            self.heap = [e for e in self.heap if self.freed.get(e[2]) == e[1]]
            heapq.heapify(self.heap)

    def on_revive(self, block: int) -> None:
        del self.freed[block]                         # its heap entry is skipped from now on

    def evict(self) -> int:
        while True:
            _, when, block = heapq.heappop(self.heap)
            if self.freed.get(block) == when:
                del self.freed[block]
                self.hits.pop(block, None)            # the next contents start from zero
                return block

    def clear(self) -> None:
        self.hits.clear()
        self.freed.clear()
        self.heap.clear()

    def __iter__(self) -> Iterator[int]:
        return iter(self.freed)

    def __len__(self) -> int:
        return len(self.freed)

    def __contains__(self, block: object) -> bool:
        return block in self.freed


class LFUOptions(PagedKVCacheOptions):
    """The paged manager's keys (``block_size``, ``enable_prefix_caching``, ``cache_salt``,
    ``hash_seed``, ...); LFU eviction adds none."""

    name: str = "lfu"


def make_lfu(options: LFUOptions, ctx: BuildContext) -> PagedKVCacheManager:
    assert ctx.num_kv_blocks is not None
    return PagedKVCacheManager.from_options(options, ctx.num_kv_blocks, eviction=LFUEviction())


@hookimpl
def corellm_kv_cache_managers() -> Iterator[KVCacheManagerSpec]:
    yield KVCacheManagerSpec(name="lfu", factory=make_lfu, options=LFUOptions,
                             summary="The paged manager, evicting the least used cached block "
                                     "first (LFU) instead of the least recently freed.")
