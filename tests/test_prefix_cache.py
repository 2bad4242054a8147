"""Prefix caching end to end: what is computed, what comes out, and that nothing leaks.

Every engine here runs with a write watch on its plans: before each forward, every block that
will receive new K/V must be held by exactly one request and not be in the prefix cache, i.e.
no block is written while another request reads it. Outputs are compared with the same engine
configuration without prefix caching and, for the long shared prefix, with transformers.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.request import RequestStatus as S
from tests.conftest import assert_pool_whole, engine_config
from tests.test_hf_equivalence import compare

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def watched(cfg: dict, caching: bool = True) -> tuple[LLM, Counter]:
    """An LLM whose every plan is checked for write safety; the Counter records the most holders
    any scheduled request's block had (sharing happened) and the plans seen."""
    cfg = {**cfg, "kv_cache": {**cfg.get("kv_cache", {}), "enable_prefix_caching": caching}}
    llm = LLM(cfg)
    engine, seen = llm.engine, Counter()
    kv, bs = engine.kv_cache_manager, engine.kv_cache_manager.block_size
    execute = engine.executor.execute_model

    def checked_execute(plan):
        for rid, n in plan.num_scheduled_tokens.items():
            request = engine.scheduler.requests[rid]
            table = kv.get_block_ids(request)
            start = plan.num_computed_tokens[rid]
            for b in {table[p // bs] for p in range(start, start + n)}:
                assert kv.pool.ref_cnt[b] == 1, f"{rid} writes block {b}, shared by others"
                assert kv.pool.block_hash[b] is None, f"{rid} writes cached block {b}"
            seen["max_holders"] = max(seen["max_holders"], *(kv.pool.ref_cnt[b] for b in table))
        seen["plans"] += 1
        return execute(plan)

    engine.executor.execute_model = checked_execute
    return llm, seen


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def run(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def long_path(make_checkpoint):
    return make_checkpoint("llama", max_position_embeddings=2048)


def test_shared_1000_token_prefix_computes_only_the_suffix(long_path):
    rng = random.Random(0)
    prefix = tokens(rng, 1000)
    first, second = prefix + tokens(rng, 20), prefix + tokens(rng, 30)
    cfg = engine_config(long_path)
    cfg["model"]["max_model_len"] = 1100
    llm, seen = watched(cfg)
    plans = []
    execute = llm.engine.executor.execute_model
    llm.engine.executor.execute_model = lambda plan: (plans.append(plan), execute(plan))[1]

    out_first = run(llm, [first], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out_first[0].num_cached_tokens == 0
    plans.clear()
    out = run(llm, [second], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))

    # At its first schedule the request starts at the cached length: 62 full blocks of 16.
    new = plans[0].scheduled_new_reqs[0]
    assert new.num_computed_tokens == 992
    assert plans[0].num_scheduled_tokens[new.req_id] == len(second) - 992
    assert out[0].num_cached_tokens == 992
    stats = llm.get_stats()
    assert stats.prefix_cache_hits == 992
    assert stats.prefix_cache_queries == len(first) + len(second)
    assert stats.num_prefill_tokens == len(first) + len(second) - 992
    assert stats.num_prompt_tokens == len(first) + len(second)

    # Identical without prefix caching, and to transformers.
    plain, _ = watched(cfg, caching=False)
    ref = run(plain, [first, second], SamplingParams(max_tokens=32, temperature=0,
                                                     ignore_eos=True))
    assert token_ids(ref) == token_ids(out_first) + token_ids(out)
    assert plain.get_stats().prefix_cache_hits == 0

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(long_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([second]), attention_mask=torch.ones(1, len(second),
                            dtype=torch.long), max_new_tokens=32, do_sample=False,
                            eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                            output_logits=True)
    note = compare(out[0].outputs[0].token_ids, hf.sequences[0, len(second):].tolist(),
                   [lg[0] for lg in hf.logits])
    assert note is None, note
    assert_pool_whole(llm)
    assert_pool_whole(plain)


def test_concurrent_requests_sharing_a_prefix(llama_path):
    rng = random.Random(1)
    prefix = tokens(rng, 200)
    prompts = [prefix + tokens(rng, rng.randrange(1, 40)) for _ in range(12)]
    prompts += [prefix[:100] + tokens(rng, 30) for _ in range(3)]     # a shorter shared part
    cfg = engine_config(llama_path, scheduler={"max_num_batched_tokens": 256})
    llm, seen = watched(cfg)
    out = run(llm, prompts)
    plain, _ = watched(cfg, caching=False)
    assert token_ids(out) == token_ids(run(plain, prompts))

    stats = llm.get_stats()
    assert seen["max_holders"] >= 10, seen            # the prefix blocks were shared at once
    # Only the first request computes the 192 cached-able prefix tokens (12 blocks); each
    # other one finds them, waiting a step when the prefix is still being computed.
    assert sum(o.num_cached_tokens >= 192 for o in out[:12]) == 11
    assert all(o.num_cached_tokens == 96 for o in out[12:])
    assert stats.num_prefill_tokens == sum(map(len, prompts)) - stats.prefix_cache_hits
    assert stats.num_prefill_tokens < plain.get_stats().num_prefill_tokens / 2
    assert_pool_whole(llm)


def test_waiting_for_a_pending_block_keeps_the_policy_order(llama_path):
    """B shares A's prefix and arrives before the unrelated C. While A computes the prefix, B
    waits for it, and C, behind B in FCFS order, must not take B's place (here: the second of
    two running seats, which C would hold for its whole generation)."""
    from tests.test_engine import core_request, trace

    rng = random.Random(9)
    prefix = tokens(rng, 32)
    cfg = engine_config(llama_path, scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 20})
    llm, _ = watched(cfg)
    engine = llm.engine
    for rid, prompt, max_tokens in (("A", prefix + tokens(rng, 4), 30),
                                    ("B", prefix + tokens(rng, 2), 30),
                                    ("C", tokens(rng, 10), 30)):
        request = core_request(rid, 1, max_tokens)
        request.prompt_token_ids = prompt
        engine.add_request(request)
    b = engine.scheduler.requests["B"]
    history = trace(engine, ["A", "B", "C"])
    first_running = {rid: next(i for i, h in enumerate(history) if h[rid][0] == S.RUNNING)
                     for rid in "ABC"}
    assert first_running["A"] < first_running["B"] < first_running["C"], first_running
    assert b.num_cached_tokens == 32           # B waited for the whole prefix, then found it
    assert_pool_whole(llm)


def test_n_samples_share_their_prompt(llama_path):
    prompt = tokens(random.Random(2), 100)
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7)
    llm, seen = watched(engine_config(llama_path))
    out = run(llm, [prompt], params)
    plain, _ = watched(engine_config(llama_path), caching=False)
    assert token_ids(out) == token_ids(run(plain, [prompt], params))
    assert out[0].num_cached_tokens == 96 and seen["max_holders"] == 4
    assert llm.get_stats().prefix_cache_hits == 3 * 96
    assert_pool_whole(llm)


def test_eviction_when_the_pool_cannot_keep_everything(llama_path):
    rng = random.Random(3)
    prompts = [tokens(rng, 200) for _ in range(6)]        # 13 blocks each with their outputs
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 40})
    cfg["model"]["max_model_len"] = 256
    llm, _ = watched(cfg)
    first = [run(llm, [p])[0] for p in prompts]           # one at a time: older ones evicted
    kv = llm.engine.kv_cache_manager
    assert kv.pool.num_evictions > 0
    assert kv.num_cached_blocks <= 40

    again_new, again_old = run(llm, [prompts[-1]])[0], run(llm, [prompts[0]])[0]
    assert again_new.num_cached_tokens == 192               # recently used: still cached
    assert again_old.num_cached_tokens == 0                 # least recently used: evicted
    assert again_new.outputs[0].token_ids == first[-1].outputs[0].token_ids
    assert again_old.outputs[0].token_ids == first[0].outputs[0].token_ids
    plain, _ = watched(cfg, caching=False)
    assert token_ids(run(plain, prompts)) == token_ids(first)
    assert_pool_whole(llm)


