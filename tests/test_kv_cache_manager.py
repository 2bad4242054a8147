"""The paged KV-cache manager and the core BlockPool/BlockHasher under prefix caching.

The property-based test drives the manager the way the scheduler and the workers do (admit with
a cache lookup, compute chunks, sample, preempt, finish, reset) with random operation sequences,
and simulates the KV cache itself: every "computed" token is written into a shadow copy of its
block slot. After every operation it checks the invariants; at every cache hit it checks that
the blocks handed out hold exactly the request's tokens.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule)

from corellm.kv.block_pool import BlockHasher, BlockPool, EvictionPolicy
from corellm.interfaces import CachedPrefix
from corellm.kv.paged import PagedKVCacheManager
from corellm.request import EngineCoreRequest, Request
from corellm.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=1000, ignore_eos=True, cache_salt=salt)
    return Request(EngineCoreRequest(rid, tokens, params, None, time.time()), max_model_len=4096)


def admit(kv: PagedKVCacheManager, r: Request, n: int) -> None:
    """Admit ``r`` as the scheduler does (lookup, then allocate ``n`` tokens after the hit)."""
    prefix = kv.find_cached_prefix(r)
    assert kv.allocate_slots(r, n, prefix) is not None
    r.num_computed_tokens = prefix.num_tokens


def run_step(kv: PagedKVCacheManager, r: Request, n: int) -> None:
    """The step computed ``n`` tokens of ``r``: advance it and register completed blocks."""
    r.num_computed_tokens += n
    kv.cache_computed_blocks(r)


# --------------------------------------------------------------------------- BlockHasher
def test_hash_chain_identifies_the_whole_prefix():
    h = BlockHasher("seed")
    root = h.root(None, None)
    a = h.hash_block(h.hash_block(root, [1, 2]), [3, 4])
    b = h.hash_block(h.hash_block(root, [9, 9]), [3, 4])
    assert a != b                                   # same block, different parent
    assert h.extend([root], [1, 2, 3, 4, 5], 2, 2) == [root, h.hash_block(root, [1, 2]), a]


def test_hash_keys_are_random_unless_seeded():
    assert BlockHasher("s").root(None) == BlockHasher("s").root(None)
    assert BlockHasher("s").root(None) != BlockHasher("t").root(None)
    assert BlockHasher().root(None) != BlockHasher().root(None)


def test_salts_give_disjoint_chains():
    h = BlockHasher("s")
    roots = {h.root(*salts) for salts in [(None, None), ("", None), (None, ""), ("a", None),
                                           (None, "a"), ("a", "b"), ("ab", None), ("a", "")]}
    assert len(roots) == 8


# --------------------------------------------------------------------------- BlockPool
def test_pool_hands_out_uncached_blocks_before_evicting_lru():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for blk, key in ((a, b"A"), (b, b"B")):
        assert pool.cache_block(blk, key)
    pool.free([b, a, c])                      # b freed first: least recently used
    pool.check_invariants()
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    assert pool.allocate(1) == [c]            # the uncached free block goes first
    assert pool.allocate(1) == [b] and pool.lookup(b"B") is None and pool.num_evictions == 1
    assert pool.lookup(b"A") == a
    pool.touch([a])                           # revived from the free list
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_pool_reuses_the_blocks_just_freed():
    """The CPU pool is mapped on first touch: blocks handed out are memory made resident. Short
    requests coming and going must keep reusing the same few blocks, not walk the whole pool
    (a queue of free blocks made a server's 1 GiB pool resident within minutes)."""
    pool = BlockPool(1000)
    manager = PagedKVCacheManager(1000, 4, enable_prefix_caching=False)
    touched: set[int] = set()
    live: list[Request] = []
    for i in range(2000):               # at most 3 requests of up to 3 blocks held at once
        r = make_request(f"r{i}", list(range(1 + i % 12)))
        touched.update(manager.allocate_slots(r, r.num_tokens))
        live.append(r)
        if len(live) == 3:
            manager.free(live.pop(i % 3))
        blocks = pool.allocate(1 + i % 3)
        touched.update(b + 1000 for b in blocks)
        pool.free(blocks)
    assert len([b for b in touched if b < 1000]) <= 9
    assert len([b for b in touched if b >= 1000]) == 3
    manager.pool.check_invariants()
    assert BlockPool(4).allocate(2) == [0, 1]      # a fresh pool's: the lowest blocks first


def test_pool_keeps_one_copy_per_hash_and_resets_only_when_idle():
    pool = BlockPool(3)
    x, y, _ = pool.allocate(3)
    assert pool.cache_block(x, b"H")
    assert not pool.cache_block(y, b"H")      # a duplicate stays uncached
    assert pool.block_hash[y] is None
    with pytest.raises(RuntimeError, match="not cached"):
        pool.touch([y])
    assert not pool.reset_cache()             # blocks held: refused, nothing changes
    assert pool.lookup(b"H") == x
    pool.free([x, y, 2])
    assert pool.reset_cache() and pool.lookup(b"H") is None and pool.num_cached_blocks == 0
    pool.check_invariants()
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([x])


# --------------------------------------------------------------------------- the manager
def test_lookup_leaves_the_last_token_and_partial_blocks_uncached():
    kv = PagedKVCacheManager(16, 4, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))         # exactly two blocks
    admit(kv, first, 8)
    run_step(kv, first, 8)
    kv.free(first)
    same = make_request("b", list(range(8)))
    hit = kv.find_cached_prefix(same)
    assert hit.num_tokens == 4 and len(hit.block_ids) == 1   # not both: one token is computed
    longer = make_request("c", list(range(10)))
    assert kv.find_cached_prefix(longer).num_tokens == 8
    salted = make_request("d", list(range(10)), salt="tenant")
    assert kv.find_cached_prefix(salted).num_tokens == 0
    kv.check_invariants()


