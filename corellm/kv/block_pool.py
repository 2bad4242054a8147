"""KV-block bookkeeping for KV-cache managers: reference counts, the free blocks, the
prefix-cache map from block hashes to blocks, and the eviction policy that decides which cached
block gives up its contents when a fresh one is needed.

A block is in exactly one of three states:

* **held**: reference count >= 1 (one per request whose block table contains it);
* **free, cached**: reference count 0, but its contents are still identified by a hash, so a new
  request with the same prefix can take it back (``touch``). These blocks belong to the pool's
  ``EvictionPolicy``, which chooses the one to evict (its hash forgotten) when a fresh block is
  needed and no uncached free block is left. ``LRUEviction``, the default, evicts the least
  recently freed;
* **free, uncached**: reference count 0, no hash: free for anyone, and handed out first, the
  most recently freed first. Where the pool's memory is mapped on first touch (the CPU
  platform's), reusing the blocks just freed keeps its resident memory at the most blocks ever
  held at once; handing out the longest-free block first would walk through, and make resident,
  the whole pool however few blocks are in use.

Only full blocks are ever hashed, and a block is hashed only after its KV entries were written
(the manager calls ``cache_block`` after the step that computed them), so a cached block is never
written again while it is shared. ``check_invariants`` verifies all of this, the policy's set
included; tests call it after every step.

``BlockHasher`` computes the chained block hashes: keyed BLAKE2b (``hashlib``) over the parent
block's hash and the block's token ids, so a hash identifies the whole prefix up to and including
its block. The key is random per process unless configured, so cache keys cannot be predicted from
outside the process; a cache salt enters the root of the chain to isolate tenants.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

BlockHash = bytes


class BlockHasher:
    """Chained, keyed block hashes: ``h(i) = BLAKE2b_key(h(i-1) || tokens of block i)``.

    ``seed`` None draws a random key (hashes differ across processes); a string gives the same
    hashes in every process that uses it. The root ``h(-1)`` is derived from the cache salts.
    """

    DIGEST_SIZE = 16            # 128 bits: collisions are not a practical concern

    def __init__(self, seed: str | None = None) -> None:
        if seed is None:
            self.key = os.urandom(32)
        else:
            self.key = hashlib.blake2b(seed.encode(), digest_size=32,
                                       person=b"corellm-seed").digest()
        self._keyed = hashlib.blake2b(digest_size=self.DIGEST_SIZE, key=self.key)

    def _hash(self, data: bytes) -> BlockHash:
        # A copy of the keyed state: the key's block is compressed once, not per hash.
        h = self._keyed.copy()
        h.update(data)
        return h.digest()

    def root(self, *salts: str | None) -> BlockHash:
        """The chain's starting point; different salts give disjoint chains."""
        data = bytearray(b"corellm-root")
        for salt in salts:
            raw = b"" if salt is None else salt.encode("utf-8", "surrogatepass")
            # Length-prefixed, with None distinct from "": no two salt tuples encode alike.
            data += (b"\x00" if salt is None else b"\x01") + len(raw).to_bytes(8, "little") + raw
        return self._hash(bytes(data))

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        return self._hash(parent + array("q", token_ids).tobytes())

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
               num_blocks: int) -> list[BlockHash]:
        """Extend ``hashes`` (``[root, h(0), h(1), ...]``) to cover ``num_blocks`` full blocks."""
        first = len(hashes) - 1
        if first >= num_blocks:
            return hashes
        # The tokens as bytes once, sliced per block.
        data = array("q", token_ids[first * block_size:num_blocks * block_size]).tobytes()
        width = block_size * 8
        parent, keyed = hashes[-1], self._keyed
        for off in range(0, len(data), width):
            h = keyed.copy()
            h.update(parent)
            h.update(data[off:off + width])
            parent = h.digest()
            hashes.append(parent)
        return hashes