def test_preempting_a_request_that_holds_shared_blocks(llama_path):
    rng = random.Random(4)
    prefix = tokens(rng, 64)
    prompts = [prefix + tokens(rng, 8) for _ in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    # 16 blocks: the 4 shared prefix blocks + 4 x 4 private ones do not fit once outputs grow.
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 16})
    cfg["model"]["max_model_len"] = 144
    llm, seen = watched(cfg)
    preempted_shared = []
    scheduler, kv = llm.engine.scheduler, llm.engine.kv_cache_manager
    preempt = scheduler._preempt

    def spy(request, *args):
        preempted_shared.append(max(kv.pool.ref_cnt[b] for b in kv.get_block_ids(request)) > 1)
        preempt(request, *args)
    scheduler._preempt = spy
    out = run(llm, prompts, params)

    assert llm.get_stats().num_preemptions > 0 and any(preempted_shared), preempted_shared
    reference, _ = watched(engine_config(llama_path), caching=False)   # roomy, no preemption
    assert token_ids(out) == token_ids(run(reference, prompts, params))
    assert reference.get_stats().num_preemptions == 0
    assert_pool_whole(llm)


def test_cache_salt_isolates_requests(llama_path):
    prompt = tokens(random.Random(5), 80)
    llm, _ = watched(engine_config(llama_path))
    salted = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-a")
    assert run(llm, [prompt], GREEDY)[0].num_cached_tokens == 0
    assert run(llm, [prompt], salted)[0].num_cached_tokens == 0       # other tenant: no hit
    assert run(llm, [prompt], salted)[0].num_cached_tokens == 64      # same tenant: hit
    other = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-b")
    assert run(llm, [prompt], other)[0].num_cached_tokens == 0
    assert run(llm, [prompt], GREEDY)[0].num_cached_tokens == 64      # unsalted still cached
    assert_pool_whole(llm)


