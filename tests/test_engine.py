"""The engine core's behaviour: request lifecycle, stop conditions, aborts, failures, stats."""

from __future__ import annotations

import enum

import time

import pytest

from corellm import LLM, SamplingParams
from corellm.errors import InvalidRequestError
from corellm.request import EngineCoreRequest, RequestStatus
from corellm.sampling_params import SamplingParams as SP
from tests.conftest import assert_pool_whole, engine_config

S = RequestStatus


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(engine_config(llama_path))


def core_request(rid: str, n_prompt: int, max_tokens: int, start: int = 10,
                 **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(range(start, start + n_prompt)),
                             SP(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw),
                             eos_token_id=0, arrival_time=time.time())


def policy_plugin(name: str, policy_cls) -> object:
    """An in-process plugin registering ``policy_cls`` as scheduler ``name``."""
    from corellm.scheduling import policy_scheduler

    class Plugin:
        def corellm_schedulers(self):
            yield policy_scheduler(name, lambda options: policy_cls())
    return Plugin()


def tight_pool_config(path, **sections) -> dict:
    """9 blocks x 16 tokens: three 60-token prompts growing by 40 tokens must preempt."""
    cfg = engine_config(path, kv_cache={"num_blocks": 9}, **sections)
    cfg["model"]["max_model_len"] = 144
    return cfg


def trace(engine, rids) -> list[dict[str, tuple]]:
    """Step the engine to completion, recording (status, computed, num_tokens) after each step."""
    reqs = {rid: engine.scheduler.requests[rid] for rid in rids}
    history = [{rid: (r.status, r.num_computed_tokens, r.num_tokens) for rid, r in reqs.items()}]
    while engine.has_unfinished_requests():
        engine.step()
        history.append({rid: (r.status, r.num_computed_tokens, r.num_tokens)
                        for rid, r in reqs.items()})
    return history


def test_lifecycle_chunked_prefill_then_decode(llama_path):
    llm = LLM(engine_config(llama_path, scheduler={"max_num_batched_tokens": 32}))
    engine = llm.engine
    engine.add_request(core_request("a", 70, 3))
    h = [s["a"] for s in trace(engine, ["a"])]
    # 70-token prompt under a 32-token budget: chunks of 32, 32, 6; the last chunk samples.
    assert h == [
        (S.WAITING, 0, 70),
        (S.RUNNING, 32, 70),
        (S.RUNNING, 64, 70),
        (S.RUNNING, 70, 71),
        (S.RUNNING, 71, 72),
        (S.FINISHED_LENGTH, 72, 73),
    ]
    assert_pool_whole(llm)


def test_lifecycle_with_preemption(llama_path):
    # 10 blocks x 16 = 160 tokens; two requests growing to 75 + 75 tokens (5 blocks each) fit
    # until the last tokens, then the later one is preempted, recomputed, and both finish.
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 9})
    cfg["model"]["max_model_len"] = 144
    llm = LLM(cfg)
    engine = llm.engine
    engine.add_request(core_request("old", 60, 20))
    engine.add_request(core_request("new", 60, 20, start=100))  # no shared prefix to cache
    history = trace(engine, ["old", "new"])
    new_states = [s["new"][0] for s in history]
    old_states = [s["old"][0] for s in history]
    assert S.PREEMPTED in new_states, "the most recently admitted request should be the victim"
    assert S.PREEMPTED not in old_states
    i = new_states.index(S.PREEMPTED)
    assert history[i - 1]["new"][0] == S.RUNNING and history[i]["new"][1] == 0
    # Every observed transition is one of the state machine's. Between two steps a preempted
    # request can go PREEMPTED -> WAITING -> RUNNING inside one schedule(), seen as P -> R.
    allowed = {(S.WAITING, S.WAITING), (S.WAITING, S.RUNNING), (S.RUNNING, S.RUNNING),
               (S.RUNNING, S.PREEMPTED), (S.PREEMPTED, S.WAITING), (S.PREEMPTED, S.RUNNING),
               (S.RUNNING, S.FINISHED_LENGTH), (S.FINISHED_LENGTH, S.FINISHED_LENGTH)}
    for states in (new_states, old_states):
        assert set(zip(states, states[1:])) <= allowed, list(zip(states, states[1:]))
    assert (S.PREEMPTED, S.WAITING) in set(zip(new_states, new_states[1:])), \
        "the victim waits (PREEMPTED -> WAITING) while the other request holds the blocks"
    after = new_states[i:]
    assert after[-1] == S.FINISHED_LENGTH
    assert S.RUNNING in after                       # readmitted after the victim waits
    assert old_states[-1] == S.FINISHED_LENGTH
    assert history[-1]["new"][2] == 80 and history[-1]["old"][2] == 80
    assert llm.get_stats().num_preemptions >= 1
    assert_pool_whole(llm)


