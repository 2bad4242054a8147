"""The built-in ``paged`` KV-cache manager: registers ``corellm.kv.paged.PagedKVCacheManager``
(per-request block tables over the core's ``BlockPool``, automatic prefix caching, LRU eviction).
"""

from __future__ import annotations

from collections.abc import Iterator

from corellm import hookimpl
from corellm.components import BuildContext, KVCacheManagerSpec
from corellm.kv import paged


def _make(options: paged.PagedKVCacheOptions, ctx: BuildContext) -> paged.PagedKVCacheManager:
    assert ctx.num_kv_blocks is not None
    return paged.PagedKVCacheManager.from_options(options, ctx.num_kv_blocks)


@hookimpl
def corellm_kv_cache_managers() -> Iterator[KVCacheManagerSpec]:
    yield KVCacheManagerSpec(name="paged", factory=_make, options=paged.PagedKVCacheOptions,
                             summary="Block pool with per-request block tables and automatic "
                                     "prefix caching.")
