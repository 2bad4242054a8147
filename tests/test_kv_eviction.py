"""The eviction-policy extension point of the KV block pool (``corellm.kv.block_pool``), the public
paged manager (``corellm.kv.paged``) built on it, its deprecated import path, and the example
package examples/corellm-lfu-kv, registered in-process.

The pool is checked against a policy that records every call, against LRU and LFU on the same
operations (they must evict different blocks), and with broken policies that its checks must
catch. The example runs the paged manager's property test and the engine: greedy outputs equal
to the built-in ``paged`` manager's, a shared prefix kept where LRU loses it, every block back.
"""

from __future__ import annotations

import importlib
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import tests.test_kv_cache_manager as paged_tests
from corellm import LLM, SamplingParams
from corellm.kv.block_pool import BlockPool, EvictionPolicy, LRUEviction
from corellm.errors import ConfigError
from corellm.kv.paged import PagedKVCacheManager, PagedKVCacheOptions
from tests.conftest import assert_pool_whole, engine_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-lfu-kv"
EXAMPLE_MODULE = "corellm_lfu_kv"
EXAMPLE_ENTRY_POINT = "kv_lfu"      # [project.entry-points.corellm] in its pyproject.toml


def _import_example():
    """The example's module from the source tree (not an installed copy), leaving sys.modules
    and sys.path as they were."""
    saved = sys.modules.pop(EXAMPLE_MODULE, None)
    sys.path.insert(0, str(EXAMPLE))
    try:
        module = importlib.import_module(EXAMPLE_MODULE)
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop(EXAMPLE_MODULE, None)
        if saved is not None:
            sys.modules[EXAMPLE_MODULE] = saved
    assert Path(module.__file__).resolve().is_relative_to(EXAMPLE)
    return module


lfu = _import_example()


class Recording(EvictionPolicy):
    """Most recently freed first (the opposite of LRU), logging every call the pool makes."""

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.calls: list[tuple] = []

    def on_free(self, block: int) -> None:
        self.calls.append(("free", block))
        self.blocks.append(block)

    def on_revive(self, block: int) -> None:
        self.calls.append(("revive", block))
        self.blocks.remove(block)

    def on_hit(self, block: int) -> None:
        self.calls.append(("hit", block))

    def evict(self) -> int:
        self.calls.append(("evict",))
        return self.blocks.pop()

    def clear(self) -> None:
        self.calls.append(("clear",))
        self.blocks.clear()

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.blocks))


def cached_pool(policy: EvictionPolicy | None, n: int,
                uncached: int = 0) -> tuple[BlockPool, list[int]]:
    """A pool of ``n + uncached`` blocks, all allocated; the first ``n`` cached under
    b"0", b"1", ..."""
    pool = BlockPool(n + uncached, policy)
    blocks = pool.allocate(n + uncached)
    for i, b in enumerate(blocks[:n]):
        assert pool.cache_block(b, str(i).encode())
    return pool, blocks


# --------------------------------------------------------------------------- the pool
def test_lru_is_the_default():
    assert type(BlockPool(2).eviction) is LRUEviction
    assert type(PagedKVCacheManager(2, 4).pool.eviction) is LRUEviction


def test_the_pool_follows_a_custom_policy_and_reports_every_change():
    policy = Recording()
    pool, (a, b, c, d) = cached_pool(policy, 3, uncached=1)
    pool.free([a, b, c, d])                     # d has no hash: the policy never sees it
    assert policy.calls == [("free", a), ("free", b), ("free", c)]
    assert pool.num_free_blocks == 4
    pool.check_invariants()
    assert pool.allocate(1) == [d]              # uncached first, without asking the policy
    assert policy.calls[-1] == ("free", c)
    assert pool.allocate(1) == [c]              # the policy's choice; LRU would take a
    assert policy.calls[-1] == ("evict",) and pool.lookup(b"2") is None
    assert pool.num_evictions == 1
    policy.calls.clear()
    pool.touch([b])                             # a prefix hit on a free block
    pool.touch([b])                             # and on a held one
    assert policy.calls == [("hit", b), ("revive", b), ("hit", b)]
    assert pool.num_free_blocks == 1
    pool.check_invariants()
    pool.free([b, b, c, d])
    policy.calls.clear()
    assert pool.reset_cache()
    assert policy.calls == [("clear",)] and policy.blocks == []
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 4
    pool.check_invariants()


@pytest.mark.parametrize("policy, first_evicted", [(LRUEviction, "often_hit"),
                                                   (lfu.LFUEviction, "never_hit")])