def test_stop_conditions(llm, tokenizer):
    eos = tokenizer.eos_token_id
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    # Stop on the 4th generated token by declaring it a stop token.
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert c.token_ids == free.token_ids[:first + 1]
    assert eos is not None
    assert_pool_whole(llm)


def test_max_model_len_caps_generation(llama_path):
    cfg = engine_config(llama_path)
    cfg["model"]["max_model_len"] = 40
    llm = LLM(cfg)
    out = llm.generate({"prompt_token_ids": list(range(3, 33))},
                       SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10
    # A prompt of exactly max_model_len still yields one token; one more is rejected.
    out = llm.generate({"prompt_token_ids": list(range(3, 43))}, SamplingParams(max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1
    with pytest.raises(InvalidRequestError, match="41 tokens exceeds model.max_model_len=40"):
        llm.generate({"prompt_token_ids": list(range(3, 44))}, use_tqdm=False)


def test_outputs_in_input_order_and_text(llm, tokenizer):
    prompts = ["a b c d e f g h i j k l m n o p", "hello", "The quick brown fox"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        assert o.prompt_token_ids == tokenizer.encode(o.prompt)
        assert o.finished and o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids,
                                                                    skip_special_tokens=True)


def test_per_prompt_params_and_n(llm):
    outs = llm.generate([{"prompt_token_ids": [4, 5]}, {"prompt_token_ids": [6, 7]}],
                        [SamplingParams(max_tokens=3, ignore_eos=True),
                         SamplingParams(max_tokens=5, ignore_eos=True, n=3, seed=7)],
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 for c in outs[1].outputs)
    assert len({tuple(c.token_ids) for c in outs[1].outputs}) > 1
    assert_pool_whole(llm)


def test_seed_reproducible_regardless_of_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    alone = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [20 + i] * (i + 3)} for i in range(5)]
    batched = llm.generate([*others, prompt], [SamplingParams(max_tokens=16, ignore_eos=True)] * 5
                           + [params], use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == again == batched
    other_seed = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                     ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_seed_survives_preemption(llama_path):
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 63 + i))} for i in range(4)]
    roomy = LLM(engine_config(llama_path)).generate(prompts, params, use_tqdm=False)
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 9})
    cfg["model"]["max_model_len"] = 144
    tight = LLM(cfg)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in squeezed]
    assert_pool_whole(tight)


def test_logprobs_match_reference(llm, llama_path):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [7, 8, 9, 10, 11, 12]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == 4
    cum = 0.0
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[tok].rank == 1                       # greedy: the sampled token is the best
        assert entry[tok].logprob == pytest.approx(ref[step, tok].item(), abs=1e-4)
        top = ref[step].topk(3)
        assert [t for t in entry] [:1] == [tok]
        assert {t: round(lp.logprob, 3) for t, lp in entry.items()} == {
            t: round(v, 3) for t, v in zip(top.indices.tolist(), top.values.tolist())}
        cum += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(cum)


class _Id(enum.IntEnum):
    TWO = 2


