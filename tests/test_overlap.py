"""Overlapped steps (``scheduler.async_scheduling``): the engine plans step N+1 while step N runs,
and every output is the synchronous loop's, token for token.

Each case runs the same requests through two engines that differ only in that key, on the same
checkpoint, and compares every completion (tokens, text, finish reason, logprobs); the
overlapped run must really have overlapped (a step planned while another was in the executor).
"""

from __future__ import annotations

import logging

import pytest

from corellm import LLM, SamplingParams
from corellm.sampling_params import StructuredOutputsParams
from tests.conftest import assert_pool_whole, engine_config


def _prompts(n: int = 10, shared: int = 40) -> list[dict]:
    prefix = [7 + (j * 11) % 500 for j in range(shared)]
    out = []
    for i in range(n):
        body = [11 + (i * 37 + j * 13) % 900 for j in range(5 + 13 * i)]
        out.append({"prompt_token_ids": (prefix if i % 2 else []) + body})
    return out


def _completions(outs) -> list[tuple]:
    """Every completion's tokens, text, finish and stop reasons, and logprobs: token ids and
    ranks exactly, values to float32 rounding (overlapped steps batch requests differently, and
    a batch's shape changes the last bits of a matmul)."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else
             [[(t, pytest.approx(lp.logprob, rel=1e-5, abs=1e-5), lp.rank, lp.decoded_token)
               for t, lp in sorted(d.items())] for d in c.logprobs])
            for o in outs for c in o.outputs]


def _both(cfg: dict, run, *, plugins=None) -> tuple[list, list, int]:
    """``run(llm)`` under the synchronous loop and under overlapped steps."""
    results = []
    overlapped = 0
    for overlap in (False, True):
        c = {**cfg, "scheduler": {**cfg.get("scheduler", {}), "async_scheduling": overlap}}
        with LLM(c, plugins=plugins or []) as llm:
            assert llm.engine.async_scheduling is overlap
            results.append(run(llm))
            assert_pool_whole(llm)
            overlapped = llm.engine.num_overlapped_steps
    return results[0], results[1], overlapped


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

CASES = {
    # chunked prefill (a 32-token budget), prefix caching, a pool small enough to preempt
    "greedy-chunked-preempting": (
        {"kv_cache": {"num_blocks": 14}, "model": {"max_model_len": 192},
         "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 6}},
        [GREEDY]),
    # seeded sampling with every filter, penalties, min_tokens, logprobs
    "seeded-penalties-logprobs": (
        {"scheduler": {"max_num_seqs": 4}},
        [SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01,
                        seed=s, presence_penalty=0.5, frequency_penalty=0.3,
                        repetition_penalty=1.2, min_tokens=5, logprobs=3)
         for s in range(10)]),
    # EOS and stop tokens end requests at different steps; max_tokens from 1
    "eos-stop-lengths": (
        {},
        [SamplingParams(max_tokens=1 + 3 * i, temperature=0.0,
                        stop_token_ids=[(i * 97) % 200 + 3]) for i in range(10)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_steps_give_the_synchronous_outputs(llama_path, case):
    sections, params = CASES[case]
    cfg = engine_config(llama_path, **sections)
    prompts = _prompts()
    sync, over, overlapped = _both(cfg, lambda llm: _completions(llm.generate(
        prompts, params if len(params) > 1 else params[0], use_tqdm=False)))
    assert over == sync
    assert overlapped > 5


def test_preemption_and_priorities_under_overlap(llama_path):
    """The priority scheduler preempts running requests for urgent arrivals; a request the
    next plan preempts while its token is being sampled keeps that token."""
    cfg = engine_config(llama_path, kv_cache={"num_blocks": 10}, model={"max_model_len": 160},
                        scheduler={"name": "priority", "max_num_seqs": 4})
    prompts = _prompts(8)

    def run(llm):
        outs = llm.generate(prompts, GREEDY, priority=[(i * 5) % 3 for i in range(8)],
                            use_tqdm=False)
        return _completions(outs), llm.get_stats().num_preemptions

    sync, over, overlapped = _both(cfg, run)
    assert over[0] == sync[0] and overlapped > 5
    assert sync[1] > 0 and over[1] > 0          # the run preempted, both ways


def test_stop_strings_and_aborts_under_overlap(llama_path):
    """Stop strings end requests on text (the client aborts them); the outputs are the same."""
    cfg = engine_config(llama_path)
    prompts = _prompts(6, shared=0)

    def run(llm):
        plain = llm.generate(prompts, GREEDY, use_tqdm=False)
        # Stop on a piece of each request's own greedy text, so every one stops early.
        params = []
        for o in plain:
            text = o.outputs[0].text
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                         stop=[text[len(text) // 2:len(text) // 2 + 3]]
                                         if len(text) > 8 else None))
        return _completions(llm.generate(prompts, params, use_tqdm=False))

    sync, over, overlapped = _both(cfg, run)
    assert over == sync and overlapped > 5
    assert any(c[2] == "stop" for c in sync)


def test_aborting_a_request_in_flight(llama_path):
    """An abort between two overlapped steps ends the request at once; the step already
    planned for it runs and is dropped; every block returns."""
    from corellm.request import EngineCoreRequest

    cfg = engine_config(llama_path, scheduler={"async_scheduling": True})
    with LLM(cfg) as llm:
        engine = llm.engine
        for rid in ("a", "b"):
            engine.add_request(EngineCoreRequest(rid, list(range(10, 30)), GREEDY,
                                                 eos_token_id=0, arrival_time=0.0))
        got: dict[str, list[int]] = {"a": [], "b": []}
        finish = {}
        for _ in range(4):
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        assert engine._in_flight is not None
        (out,) = engine.abort_requests(["a"])
        assert out.finish_reason == "abort"
        while engine.has_unfinished_requests():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    finish[o.request_id] = o.finish_reason
        assert "a" not in finish and finish["b"] == "length" and len(got["b"]) == 24
        assert_pool_whole(llm)


def test_constrained_requests_run_synchronously(llama_path):
    """A request a logits processor constrains (here: a regex) holds the engine to one step at a
    time while it runs; the outputs are the synchronous loop's, and overlap resumes after."""
    cfg = engine_config(llama_path)
    prompts = _prompts(4, shared=0)
    regex = SamplingParams(max_tokens=12, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{3,30}"))

    def run(llm):
        outs = llm.generate(prompts, [regex, GREEDY, GREEDY, GREEDY], use_tqdm=False)
        assert not llm.engine._constrained              # forgotten once it finished
        return _completions(outs) + _completions(llm.generate(prompts, GREEDY,
                                                              use_tqdm=False))

    sync, over, overlapped = _both(cfg, run)
    assert over == sync and overlapped > 5


def test_tensor_parallel_under_overlap(make_checkpoint):
    """TP=2 (the multiproc executor): ranks > 0 get step N's tokens before step N+1's plan."""
    path = make_checkpoint("llama")
    cfg = engine_config(path, kv_cache={"num_blocks": 40},
                        scheduler={"max_num_batched_tokens": 64, "max_num_seqs": 8},
                        parallel={"tensor_parallel_size": 2})
    prompts = _prompts(8)
    sync, over, overlapped = _both(cfg, lambda llm: _completions(llm.generate(
        prompts, GREEDY, use_tqdm=False)))
    assert over == sync and overlapped > 5


def test_a_scheduler_for_the_synchronous_loop_runs_synchronously(llama_path, caplog):
    """A scheduler that does not set ``supports_async_scheduling`` keeps working: steps run one
    at a time, and the log says why."""
    from corellm import hookimpl
    from corellm.components import SchedulerSpec
    from corellm.interfaces import SchedulingPolicy
    from corellm.scheduling import BatchScheduler
    from corellm.specs import SchedulerOptions

    class OldScheduler(BatchScheduler):
        supports_async_scheduling = False

    class FirstCome(SchedulingPolicy):
        def waiting_key(self, request, ctx):
            return request.arrival_seq

        def choose_victim(self, running, ctx):
            return running[-1]

    class Plugin:
        @staticmethod
        @hookimpl
        def corellm_schedulers():
            yield SchedulerSpec(name="old", options=SchedulerOptions,
                                factory=lambda o, ctx: OldScheduler(o, ctx.kv_cache_manager,
                                                                    FirstCome()))

    cfg = engine_config(llama_path, scheduler={"name": "old", "async_scheduling": True})
    with caplog.at_level(logging.WARNING, logger="corellm.engine.core"):
        with LLM(cfg, plugins=[Plugin]) as llm:
            assert llm.engine.async_scheduling is False
            outs = llm.generate(_prompts(3), GREEDY, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert "written for the synchronous loop" in caplog.text


def test_a_failed_step_in_flight_leaves_no_block_in_the_prefix_cache(llama_path):
    """Blocks are registered once the step that computed them has been updated, not when the
    next one is planned: a step that fails while the next is in flight leaves the blocks it
    did not write out of the prefix cache."""
    from corellm.request import EngineCoreRequest

    cfg = engine_config(llama_path, scheduler={"async_scheduling": True,
                                               "max_num_batched_tokens": 32})
    with LLM(cfg) as llm:
        engine = llm.engine
        worker = engine.executor.worker
        execute, calls = worker.execute_model, []

        def failing(plan):
            calls.append(plan)
            if len(calls) == 2:                 # the second chunk of the prompt
                raise RuntimeError("injected")
            return execute(plan)

        worker.execute_model = failing
        engine.add_request(EngineCoreRequest("a", list(range(10, 90)), GREEDY,
                                             eos_token_id=0, arrival_time=0.0))
        with pytest.raises(RuntimeError, match="injected"):
            while engine.has_unfinished_requests():
                engine.step()
        worker.execute_model = execute
        # The first chunk (32 tokens, two 16-token blocks) ran; the second did not.
        assert engine.kv_cache_manager.num_cached_blocks == 2
        assert not engine.has_unfinished_requests()
        assert_pool_whole(llm)


def test_an_id_reused_while_its_step_is_in_flight(llama_path):
    """A request aborted between two overlapped steps and sent again under the same id gets
    none of the old one's tokens: its output is a fresh run's."""
    from corellm.request import EngineCoreRequest

    def request(prompt):
        return EngineCoreRequest("a", prompt, GREEDY, eos_token_id=0, arrival_time=0.0)

    def run_to_end(engine) -> list[int]:
        got = []
        while engine.has_unfinished_requests():
            got += [t for o in engine.step() for t in o.new_token_ids]
        return got

    cfg = engine_config(llama_path, scheduler={"async_scheduling": True})
    with LLM(cfg) as llm:
        engine = llm.engine
        engine.add_request(request(list(range(10, 30))))
        for _ in range(3):
            engine.step()
        assert engine._in_flight is not None
        engine.abort_requests(["a"])
        engine.add_request(request(list(range(200, 240))))
        second = run_to_end(engine)
        engine.add_request(request(list(range(200, 240))))
        fresh = run_to_end(engine)
        assert second == fresh and len(fresh) == 24
        assert_pool_whole(llm)
