"""The paged KV-cache manager: per-request block tables over a ``corellm.kv.block_pool.BlockPool``,
with automatic prefix caching (on by default). The built-in ``paged`` KV-cache manager is this
class; a plugin that changes one part of it (which cached block to evict, say) builds on it
rather than re-implementing it.

Prefix caching, in vLLM's full-block style: every full block of a request is identified by a
chained hash of all tokens up to its end (``corellm.kv.block_pool.BlockHasher``). When a block has
been computed it is registered under its hash; when its last holder frees it, it stays findable
until a fresh allocation evicts it, and the pool's ``EvictionPolicy`` (LRU unless given another)
chooses which cached block that is. A new request takes the longest run of its leading blocks
found in the cache and computes only the rest.
"""

from __future__ import annotations

from pydantic import Field

from corellm.kv.block_pool import BlockHash, BlockHasher, BlockPool, EvictionPolicy
from corellm.specs import KVCacheOptions
from corellm.interfaces import NO_CACHED_PREFIX, CachedPrefix, KVCacheManager
from corellm.request import Request

__all__ = ["PagedKVCacheManager", "PagedKVCacheOptions"]


class PagedKVCacheOptions(KVCacheOptions):
    """The ``kv_cache`` section of the ``paged`` manager. A manager built on
    ``PagedKVCacheManager`` subclasses it to keep these keys and add its own."""

    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of prompt prefixes computed before.")
    cache_salt: str | None = Field(
        None, description="Mixed into every block hash (with the request's own cache_salt): "
        "engines sharing hash_seed but not cache_salt never share cache keys.")
    hash_seed: str | None = Field(
        None, description="Key of the block hashes. Unset, a random key per process keeps "
        "cache keys unpredictable; set it to get the same keys in every process.")