def test_lfu_evicts_the_least_hit_block_where_lru_evicts_the_least_recently_freed(
        policy, first_evicted):
    pool, (often_hit, never_hit, once_a, once_b) = cached_pool(policy(), 4)
    blocks = {"often_hit": often_hit, "never_hit": never_hit}
    pool.touch([often_hit, often_hit, once_a, once_b])
    pool.free([often_hit, often_hit, once_a, once_b])
    pool.free([often_hit, never_hit, once_a, once_b])    # often_hit freed first, never_hit next
    pool.check_invariants()
    assert pool.allocate(1) == [blocks[first_evicted]]
    if policy is lfu.LFUEviction:
        # Equal hits: the least recently freed (once_a before once_b), then the most used.
        assert pool.allocate(3) == [once_a, once_b, often_hit]
        assert pool.num_evictions == 4
    pool.check_invariants()


def test_lfu_counts_hits_on_held_blocks_and_forgets_them_with_the_contents():
    pool, (a, b) = cached_pool(lfu.LFUEviction(), 2)
    pool.touch([a])                              # a hit while a is held
    pool.free([a, a, b])
    assert pool.allocate(1) == [b]               # b: no hits, though freed after a
    assert pool.cache_block(b, b"new contents")
    pool.touch([b])
    pool.free([b, b])                            # b has one hit now, a one: a freed first
    assert pool.allocate(1) == [a]
    assert pool.cache_block(a, b"newer contents")
    pool.free([a])                               # a's old hit left with its old contents
    assert pool.allocate(1) == [a]
    pool.check_invariants()


def test_lfu_drops_revived_entries_and_clears_on_reset():
    policy = lfu.LFUEviction()
    pool, blocks = cached_pool(policy, 3)
    pool.free(blocks)
    for _ in range(500):                         # a hit revives, a free re-enters: stale entries
        pool.touch(blocks[:2])
        pool.free(blocks[:2])
    assert len(policy.heap) <= 2 * len(policy) + 64
    pool.check_invariants()
    assert pool.reset_cache() and len(policy) == 0 and not policy.hits and not policy.heap
    pool.check_invariants()


def test_a_policy_object_belongs_to_one_pool():
    with pytest.raises(TypeError, match=r"got the class LRUEviction: pass LRUEviction\(\)"):
        BlockPool(4, LRUEviction)
    with pytest.raises(TypeError, match="takes an EvictionPolicy, got OrderedDict"):
        from collections import OrderedDict
        BlockPool(4, OrderedDict())
    pool, blocks = cached_pool(LRUEviction(), 1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="LRUEviction given to BlockPool already holds blocks"):
        BlockPool(4, pool.eviction)


def test_check_invariants_covers_the_policys_set():
    # A held block in the policy's set, in place of a free one: the counts agree.
    pool, (a, b) = cached_pool(LRUEviction(), 2)
    pool.free([a])
    pool.check_invariants()
    pool.eviction.on_revive(a)
    pool.eviction.on_free(b)
    with pytest.raises(AssertionError, match=r"block \d: ref \d, free"):
        pool.check_invariants()
    # A block more than the pool freed.
    pool.eviction.on_free(a)
    with pytest.raises(AssertionError, match="LRUEviction lists 2 blocks.*counts 1 evictable"):
        pool.check_invariants()
    pool.eviction.on_revive(b)
    pool.check_invariants()
    # An evictable block without a hash.
    del pool._cached[pool.block_hash[a]]
    pool.block_hash[a] = None
    with pytest.raises(AssertionError, match="block 0 in LRUEviction has no hash"):
        pool.check_invariants()

    class Forgetful(Recording):                  # drops the blocks it is given
        def on_free(self, block: int) -> None:
            pass

    pool, blocks = cached_pool(Forgetful(), 2)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="Forgetful lists 0 blocks.*counts 2 evictable"):
        pool.check_invariants()
    with pytest.raises(RuntimeError, match="Forgetful lists 0 evictable blocks; the pool has 2"):
        pool.reset_cache()

    class Lying(Recording):                      # `in` disagrees with iteration
        def __contains__(self, block: object) -> bool:
            return False

    pool, blocks = cached_pool(Lying(), 1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match=r"Lying: `in` says False for block 0"):
        pool.check_invariants()


def test_a_policy_that_evicts_a_held_block_is_named():
    class Grabby(Recording):
        def evict(self) -> int:
            return 0                             # held, not in the set

    pool, blocks = cached_pool(Grabby(), 2)
    pool.free(blocks[1:])
    with pytest.raises(RuntimeError, match=r"Grabby.evict\(\) returned block 0, which is not "
                                           r"free and cached"):
        pool.allocate(1)


# --------------------------------------------------------------------------- the manager
def test_the_manager_passes_its_policy_and_options_to_the_pool():
    policy = lfu.LFUEviction()
    options = lfu.LFUOptions(name="lfu", block_size=8, enable_prefix_caching=False,
                             cache_salt="s", hash_seed="k")
    kv = PagedKVCacheManager.from_options(options, 12, eviction=policy)
    assert kv.pool.eviction is policy and kv.num_blocks == 12 and kv.block_size == 8
    assert (kv.enable_prefix_caching, kv.cache_salt) == (False, "s")
    assert issubclass(lfu.LFUOptions, PagedKVCacheOptions)


