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

from corellm.block_pool import BlockHasher, BlockPool
from corellm.interfaces import CachedPrefix
from corellm.request import EngineCoreRequest, Request
from corellm.sampling_params import SamplingParams
from corellm_plugins.kv_paged import PagedKVCacheManager


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=1000, ignore_eos=True, cache_salt=salt)
    return Request(EngineCoreRequest(rid, tokens, params, None, time.time()), max_model_len=4096)


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
    assert kv.allocate_slots(first, 8, kv.find_cached_prefix(first)) is not None
    first.num_computed_tokens = 8
    kv.cache_computed_blocks(first)
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
    assert kv.allocate_slots(r, 8, kv.find_cached_prefix(r)) is not None
    r.num_computed_tokens = 8
    kv.cache_computed_blocks(r)
    kv.free(r)
    assert kv.find_cached_prefix(make_request("b", list(range(9)))).num_tokens == 0
    assert kv.num_cached_blocks == 0 and kv.prefix_cache_queries == 0


def test_a_block_being_computed_is_announced_as_pending():
    kv = PagedKVCacheManager(16, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 6, kv.find_cached_prefix(a)) is not None   # a chunk of 6
    b = make_request("b", list(range(12)))
    assert kv.find_cached_prefix(b) == CachedPrefix((), 0, pending=True)
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)                  # the step ran: block 0 is cached now
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 4 and not hit.pending
    kv.free(a)
    assert not kv.find_cached_prefix(b).pending
    kv.check_invariants()


def test_allocation_counts_revived_blocks_against_the_free_pool():
    kv = PagedKVCacheManager(3, 4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9, kv.find_cached_prefix(a)) is not None
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
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
NUM_BLOCKS = 12
# A few base prefixes over a 3-token vocabulary: random prompts share prefixes all the time.
BASES = [[1, 1, 1, 1, 2, 2, 2, 2, 1, 2, 1, 2], [1, 1, 1, 1, 2, 2, 0, 0], [0] * 12, [2, 1, 0, 2]]
prompts = st.builds(lambda base, k, tail: (BASES[base][:k] + tail) or [0],
                    st.integers(0, len(BASES) - 1), st.integers(0, 12),
                    st.lists(st.integers(0, 2), max_size=6))


class KVManagerMachine(RuleBasedStateMachine):
    """Random admit / compute / sample / preempt / finish / reset sequences against a shadow KV."""

    seen: Counter = Counter()     # what the runs reached (see test_the_property_test_is_not_vacuous)

    @initialize(seeded=st.booleans())
    def setup(self, seeded):
        self.kv = PagedKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True,
                                      cache_salt="engine", hash_seed="s" if seeded else None)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.ids = itertools.count()
        # The simulated KV cache: for each block, the token whose K/V each slot holds.
        self.shadow: dict[int, list[int | None]] = {}
        # Every hash the manager could produce for the tokens seen so far -> that block's tokens.
        self.block_of_hash: dict[bytes, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ helpers
    def _pick(self, data, pool: dict[str, Request]) -> Request:
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    def _record_hashes(self, r: Request) -> None:
        hasher = self.kv.hasher
        hashes = hasher.extend([hasher.root(self.kv.cache_salt, r.sampling_params.cache_salt)],
                               r.all_token_ids, BLOCK_SIZE, len(r.all_token_ids) // BLOCK_SIZE)
        for i, h in enumerate(hashes[1:]):
            self.block_of_hash[h] = tuple(r.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])

    def _compute(self, r: Request, n: int, data) -> None:
        """What a step does: write the K/V of tokens [computed, computed + n), then sample."""
        table = self.kv.get_block_ids(r)
        for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
            b = table[pos // BLOCK_SIZE]
            assert self.kv.pool.ref_cnt[b] == 1, f"block {b} written while shared"
            assert self.kv.pool.block_hash[b] is None, f"cached block {b} written"
            self.shadow.setdefault(b, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = r.all_token_ids[pos]
        r.num_computed_tokens += n
        self.kv.cache_computed_blocks(r)
        if r.num_computed_tokens == r.num_tokens:           # logits: a token is sampled
            r.all_token_ids.append(data.draw(st.integers(0, 2)))
        self._record_hashes(r)

    # ------------------------------------------------------------------ operations
    @rule(tokens=prompts, salt=st.sampled_from([None, None, "tenant-a"]))
    def add(self, tokens, salt):
        rid = f"r{next(self.ids)}"
        self.waiting[rid] = make_request(rid, tokens, salt)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        r = self._pick(data, self.waiting)
        prefix = self.kv.find_cached_prefix(r)
        assert prefix.num_tokens % BLOCK_SIZE == 0 and prefix.num_tokens < r.num_tokens
        assert prefix.num_tokens == len(prefix.block_ids) * BLOCK_SIZE
        for i, b in enumerate(prefix.block_ids):      # a hit holds exactly this prefix
            assert self.shadow[b] == r.all_token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], \
                f"cache hit on block {b} whose contents differ"
        n = data.draw(st.integers(1, r.num_tokens - prefix.num_tokens))
        free_before, queries = self.kv.num_free_blocks, self.kv.prefix_cache_queries
        if self.kv.allocate_slots(r, n, prefix) is None:
            assert self.kv.num_free_blocks == free_before and not self.kv.get_block_ids(r)
            assert self.kv.prefix_cache_queries == queries
            return
        seen = KVManagerMachine.seen
        seen["hit"] += prefix.num_tokens > 0
        seen["revived"] += any(self.kv.pool.ref_cnt[b] == 1 for b in prefix.block_ids)
        seen["shared"] += any(self.kv.pool.ref_cnt[b] > 1 for b in prefix.block_ids)
        seen["evicted"] = max(seen["evicted"], self.kv.pool.num_evictions)
        r.num_computed_tokens = prefix.num_tokens
        self.running[r.request_id] = self.waiting.pop(r.request_id)
        self._compute(r, n, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        r = self._pick(data, self.running)
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        free_before = self.kv.num_free_blocks
        if self.kv.allocate_slots(r, n) is None:      # the scheduler would preempt someone
            assert self.kv.num_free_blocks == free_before
            return
        self._compute(r, n, data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        r = self._pick(data, self.running)
        self.kv.free(r)
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
        del pool[r.request_id]

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
            assert tuple(self.shadow[b]) == self.block_of_hash[h], \
                f"hash of {self.block_of_hash[h]} points to block {b} holding {self.shadow[b]}"
        held = {b for r in self.running.values() for b in kv.get_block_ids(r)}
        assert len(held) + kv.num_free_blocks == NUM_BLOCKS
        assert not any(kv.get_block_ids(r) for r in self.waiting.values())

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for r in [*self.running.values(), *self.waiting.values()]:
            self.kv.free(r)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS, "a block never returned to the pool"
        assert all(c == 0 for c in self.kv.pool.ref_cnt)


TestKVManagerProperties = KVManagerMachine.TestCase
TestKVManagerProperties.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_the_property_test_is_not_vacuous():
    """The operation mix does reach the interesting states: hits, shared blocks, evictions and
    blocks revived from the LRU list."""
    from hypothesis.stateful import run_state_machine_as_test

    KVManagerMachine.seen.clear()
    run_state_machine_as_test(KVManagerMachine, settings=settings(
        max_examples=40, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
    seen = KVManagerMachine.seen
    assert seen["hit"] > 0 and seen["shared"] > 0 and seen["evicted"] > 0 and seen["revived"] > 0, seen
