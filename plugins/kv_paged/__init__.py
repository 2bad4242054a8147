"""The built-in ``paged`` KV-cache manager: registers ``corellm.kv_cache.PagedKVCacheManager``
(per-request block tables over the core's ``BlockPool``, automatic prefix caching, LRU eviction).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from corellm import hookimpl, kv_cache
from corellm.components import BuildContext, KVCacheManagerSpec
from corellm.deprecation import warn_deprecated

# Names this module exported before they moved to corellm.kv_cache; kept through corellm 0.4.
_MOVED = ("PagedKVCacheManager", "PagedKVCacheOptions")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        # ``from corellm_plugins.kv_paged import X`` first probes X with hasattr (importlib's
        # _handle_fromlist), then reads it: warn on the read only, once per import.
        if sys._getframe(1).f_code.co_name != "_handle_fromlist":
            warn_deprecated(f"corellm_plugins.kv_paged.{name}", f"corellm.kv_cache.{name}",
                            "0.5")
        return getattr(kv_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _make(options: kv_cache.PagedKVCacheOptions,
          ctx: BuildContext) -> kv_cache.PagedKVCacheManager:
    assert ctx.num_kv_blocks is not None
    return kv_cache.PagedKVCacheManager.from_options(options, ctx.num_kv_blocks)


@hookimpl
def corellm_kv_cache_managers() -> Iterator[KVCacheManagerSpec]:
    yield KVCacheManagerSpec(name="paged", factory=_make, options=kv_cache.PagedKVCacheOptions,
                             summary="Block pool with per-request block tables and automatic "
                                     "prefix caching.")