class EvictionPolicy(ABC):
    """Chooses which free, cached block a ``BlockPool`` evicts when it needs a fresh block.

    The policy owns the pool's *evictable* blocks: reference count 0, contents still identified
    by a hash. The pool reports every change to that set, and asks ``evict`` for a block each
    time it needs a fresh one and no uncached block is free:

    * ``on_free(block)``: the last holder of a cached block freed it; it is evictable now.
    * ``on_revive(block)``: a prefix hit took an evictable block back; it leaves the set.
    * ``on_hit(block)``: a prefix hit took a reference on a cached block, held or free (for a free
      one, ``on_revive`` follows). The default ignores it; a policy that ranks blocks by use
      counts here.
    * ``evict()``: remove one block from the set and return it. The pool then forgets its hash
      and hands it out.
    * ``clear()``: the prefix cache was reset, which happens only when no block is held; every
      cached block is in the set, and the set becomes empty.

    The pool calls these with consistent arguments only: ``on_free`` with a block not in the set,
    ``on_revive`` with one in it, ``evict`` when the set is not empty. A block's cached contents
    end when ``evict`` returns it or ``clear`` runs, so whatever the policy kept about the block,
    such as a hit count, is to be dropped there: the block's next hash names other contents.

    ``__iter__`` (the evictable blocks, in any order), ``__len__`` and ``__contains__`` are read
    by ``BlockPool.check_invariants`` and ``reset_cache``; the defaults of the last two iterate.
    The other methods run while the scheduler plans a step: keep them O(1) or O(log n). Each pool
    needs a policy object of its own, empty when the pool is built.
    """

    @abstractmethod
    def on_free(self, block: int) -> None:
        """``block`` holds a hash and has no holder left: it becomes evictable."""

    @abstractmethod
    def on_revive(self, block: int) -> None:
        """A prefix hit took the evictable ``block``: it is no longer evictable."""

    def on_hit(self, block: int) -> None:
        """A prefix hit took a reference on the cached ``block``, held or free."""

    @abstractmethod
    def evict(self) -> int:
        """Remove a block from the (non-empty) set and return it."""

    @abstractmethod
    def clear(self) -> None:
        """Empty the set: every hash was forgotten."""

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """The evictable blocks, each once."""

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, block: object) -> bool:
        return any(b == block for b in self)

    def inline_order(self) -> OrderedDict[int, None] | None:
        """A capability the pool may use: the evictable blocks as an insertion-ordered dict, first
        evicted first, that the pool updates itself (a freed block appended, a revived one
        deleted, the first one evicted) instead of calling ``on_free``, ``on_revive`` and
        ``evict`` for each block in every step. None (the default): the pool calls them."""
        return None