def test_disabled_prefix_caching_never_hits():
    kv = PagedKVCacheManager(16, 4, enable_prefix_caching=False)
    r = make_request("a", list(range(8)))
    admit(kv, r, 8)
    run_step(kv, r, 8)
    kv.free(r)
    assert kv.find_cached_prefix(make_request("b", list(range(9)))).num_tokens == 0
    assert kv.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_a_block_being_computed_is_announced_as_pending():
    kv = PagedKVCacheManager(16, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    admit(kv, a, 6)                              # a chunk of 6
    b = make_request("b", list(range(12)))
    assert kv.find_cached_prefix(b) == CachedPrefix((), 0, pending=True)
    run_step(kv, a, 6)                           # the step ran: block 0 is cached now
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 4 and not hit.pending
    kv.free(a)
    assert not kv.find_cached_prefix(b).pending
    kv.check_invariants()


def test_a_block_stays_pending_while_any_request_computes_it():
    """Found by the property test: two requests compute the same block in one step (the second
    did not wait); freeing the first must not hide that the second still computes it."""
    kv = PagedKVCacheManager(16, 4, enable_prefix_caching=True)
    a, b, c = (make_request(rid, list(range(8))) for rid in "abc")
    admit(kv, a, 6)
    assert kv.find_cached_prefix(b).pending
    admit(kv, b, 6)                              # did not wait
    kv.free(a)                                   # e.g. preempted
    assert kv.find_cached_prefix(c).pending
    run_step(kv, b, 6)
    assert not kv.find_cached_prefix(c).pending and kv.find_cached_prefix(c).num_tokens == 4
    kv.free(b)
    kv.check_invariants()


def test_allocation_counts_revived_blocks_against_the_free_pool():
    kv = PagedKVCacheManager(3, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    admit(kv, a, 9)
    run_step(kv, a, 9)
    kv.free(a)                                   # 3 free blocks, 2 of them cached
    b = make_request("b", list(range(8)) + list(range(100, 108)))   # 16 tokens: 4 blocks
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    # Reviving the 2 hit blocks leaves 1 free block for the 2 new ones needed: refused whole.
    assert kv.allocate_slots(b, 8, hit) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids(b) == [] and kv.num_cached_blocks == 2
    new = kv.allocate_slots(b, 4, hit)             # 12 tokens: the 2 hit blocks + 1 new
    assert new is not None and len(new) == 1
    assert kv.get_block_ids(b) == [*hit.block_ids, *new] and kv.num_free_blocks == 0
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 9 + 16
    kv.free(b)
    kv.check_invariants()


# --------------------------------------------------------------------------- property test
BLOCK_SIZE = 4
NUM_BLOCKS = 8
# A few base prefixes over a 3-token vocabulary: random prompts share prefixes all the time.
BASES = [[1, 1, 1, 1, 2, 2, 2, 2, 1, 2, 1, 2], [1, 1, 1, 1, 2, 2, 0, 0], [0] * 12, [2, 1, 0, 2]]
prompts = st.builds(lambda base, k, tail: (BASES[base][:k] + tail) or [0],
                    st.integers(0, len(BASES) - 1), st.integers(0, 12),
                    st.lists(st.integers(0, 2), max_size=6))


class KVManagerMachine(RuleBasedStateMachine):
    """Random operation sequences against a simulated KV cache.

    A step is spread over several operations, as in the engine: ``admit`` and ``schedule``
    allocate slots for requests (so blocks are *pending* while the step is open), ``execute``
    writes the K/V of every scheduled token, registers completed blocks and samples. Requests are
    preempted, finished or aborted at any point, and the cache is reset between steps.

    The shadow KV records, for every slot written, the request's salt and the *whole* token
    prefix up to that slot: what the K/V there really depends on. A cache hit must hand out blocks
    whose every slot matches the new request's salt and prefix.
    """

    seen: Counter = Counter()     # what the runs reached (see test_the_property_test_is_not_vacuous)
    # The class of the pool's eviction policy; None: the default, LRU. Subclasses run the same
    # operations over other policies (tests/test_kv_eviction.py).
    eviction_class: type[EvictionPolicy] | None = None

    @initialize(seeded=st.booleans())
    def setup(self, seeded):
        eviction = self.eviction_class() if self.eviction_class is not None else None
        self.kv = PagedKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True,
                                      cache_salt="engine", hash_seed="s" if seeded else None,
                                      eviction=eviction)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.scheduled: dict[str, int] = {}        # this step's plan: request -> new tokens
        self.ids = itertools.count()
        self.shadow: dict[int, list[tuple | None]] = {}
        # Every block hash the manager could produce so far -> (salt, prefix through the block).
        self.prefix_of_hash: dict[bytes, tuple] = {}

    # ------------------------------------------------------------------ helpers
    def _pick(self, data, pool) -> Request:
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    @staticmethod
    def _key(r: Request, end: int) -> tuple:
        """What the K/V of token ``end - 1`` depends on."""
        return (r.sampling_params.cache_salt, tuple(r.all_token_ids[:end]))

    def _record_hashes(self, r: Request) -> None:
        hasher = self.kv.hasher
        hashes = hasher.extend([hasher.root(self.kv.cache_salt, r.sampling_params.cache_salt)],
                               r.all_token_ids, BLOCK_SIZE, len(r.all_token_ids) // BLOCK_SIZE)
        for i, h in enumerate(hashes[1:]):
            key = self._key(r, (i + 1) * BLOCK_SIZE)
            assert self.prefix_of_hash.setdefault(h, key) == key, \
                f"one hash for two prefixes: {self.prefix_of_hash[h]} and {key}"

    @staticmethod
    def _chunk(data, remaining: int) -> int:
        """Tokens to compute: often all that remain (whole prefills), else a random chunk."""
        return data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)))

    def _completes(self, s: Request, n: int, block: int) -> bool:
        return s.num_computed_tokens < (block + 1) * BLOCK_SIZE <= s.num_computed_tokens + n

    # ------------------------------------------------------------------ operations
    @rule(tokens=prompts, salt=st.sampled_from([None, None, "tenant-a"]))
    def add(self, tokens, salt):
        rid = f"r{next(self.ids)}"
        self.waiting[rid] = make_request(rid, tokens, salt)
        self._record_hashes(self.waiting[rid])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        r = self._pick(data, self.waiting)
        prefix = self.kv.find_cached_prefix(r)
        k = len(prefix.block_ids)
        assert prefix.num_tokens == k * BLOCK_SIZE < r.num_tokens
        for i, b in enumerate(prefix.block_ids):      # a hit holds exactly this salt and prefix
            expected = [self._key(r, i * BLOCK_SIZE + j + 1) for j in range(BLOCK_SIZE)]
            assert self.shadow[b] == expected, f"cache hit on block {b} holding other K/V"
        # `pending` exactly when a request in this step completes the next block, same prefix.
        nxt = (k + 1) * BLOCK_SIZE
        computing = nxt < r.num_tokens and any(
            self._completes(s, n, k) and self._key(s, nxt) == self._key(r, nxt)
            for s, n in ((self.running[rid], n) for rid, n in self.scheduled.items()))
        assert prefix.pending == computing, (prefix, computing)
        if prefix.pending and data.draw(st.booleans()):
            return                                    # wait for the block, as the scheduler does
        n = self._chunk(data, r.num_tokens - prefix.num_tokens)
        free_before = self.kv.num_free_blocks
        counters = (self.kv.prefix_cache_queries, self.kv.prefix_cache_hits)
        if self.kv.allocate_slots(r, n, prefix) is None:
            assert self.kv.num_free_blocks == free_before and not self.kv.get_block_ids(r)
            assert (self.kv.prefix_cache_queries, self.kv.prefix_cache_hits) == counters
            return
        seen = KVManagerMachine.seen
        seen["hit"] += k > 0
        seen["pending"] += prefix.pending
        seen["revived"] += any(self.kv.pool.ref_cnt[b] == 1 for b in prefix.block_ids)
        seen["shared"] += any(self.kv.pool.ref_cnt[b] > 1 for b in prefix.block_ids)
        r.num_computed_tokens = prefix.num_tokens
        self.running[r.request_id] = self.waiting.pop(r.request_id)
        self.scheduled[r.request_id] = n

    @precondition(lambda self: set(self.running) - set(self.scheduled))
    @rule(data=st.data())
    def schedule(self, data):
        r = self.running[data.draw(st.sampled_from(sorted(set(self.running) - set(self.scheduled))))]
        n = self._chunk(data, r.num_tokens - r.num_computed_tokens)
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(r, n) is None:      # the scheduler would preempt someone
            assert self.kv.num_free_blocks == free_before
            return
        self.scheduled[r.request_id] = n

    @precondition(lambda self: self.scheduled)
    @rule(data=st.data())
    def execute(self, data):
        """The forward pass of the open step, then sampling and the cache update."""
        for rid, n in self.scheduled.items():
            r = self.running[rid]
            table = self.kv.get_block_ids(r)
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                b = table[pos // BLOCK_SIZE]
                assert self.kv.pool.ref_cnt[b] == 1, f"block {b} written while shared"
                assert self.kv.pool.block_hash[b] is None, f"cached block {b} written"
                slots = self.shadow.setdefault(b, [None] * BLOCK_SIZE)
                slots[pos % BLOCK_SIZE] = self._key(r, pos + 1)
                if pos % BLOCK_SIZE == 0:              # a reused block: its old K/V is gone
                    slots[1:] = [None] * (BLOCK_SIZE - 1)
        for rid, n in self.scheduled.items():
            r = self.running[rid]
            r.num_computed_tokens += n
            self.kv.cache_computed_blocks(r)
            if r.num_computed_tokens == r.num_tokens:       # logits: a token is sampled
                r.all_token_ids.append(data.draw(st.integers(0, 2)))
                self._record_hashes(r)
        self.scheduled.clear()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        r = self._pick(data, self.running)
        self.kv.free(r)
        self.scheduled.pop(r.request_id, None)
        r.num_computed_tokens = 0
        self.waiting[r.request_id] = self.running.pop(r.request_id)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data):
        pool = self.running if self.running and data.draw(st.booleans()) else (
            self.waiting or self.running)
        r = self._pick(data, pool)
        self.kv.free(r)
        self.kv.free(r)                               # idempotent
        self.scheduled.pop(r.request_id, None)
        del pool[r.request_id]

    @precondition(lambda self: not self.scheduled)
    @rule()
    def reset(self):
        held = any(self.kv.pool.ref_cnt)
        assert self.kv.reset_prefix_cache() == (not held)
        if not held:
            assert self.kv.num_cached_blocks == 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self):
        kv = self.kv
        kv.check_invariants()         # free xor held, one free list each, refs == holders
        for h, b in kv.pool.cached_items():
            salt, prefix = self.prefix_of_hash[h]
            end = len(prefix)
            assert self.shadow[b] == [(salt, prefix[:end - BLOCK_SIZE + j + 1])
                                      for j in range(BLOCK_SIZE)], \
                f"hash of {prefix} points to block {b} holding {self.shadow[b]}"
        held = {b for r in self.running.values() for b in kv.get_block_ids(r)}
        assert len(held) + kv.num_free_blocks == NUM_BLOCKS
        assert not any(kv.get_block_ids(r) for r in self.waiting.values())
        pending_owners = set().union(*kv._pending.values()) if kv._pending else set()
        assert pending_owners <= set(self.scheduled), "a pending block outlived its step"
        KVManagerMachine.seen["evicted"] = max(KVManagerMachine.seen["evicted"],
                                               kv.pool.num_evictions)

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in [*self.running.values(), *self.waiting.values()]:
            self.kv.free(r)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS, "a block never returned to the pool"
        assert all(c == 0 for c in self.kv.pool.ref_cnt)
        assert not self.kv._pending


TestKVManagerProperties = KVManagerMachine.TestCase
TestKVManagerProperties.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_the_property_test_is_not_vacuous():
    """The operation mix does reach the interesting states: hits, shared blocks, pending blocks,
    evictions and blocks revived from the LRU list (derandomized: the same examples each run)."""
    from hypothesis.stateful import run_state_machine_as_test

    KVManagerMachine.seen.clear()
    run_state_machine_as_test(KVManagerMachine, settings=settings(
        max_examples=60, stateful_step_count=60, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    seen = KVManagerMachine.seen
    for what in ("hit", "shared", "pending", "evicted", "revived"):
        assert seen[what] > 0, seen