class PagedKVCacheManager(KVCacheManager):
    """Block tables over a ``BlockPool`` of ``num_blocks`` blocks of ``block_size`` tokens.

    ``allocate_slots`` is all or nothing; ``free`` releases a request's blocks tail first and is
    idempotent. With ``enable_prefix_caching`` the completed blocks of every request are
    registered under their chained hashes (keyed by ``hash_seed``, rooted in ``cache_salt``, the
    request's own salt and its LoRA adapter, if any) and found again by
    ``find_cached_prefix``; blocks that a running request completes this step are reported as
    ``pending``, so a waiting request with the same prefix can wait for them instead of
    computing a copy.

    ``eviction`` is the pool's ``EvictionPolicy`` (None: ``LRUEviction``), the object that
    decides which free cached block gives up its contents when the pool runs out of uncached
    ones. ``check_invariants`` checks the pool, the policy's set and the block tables against
    each other.
    """

    block_calls_only = True     # both calls change nothing between block boundaries

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 cache_salt: str | None = None, hash_seed: str | None = None,
                 eviction: EvictionPolicy | None = None) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, eviction)
        self._tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_salt = cache_salt
        self.hasher = BlockHasher(hash_seed) if enable_prefix_caching else None
        # Per request: [root, h(block 0), h(block 1), ...] for its full blocks so far.
        self._hashes: dict[str, list[BlockHash]] = {}
        # Per request: how many leading blocks of its table were found in or offered to the cache.
        self._num_cached: dict[str, int] = {}
        # Hashes of blocks being computed this step -> the requests computing them (several
        # when some were admitted without waiting, or a request was freed mid-step).
        self._pending: dict[BlockHash, set[str]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @classmethod
    def from_options(cls, options: PagedKVCacheOptions, num_blocks: int, *,
                     eviction: EvictionPolicy | None = None) -> PagedKVCacheManager:
        """The manager a ``kv_cache`` section describes, over ``num_blocks`` blocks (a
        factory's ``ctx.num_kv_blocks``)."""
        return cls(num_blocks, options.block_size,
                   enable_prefix_caching=options.enable_prefix_caching,
                   cache_salt=options.cache_salt, hash_seed=options.hash_seed, eviction=eviction)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    # ------------------------------------------------------------------ prefix cache
    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        assert self.hasher is not None
        hashes = self._hashes.get(request.request_id)
        if hashes is None:
            # A LoRA adapter's KV entries are its own: its requests' chains start apart.
            lora = request.lora_request
            salts = (self.cache_salt, request.sampling_params.cache_salt)
            root = self.hasher.root(*salts) if lora is None else \
                self.hasher.root(*salts, lora.cache_salt)
            hashes = self._hashes[request.request_id] = [root]
        if len(hashes) <= num_blocks:
            self.hasher.extend(hashes, request.all_token_ids, self.block_size, num_blocks)
        return hashes

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        if not self.enable_prefix_caching:
            return NO_CACHED_PREFIX
        # At least the last token is computed (for its logits), so its block is never a hit.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks = []
        for h in hashes[1:max_blocks + 1]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        pending = len(blocks) < max_blocks and hashes[len(blocks) + 1] in self._pending
        return CachedPrefix(tuple(blocks), len(blocks) * self.block_size, pending)

    def cache_computed_blocks(self, request: Request) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= start:
            return                      # no block completed since the last call (most steps)
        table = self._tables.get(rid)
        if not table:
            return
        hashes = self._block_hashes(request, full)
        for i in range(start, full):
            h = hashes[i + 1]
            self.pool.cache_block(table[i], h)
            self._unmark_pending(h, rid)
        self._num_cached[rid] = full

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       prefix: CachedPrefix | None = None) -> list[int] | None:
        rid = request.request_id
        if prefix is None:
            table = self._tables.get(rid)
            if table is not None:
                total = request.num_computed_tokens + num_new_tokens
                block_size = self.block_size
                if total <= len(table) * block_size:
                    # The blocks held have room (most decode steps): nothing to allocate, only
                    # the blocks these tokens complete to announce, as below.
                    if self.enable_prefix_caching:
                        known = len(request.all_token_ids)
                        if (total if total < known else known) // block_size \
                                > self._num_cached.get(rid, 0):
                            self._mark_pending(request, total)
                    return []
        table = self._tables.get(rid, [])
        hit = prefix.block_ids if prefix is not None else ()
        if prefix is not None and table:
            raise RuntimeError(f"request {rid} already holds blocks; a prefix is only for "
                               "admission")
        computed = prefix.num_tokens if prefix is not None else request.num_computed_tokens
        total = computed + num_new_tokens
        needed = -(-total // self.block_size) - len(table) - len(hit)
        # Hit blocks nobody holds are counted as free now; taking them leaves fewer to allocate.
        revived = sum(1 for b in hit if self.pool.ref_cnt[b] == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return None
        if prefix is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += prefix.num_tokens
            self._num_cached[rid] = len(hit)
        self.pool.touch(hit)
        table.extend(hit)
        new = self.pool.allocate(max(needed, 0))
        table.extend(new)
        if table:
            self._tables[rid] = table
        if self.enable_prefix_caching:
            self._mark_pending(request, total)
        return new

    def _mark_pending(self, request: Request, total: int) -> None:
        """The first uncached block this step's tokens complete: announced so that a waiting
        request with the same prefix can wait for it instead of computing a copy. (Only that
        one: a waiting request's first missing block follows cached ones, so it is the first
        uncached block of a range being computed, or none of it.)"""
        rid = request.request_id
        full = min(total, len(request.all_token_ids)) // self.block_size
        start = self._num_cached.get(rid, 0)
        if full <= start:
            return
        hashes = self._block_hashes(request, full)
        lookup = self.pool.lookup
        for i in range(start, full):
            h = hashes[i + 1]
            if lookup(h) is None:
                self._pending.setdefault(h, set()).add(rid)
                return

    def _unmark_pending(self, h: BlockHash, rid: str) -> None:
        owners = self._pending.get(h)
        if owners is not None:
            owners.discard(rid)
            if not owners:
                del self._pending[h]

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table:
            # Tail first: a request's last blocks are the first evicted, its prefix the last.
            self.pool.free(reversed(table))
        self._num_cached.pop(rid, None)
        hashes = self._hashes.pop(rid, None)
        if hashes and self._pending:
            for h in hashes[1:]:
                self._unmark_pending(h, rid)

    def get_block_ids(self, request: Request) -> list[int]:
        return self._tables.get(request.request_id, [])

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's reference count equals the number of block
        tables holding it, and no table holds a block twice."""
        self.pool.check_invariants()
        holders = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert table, f"request {rid} has an empty block table"
            assert len(set(table)) == len(table), f"request {rid} holds a block twice"
            for b in table:
                holders[b] += 1
            assert self._num_cached.get(rid, 0) <= len(table), rid
        for b in range(self.num_blocks):
            assert holders[b] == self.pool.ref_cnt[b], \
                f"block {b}: reference count {self.pool.ref_cnt[b]}, held by {holders[b]}"
        for owners in self._pending.values():
            assert owners, "an empty pending entry"
            for rid in owners:
                assert rid in self._tables, f"pending block of {rid}, which holds no blocks"