class LRUEviction(EvictionPolicy):
    """Evicts the least recently freed block. When a request finishes its blocks are freed tail
    first (``PagedKVCacheManager.free``), so the ends of prompts go before the prefixes that
    other prompts are likelier to share."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, None] = OrderedDict()     # least recently freed first

    def on_free(self, block: int) -> None:
        self._blocks[block] = None

    def on_revive(self, block: int) -> None:
        del self._blocks[block]

    def evict(self) -> int:
        return self._blocks.popitem(last=False)[0]

    def clear(self) -> None:
        self._blocks.clear()

    def __iter__(self) -> Iterator[int]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def inline_order(self) -> OrderedDict[int, None] | None:
        # Its methods are the dict's own operations; a subclass that changes one of them is
        # called through them.
        cls = type(self)
        if (cls.on_free, cls.on_revive, cls.evict) != (LRUEviction.on_free, LRUEviction.on_revive,
                                                       LRUEviction.evict):
            return None
        return self._blocks


class BlockPool:
    """The blocks ``0 .. num_blocks - 1`` of one KV cache and their states (see the module
    docstring). A KV-cache manager owns one pool: ``allocate`` and ``free`` for its block
    tables, ``lookup``, ``touch`` and ``cache_block`` for prefix caching.

    ``eviction`` chooses among the free, cached blocks when a fresh block is needed; None gives
    ``LRUEviction``. The pool keeps reference counts, hashes and the uncached free blocks
    itself, so a policy only orders the blocks it is given.
    """

    def __init__(self, num_blocks: int, eviction: EvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        if eviction is None:
            eviction = LRUEviction()
        elif isinstance(eviction, type):
            raise TypeError(f"BlockPool(eviction=...) takes an EvictionPolicy instance, got the "
                            f"class {eviction.__name__}: pass {eviction.__name__}()")
        elif not isinstance(eviction, EvictionPolicy):
            raise TypeError(f"BlockPool(eviction=...) takes an EvictionPolicy, got "
                            f"{type(eviction).__name__}")
        elif len(eviction):
            raise ValueError(f"the {type(eviction).__name__} given to BlockPool already holds "
                             f"blocks: each pool needs a policy object of its own")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.eviction = eviction
        # Free, uncached: a stack, the next block to hand out last (block 0 first, at the start).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_evictable = 0                                      # free, cached
        self._cached: dict[BlockHash, int] = {}                      # hash -> block
        self.num_evictions = 0
        # allocate, free and touch loop over blocks in every scheduler step, and a method call
        # per block would cost as much as the rest of the loop: a policy that offers its order
        # (inline_order, as LRUEviction does) is updated inline, another's methods are bound once.
        self._lru = eviction.inline_order()
        self._on_free = eviction.on_free
        self._on_revive = eviction.on_revive
        self._on_hit = (None if type(eviction).on_hit is EvictionPolicy.on_hit
                        else eviction.on_hit)

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: uncached free ones plus evictable cached ones."""
        return len(self._free) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with reference count 1: uncached free blocks first (the most
        recently freed first), then blocks the eviction policy gives up, whose hashes are
        forgotten (evicted)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        free, lru, ref_cnt, block_hash = self._free, self._lru, self.ref_cnt, self.block_hash
        blocks = []
        evicted = 0
        try:
            for _ in range(n):
                if free:
                    b = free.pop()
                else:
                    b = lru.popitem(last=False)[0] if lru is not None else self._evict_checked()
                    del self._cached[block_hash[b]]
                    block_hash[b] = None
                    evicted += 1
                ref_cnt[b] = 1
                blocks.append(b)
        finally:
            self._num_evictable -= evicted
            self.num_evictions += evicted
        return blocks

    def _evict_checked(self) -> int:
        b = self.eviction.evict()
        if self.block_hash[b] is None or self.ref_cnt[b]:
            raise RuntimeError(f"{type(self.eviction).__name__}.evict() returned block {b}, "
                               f"which is not free and cached")
        return b

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order: the eviction policy learns of the
        cached blocks that become free in this order (with LRU, the first freed are the first
        evicted)."""
        lru, ref_cnt, block_hash = self._lru, self.ref_cnt, self.block_hash
        evictable = 0
        try:
            for b in block_ids:
                ref = ref_cnt[b]
                if ref <= 0:
                    raise RuntimeError(f"block {b} freed more often than it was held")
                ref_cnt[b] = ref - 1
                if ref == 1:
                    if block_hash[b] is None:
                        self._free.append(b)
                        continue
                    if lru is not None:
                        lru[b] = None
                    else:
                        self._on_free(b)
                    evictable += 1
        finally:
            self._num_evictable += evictable

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, held or free, or None."""
        return self._cached.get(block_hash)

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        """Every (hash, block) pair in the prefix cache."""
        return list(self._cached.items())

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``lookup`` (a prefix hit), reviving free
        ones: the eviction policy sees ``on_hit`` for each, then ``on_revive`` for a free one."""
        lru, on_hit, ref_cnt, block_hash = self._lru, self._on_hit, self.ref_cnt, self.block_hash
        revived = 0
        try:
            for b in block_ids:
                if block_hash[b] is None:
                    raise RuntimeError(f"block {b} is not cached and cannot be shared")
                if on_hit is not None:
                    on_hit(b)
                if ref_cnt[b] == 0:
                    if lru is not None:
                        del lru[b]
                    else:
                        self._on_revive(b)
                    revived += 1
                ref_cnt[b] += 1
        finally:
            self._num_evictable -= revived

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a held, full, already written block under its hash. Returns False (and
        leaves the block uncached) when another block already holds these contents: two
        requests computed the same prefix at once, and only one copy is kept findable."""
        if self.ref_cnt[block_id] <= 0:
            raise RuntimeError(f"block {block_id} is free and cannot be cached")
        if self.block_hash[block_id] is not None:
            if self.block_hash[block_id] != block_hash:
                raise RuntimeError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        return True

    def reset_cache(self) -> bool:
        """Forget every hash. Only possible while no block is held; returns whether it was.
        The cached blocks join the uncached free ones, on top (their memory is resident): the
        last in the policy's iteration order is handed out first."""
        if any(self.ref_cnt):
            return False
        # No block is held, so every cached block is evictable: the policy holds them all.
        blocks = list(self.eviction)
        if len(blocks) != len(self._cached):
            raise RuntimeError(f"{type(self.eviction).__name__} lists {len(blocks)} evictable "
                               f"blocks; the pool has {len(self._cached)} free cached blocks")
        for b in blocks:
            self.block_hash[b] = None
            self._free.append(b)
        self.eviction.clear()
        self._num_evictable = 0
        self._cached.clear()
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Every block is in exactly one state; the uncached free list, the eviction policy's
        set and the hash map agree with the reference counts and hashes."""
        policy, name = self.eviction, type(self.eviction).__name__
        uncached, cached = list(self._free), list(policy)
        assert len(set(uncached)) == len(uncached), "a block is in the free list twice"
        assert len(set(cached)) == len(cached), f"{name} lists a block twice"
        assert len(cached) == len(policy) == self._num_evictable, \
            f"{name} lists {len(cached)} blocks, has len {len(policy)}; the pool counts " \
            f"{self._num_evictable} evictable blocks"
        both = set(uncached) & set(cached)
        assert not both, f"blocks {sorted(both)} are both uncached free and in {name}"
        free, evictable = set(uncached) | set(cached), set(cached)
        for b in range(self.num_blocks):
            ref, h = self.ref_cnt[b], self.block_hash[b]
            assert ref >= 0, f"block {b}: reference count {ref}"
            assert (b in free) == (ref == 0), f"block {b}: ref {ref}, free {b in free}"
            assert (b in policy) == (b in evictable), \
                f"{name}: `in` says {b in policy} for block {b}, its iteration the opposite"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}: its hash maps to {self._cached.get(h)}"
        for b in uncached:
            assert self.block_hash[b] is None, f"uncached free block {b} has a hash"
        for b in cached:
            assert self.block_hash[b] is not None, f"block {b} in {name} has no hash"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"hash {h.hex()} maps to block {b}, which has another"

def num_blocks_for_budget(num_blocks: int | None, memory_gib: float | None,
                          bytes_per_block: int, default_bytes: int | None = None) -> int:
    """The KV pool's size: ``kv_cache.num_blocks`` when given, else as many blocks of
    ``bytes_per_block`` (all layers of one worker) as ``kv_cache.memory_gib`` holds, else as
    ``default_bytes`` holds (the platform's budget; 1 GiB when None). Every executor sizes its
    pool with this, a simulated one included, so both get the same pool."""
    if num_blocks is not None:
        return num_blocks
    budget = (int(memory_gib * (1 << 30)) if memory_gib is not None
              else default_bytes if default_bytes is not None else 1 << 30)
    num = budget // bytes_per_block
    if num < 1:
        from corellm.errors import ConfigError
        what = (f"{memory_gib} GiB" if memory_gib is not None
                else f"the platform's budget of {budget / 2**30:.3g} GiB")
        raise ConfigError([("kv_cache.memory_gib", f"{what} holds no KV block of "
                                                   f"{bytes_per_block} bytes")])
    return num