BAD_INPUTS = [
    ("", SP(), "prompt: is empty"),
    ({"prompt_token_ids": []}, SP(), "prompt_token_ids: is empty"),
    ({"prompt_token_ids": [1, 999999]}, SP(), r"prompt_token_ids\[1\]: token id 999999 is outside"),
    ({"prompt_token_ids": [1, -1]}, SP(), r"prompt_token_ids\[1\]"),
    ({"prompt_token_ids": [1, True]}, SP(), "prompt_token_ids: must be a list of integers"),
    ({"prompt_token_ids": [1, 2.0]}, SP(), "prompt_token_ids: must be a list of integers"),
    ({"prompt_token_ids": [1, _Id.TWO, 999999]}, SP(), r"prompt_token_ids\[2\]"),
    ({"prompt_token_ids": list(range(3, 600))}, SP(), "exceeds model.max_model_len=512"),
    ({"prompt": "x", "prompt_token_ids": [1]}, SP(), "exactly one"),
    (42, SP(), "expected a string or a dict"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_INPUTS)
def test_bad_prompt_rejected_before_scheduling(llm, prompt, params, message):
    before = llm.get_stats()
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    after = llm.get_stats()
    assert after.num_steps == before.num_steps
    assert_pool_whole(llm)
    # still usable
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_parameters_beyond_float32_sample_no_banned_token(llm):
    """Any finite temperature and any positive repetition penalty are valid; past float32's
    range they must not make a row NaN (-inf / inf for banned and filtered tokens, x / 0 for a
    penalized one): a NaN row samples token 0, here a banned EOS, and the engine would stop on
    a sampler error."""
    for kw in ({"temperature": 1e308}, {"temperature": 1e39},
               {"repetition_penalty": 5e-324}, {"repetition_penalty": 1e-40}):
        params = SP(min_tokens=3, max_tokens=4, top_k=5, ignore_eos=False, **kw)
        out = llm.generate("hello hello hello", params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) >= 3 and out.finished, kw
    assert_pool_whole(llm)


def test_prompt_ids_of_int_subclasses_are_accepted(llm):
    """An int subclass (IntEnum) is an integer id (the prompt check's slow path); bool, though
    an int subclass too, is not (see BAD_INPUTS)."""
    ids = [1, 5, _Id.TWO, 7]
    out = llm.generate({"prompt_token_ids": ids}, SP(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == [1, 5, 2, 7] and out.finished


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "sampling_params.max_tokens"),
    ({"temperature": -0.1}, "sampling_params.temperature"),
    ({"top_p": 0.0}, "sampling_params.top_p"),
    ({"top_p": 1.5}, "sampling_params.top_p"),
    ({"top_k": -2}, "sampling_params.top_k"),
    ({"min_p": 2.0}, "sampling_params.min_p"),
    ({"logprobs": 100}, "sampling_params.logprobs"),
    ({"n": 0}, "sampling_params.n"),
    ({"cache_salt": ""}, "sampling_params.cache_salt"),
    ({"cache_salt": 42}, "sampling_params.cache_salt"),
    ({"cache_salt": "\ud800"}, "sampling_params.cache_salt"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_one_bad_prompt_in_a_batch_schedules_nothing(llm):
    before = llm.get_stats().num_steps
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]\.prompt: is empty"):
        llm.generate(["fine", "", "also fine"], use_tqdm=False)
    assert llm.get_stats().num_steps == before
    assert_pool_whole(llm)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request(core_request("x", 40, 50))
    engine.add_request(core_request("y", 40, 50))
    engine.step()
    engine.step()
    assert llm.get_stats().kv_blocks_free < llm.get_stats().kv_blocks_total
    outs = engine.abort_requests(["x", "y", "unknown"])
    assert {(o.request_id, o.finish_reason) for o in outs} == {("x", "abort"), ("y", "abort")}
    assert not engine.has_unfinished_requests()
    assert_pool_whole(llm)
    engine.step()   # the workers drop the aborted requests' state
    assert not llm.engine.executor.worker.runner.requests


def test_failed_step_finishes_requests_with_error(llm, monkeypatch):
    engine = llm.engine
    engine.add_request(core_request("boom", 20, 5))
    seen = []

    def explode(plan):
        raise RuntimeError("device fell over")
    monkeypatch.setattr(engine.executor, "execute_model", explode)
    request = engine.scheduler.requests["boom"]
    with pytest.raises(RuntimeError, match="device fell over"):
        engine.step()
    assert request.status == S.FINISHED_ERROR and request.status.finish_reason == "error"
    assert not seen
    monkeypatch.undo()
    assert_pool_whole(llm)
    assert llm.generate("still alive", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize("core_thread", [False, True])
def test_interrupted_generate_aborts_everything(llm, llama_path, monkeypatch, core_thread):
    """A KeyboardInterrupt from a step reaches the caller (from the core thread too), and
    nothing stays behind."""
    if core_thread:
        llm = LLM(engine_config(llama_path), core_thread=True)
    engine = llm.engine
    calls = {"n": 0}
    real_step = engine.step

    def step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()
    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert_pool_whole(llm)
    if core_thread:
        llm.shutdown()


def test_stats_snapshot(llm):
    stats = llm.get_stats()
    for field in ("num_running_reqs", "num_waiting_reqs", "kv_blocks_total", "kv_blocks_free",
                  "num_preemptions"):
        assert isinstance(getattr(stats, field), int)
    assert stats.kv_blocks_total == 256
    for phase in ("schedule", "prepare_inputs", "forward", "sample", "update", "step"):
        assert stats.timings[phase] >= 0


def test_capacity_checked_at_startup(llama_path):
    from corellm.errors import ConfigError
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 4})
    with pytest.raises(ConfigError, match="kv_cache.num_blocks"):
        LLM(cfg)


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    free = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop = free[0]                            # greedy would stop at once on this token
    out = llm.generate(prompt, SamplingParams(max_tokens=6, min_tokens=4, temperature=0,
                                              stop_token_ids=[stop]), use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_model_seed_makes_unseeded_sampling_reproducible(llama_path):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [9, 9]}]

    def run(seed):
        llm = LLM(engine_config(llama_path, model={"seed": seed}))
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_n_samples_with_seed_are_distinct_and_reproducible(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=11, ignore_eos=True)
    a = [c.token_ids for c in llm.generate("x y", params, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate("x y", params, use_tqdm=False)[0].outputs]
    single = llm.generate("x y", SamplingParams(max_tokens=8, temperature=1.0, seed=11,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert a == b and len({tuple(t) for t in a}) == 3
    assert a[0] == single.token_ids


def test_tilde_paths_expand(llama_path, monkeypatch):
    monkeypatch.setenv("HOME", str(llama_path.parent))
    llm = LLM(engine_config(f"~/{llama_path.name}"))
    assert llm.config.model.path == str(llama_path)
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_memory_budget_too_small(llama_path):
    from corellm.errors import ConfigError
    cfg = engine_config(llama_path)
    del cfg["kv_cache"]["num_blocks"]
    cfg["kv_cache"]["memory_gib"] = 1e-9
    with pytest.raises(ConfigError, match="kv_cache.memory_gib: 1e-09 GiB holds no KV block"):
        LLM(cfg)
    cfg["kv_cache"]["memory_gib"] = 0.001            # sized from the budget
    llm = LLM(cfg)
    per_block = 2 * 2 * 16 * 2 * 16 * 4              # layers x K/V x block x kv heads x dim x fp32
    assert llm.get_stats().kv_blocks_total == int(0.001 * 2**30) // per_block


def test_a_policy_cannot_lose_a_request(llama_path):
    """A victim that is not running is refused with a clear error; nothing leaks."""
    from corellm.interfaces import SchedulingPolicy

    class Rogue(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return object()                      # not a running request

    cfg = tight_pool_config(llama_path, scheduler={"name": "rogue"})
    llm = LLM(cfg, plugins=[policy_plugin("rogue", Rogue)])
    with pytest.raises(RuntimeError, match="Rogue.choose_victim returned .* which is not running"):
        llm.generate([{"prompt_token_ids": list(range(3, 63))}] * 3,
                     SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert_pool_whole(llm)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": float("nan")}, "sampling_params.temperature"),
    ({"temperature": float("inf")}, "sampling_params.temperature"),
    ({"top_p": float("nan")}, "sampling_params.top_p"),
    ({"max_tokens": True}, "sampling_params.max_tokens"),
    ({"max_tokens": 3.0}, "sampling_params.max_tokens"),
    ({"seed": False}, "sampling_params.seed"),
])
def test_non_finite_and_bool_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_a_policy_cannot_stall_the_engine(llama_path):
    """can_admit is consulted only while something runs, so a refusing policy delays, not hangs."""
    from corellm.interfaces import SchedulingPolicy

    class Refuse(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return running[-1]

        def can_admit(self, request, ctx):
            return False

    llm = LLM(engine_config(llama_path, scheduler={"name": "refuse"}), plugins=[policy_plugin("refuse", Refuse)])
    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3, ignore_eos=True),
                        use_tqdm=False)
    assert all(o.finished for o in outs)
    assert llm.get_stats().num_steps == 9            # one at a time, as the policy insists


def test_a_policy_mutating_running_cannot_lose_requests(llama_path):
    from corellm.interfaces import SchedulingPolicy

    class Mutator(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return running.pop()                         # running is a tuple: this raises

    cfg = tight_pool_config(llama_path, scheduler={"name": "mutator"})
    llm = LLM(cfg, plugins=[policy_plugin("mutator", Mutator)])
    with pytest.raises(AttributeError, match="pop"):
        llm.generate([{"prompt_token_ids": list(range(3, 63))}] * 3,
                     SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_pool_whole(llm)


def test_failed_schedule_ends_every_request(llama_path, monkeypatch):
    llm = LLM(engine_config(llama_path))
    engine = llm.engine
    engine.add_request(core_request("p", 10, 5))
    engine.add_request(core_request("q", 10, 5))
    engine.step()
    reqs = dict(engine.scheduler.requests)
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    monkeypatch.undo()
    assert {r.status for r in reqs.values()} == {S.FINISHED_ERROR}
    assert_pool_whole(llm)
    assert llm.generate("again", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_skip_tokenizer_init_generates_the_same_tokens_without_text(llama_path):
    """``LLM(skip_tokenizer_init=True)`` (vLLM's option) loads no tokenizer: token-id prompts
    give the same tokens as with one, with empty text and logprobs without token text; a text
    prompt, stop strings and a chat are refused, naming what needs the tokenizer."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9] * 12}]
    llm = LLM(engine_config(llama_path))
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                use_tqdm=False)]
        reference_ends = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                           o.outputs[0].stop_reason)
                          for o in llm.generate(prompts, SamplingParams(max_tokens=60,
                                                                        temperature=0),
                                                use_tqdm=False)]
    finally:
        llm.shutdown()
    llm = LLM(engine_config(llama_path), skip_tokenizer_init=True)
    try:
        assert llm.tokenizer is None
        out = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == expected
        assert all(o.outputs[0].text == "" for o in out)
        assert all(lp.decoded_token is None for o in out for step in o.outputs[0].logprobs
                   for lp in step.values())
        # Without ignore_eos: the same end, from the checkpoint's end-of-sequence ids.
        plain = SamplingParams(max_tokens=60, temperature=0)
        ended = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                 for o in llm.generate(prompts, plain, use_tqdm=False)]
        assert ended == reference_ends
        with pytest.raises(InvalidRequestError) as e:
            llm.generate("Hello", params, use_tqdm=False)
        assert e.value.field == "prompt" and "skip_tokenizer_init" in str(e.value)
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(prompts[0], SamplingParams(stop=["x"]), use_tqdm=False)
        assert e.value.field == "sampling_params.stop"
        with pytest.raises(InvalidRequestError) as e:
            llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
        assert e.value.field == "messages"
        assert_pool_whole(llm)
    finally:
        llm.shutdown()
