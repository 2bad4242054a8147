"""KV-block bookkeeping shared by KV-cache manager plugins: reference counts, two free lists and
the prefix-cache map from block hashes to blocks.

A block is in exactly one of three states:

* **held**: reference count >= 1 (one per request whose block table contains it); in no free list;
* **free, cached**: reference count 0, but its contents are still identified by a hash, so a new
  request with the same prefix can take it back (``touch``). These sit in an LRU list, least
  recently freed first, and are evicted (their hash forgotten) only when a fresh block is needed
  and no uncached free block is left;
* **free, uncached**: reference count 0, no hash: free for anyone, and handed out first.

Only full blocks are ever hashed, and a block is hashed only after its KV entries were written
(the manager calls ``cache_block`` after the step that computed them), so a cached block is never
written again while it is shared. ``check_invariants`` verifies all of this; tests call it after
every step.

``BlockHasher`` computes the chained block hashes: keyed BLAKE2b (``hashlib``) over the parent
block's hash and the block's token ids, so a hash identifies the whole prefix up to and including
its block. The key is random per process unless configured, so cache keys cannot be predicted from
outside the process; a cache salt enters the root of the chain to isolate tenants.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

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

    def _hash(self, data: bytes) -> BlockHash:
        return hashlib.blake2b(data, digest_size=self.DIGEST_SIZE, key=self.key).digest()

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
        for i in range(len(hashes) - 1, num_blocks):
            hashes.append(self.hash_block(hashes[-1],
                                          token_ids[i * block_size:(i + 1) * block_size]))
        return hashes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))           # free, uncached
        self._free_cached: OrderedDict[int, None] = OrderedDict()    # free, cached; LRU first
        self._cached: dict[BlockHash, int] = {}                      # hash -> block
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: uncached free ones plus evictable cached ones."""
        return len(self._free) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with reference count 1: uncached free blocks first, then the
        least recently freed cached blocks, whose hashes are forgotten (evicted)."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)
                del self._cached[self.block_hash[b]]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order: of the blocks that become free, the
        first ones freed are the first evicted."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was held")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self._free.append(b)
                else:
                    self._free_cached[b] = None

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, held or free, or None."""
        return self._cached.get(block_hash)

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        """Every (hash, block) pair in the prefix cache."""
        return list(self._cached.items())

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by ``lookup`` (reviving free ones)."""
        for b in block_ids:
            if self.block_hash[b] is None:
                raise RuntimeError(f"block {b} is not cached and cannot be shared")
            if self.ref_cnt[b] == 0:
                del self._free_cached[b]
            self.ref_cnt[b] += 1

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
        """Forget every hash. Only possible while no block is held; returns whether it was."""
        if any(self.ref_cnt):
            return False
        for b in self._free_cached:
            self.block_hash[b] = None
            self._free.append(b)
        self._free_cached.clear()
        self._cached.clear()
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        uncached, cached = list(self._free), list(self._free_cached)
        assert len(set(uncached)) == len(uncached), "a block is in the free list twice"
        both = set(uncached) & set(cached)
        assert not both, f"blocks {sorted(both)} are in both free lists"
        free = set(uncached) | set(cached)
        for b in range(self.num_blocks):
            ref, h = self.ref_cnt[b], self.block_hash[b]
            assert ref >= 0, f"block {b}: reference count {ref}"
            assert (b in free) == (ref == 0), f"block {b}: ref {ref}, free {b in free}"
            if h is not None:
                assert self._cached.get(h) == b, f"block {b}: its hash maps to {self._cached.get(h)}"
        for b in uncached:
            assert self.block_hash[b] is None, f"uncached free block {b} has a hash"
        for b in cached:
            assert self.block_hash[b] is not None, f"cached free block {b} has no hash"
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