class LFUManagerMachine(paged_tests.KVManagerMachine):
    """The paged manager's property test (random admissions, chunks, preemptions, resets against
    a simulated KV cache) over LFU eviction."""

    eviction_class = lfu.LFUEviction


TestLFUManagerProperties = LFUManagerMachine.TestCase
TestLFUManagerProperties.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


def test_the_lfu_property_test_evicts_and_revives():
    from hypothesis.stateful import run_state_machine_as_test

    seen = paged_tests.KVManagerMachine.seen
    seen.clear()
    run_state_machine_as_test(LFUManagerMachine, settings=settings(
        max_examples=40, stateful_step_count=60, deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    for what in ("hit", "shared", "evicted", "revived"):
        assert seen[what] > 0, seen


# --------------------------------------------------------------------------- the deprecated path
def test_the_pool_updates_an_inline_order_itself_and_calls_a_changed_policy():
    """``inline_order`` is a capability any policy may declare: LRU does, so the pool updates
    its dict inline; a subclass that changes what a method does is called through it; a
    third-party policy offering its own dict is updated inline like LRU."""
    pool = BlockPool(4)
    assert pool._lru is pool.eviction.inline_order() is not None

    class Noisy(LRUEviction):
        def on_free(self, block: int) -> None:
            self.freed = getattr(self, "freed", []) + [block]
            super().on_free(block)

    noisy = Noisy()
    assert noisy.inline_order() is None
    pool, (a, b) = cached_pool(noisy, 2)
    pool.free([a, b])
    assert noisy.freed == [a, b] and list(noisy) == [a, b]

    class Ordered(EvictionPolicy):          # not an LRUEviction: claims the capability
        def __init__(self) -> None:
            self.order: dict[int, None] = {}
        def on_free(self, block): raise AssertionError("updated inline")
        def on_revive(self, block): raise AssertionError("updated inline")
        def evict(self): raise AssertionError("updated inline")
        def clear(self): self.order.clear()
        def __iter__(self): return iter(self.order)
        def inline_order(self):
            from collections import OrderedDict
            self.order = OrderedDict()
            return self.order

    ordered = Ordered()
    pool, (a, b, c) = cached_pool(ordered, 3)
    pool.free([c, a, b])
    assert list(ordered) == [c, a, b]
    pool.touch([a])                                      # revived: out of the order
    assert list(ordered) == [c, b]
    assert pool.allocate(1) == [c] and list(ordered) == [b]
    pool.check_invariants()


# --------------------------------------------------------------------------- the example, run
def _lfu_config(path, **sections) -> dict:
    # Disable the entry point in case the example is also installed in this environment.
    return engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]}, **sections)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def test_the_example_keeps_a_shared_prefix_that_lru_loses_and_generates_the_same(llama_path):
    """A 64-token system prompt used three times, then three one-off prompts that need more
    blocks than are left: LRU evicts the system prompt (freed longest ago), LFU the one-off
    blocks (never hit). The last request finds its prefix only under LFU; every output equals
    the built-in manager's."""
    rng = random.Random(36)
    system = _tokens(rng, 64)
    prompts = [system + _tokens(rng, 10) for _ in range(3)]
    prompts += [_tokens(rng, 150) for _ in range(3)]
    prompts += [system + _tokens(rng, 10)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def sections(name: str) -> dict:
        return {"model": {"max_model_len": 256},
                "kv_cache": {"name": name, "num_blocks": 24, "block_size": 16}}

    def serve(llm: LLM) -> tuple[list[list[int]], list[int]]:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                for p in prompts]                # one at a time: a fixed freeing order
        assert llm.engine.kv_cache_manager.pool.num_evictions > 0
        assert_pool_whole(llm)
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]

    with LLM(_lfu_config(llama_path, **sections("lfu")), plugins=[lfu]) as llm:
        assert llm.registry.get("kv_cache", "lfu").plugin.name == EXAMPLE_MODULE
        assert type(llm.engine.kv_cache_manager.pool.eviction) is lfu.LFUEviction
        lfu_tokens, lfu_cached = serve(llm)
    with LLM(engine_config(llama_path, **sections("paged"))) as llm:
        assert type(llm.engine.kv_cache_manager.pool.eviction) is LRUEviction
        paged_tokens, paged_cached = serve(llm)

    assert lfu_tokens == paged_tokens
    assert lfu_cached[:3] == paged_cached[:3] == [0, 64, 64]
    assert lfu_cached[-1] == 64 and paged_cached[-1] == 0


def test_the_example_config_validates_with_the_paged_options():
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[lfu])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert config.kv_cache.name == "lfu" and isinstance(config.kv_cache, lfu.LFUOptions)
    with pytest.raises(ConfigError, match=r"kv_cache\.enable_prefix_caching"):
        load_config({"kv_cache": {"name": "lfu", "enable_prefix_caching": "sometimes"}},
                    registry=registry)