def test_engine_salt_and_seed_change_the_keys():
    from corellm.request import EngineCoreRequest, Request
    from corellm.kv.paged import PagedKVCacheManager

    request = Request(EngineCoreRequest("r", list(range(40)), SamplingParams(), None, 0.0), 64)

    def keys(**kw):
        kv = PagedKVCacheManager(8, 16, enable_prefix_caching=True, **kw)
        return kv._block_hashes(request, 2)

    assert keys(hash_seed="x") == keys(hash_seed="x")
    assert keys(hash_seed="x") != keys(hash_seed="y")
    assert keys(hash_seed="x") != keys(hash_seed="x", cache_salt="engine-2")
    assert keys() != keys()                                  # unseeded: per-process random


def test_reset_prefix_cache(llama_path):
    prompt = tokens(random.Random(6), 80)
    llm, _ = watched(engine_config(llama_path))
    run(llm, [prompt])
    assert llm.get_stats().kv_blocks_cached > 0
    assert llm.reset_prefix_cache()
    assert llm.get_stats().kv_blocks_cached == 0
    assert run(llm, [prompt])[0].num_cached_tokens == 0

    # Refused while a request holds blocks; the cache is untouched and usable afterwards.
    llm.engine.add_request(llm.processor.process("x", {"prompt_token_ids": prompt}, GREEDY)[1])
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    assert llm.get_stats().kv_blocks_cached > 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert run(llm, [prompt])[0].num_cached_tokens == 64
    assert_pool_whole(llm)


def test_disabled_prefix_caching_computes_every_prompt_token(llama_path):
    prompt = tokens(random.Random(7), 80)
    llm, _ = watched(engine_config(llama_path), caching=False)
    outs = run(llm, [prompt, prompt])
    run(llm, [prompt])
    stats = llm.get_stats()
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert stats.prefix_cache_hits == stats.prefix_cache_queries == stats.kv_blocks_cached == 0
    assert stats.num_prefill_tokens == stats.num_prompt_tokens == 3 * 80
    assert llm.reset_prefix_cache()
    assert_pool_whole(llm)


def test_request_metrics_time_the_first_token(llama_path):
    llm = LLM(engine_config(llama_path))
    out = run(llm, [tokens(random.Random(8), 40)])[0]
    m = out.metrics
    assert m is not None and 0 < m.time_to_first_token <= m.latency
    assert m.arrival_time <= m.first_token_time <= m.finished_time
