"""Presence, frequency and repetition penalties, end to end through the engine.

The reference for the repetition penalty is Hugging Face transformers' own
``generate(..., repetition_penalty=...)`` on the same random-weight checkpoint; for the presence
and frequency penalties (which transformers lacks) it is ``generate`` with a small logits
processor written here from vLLM's definition. Both are compared token for token with
``tests.test_hf_equivalence.compare`` (a divergence is accepted only at a near tie of the
reference's penalized scores).
"""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from corellm import LLM, SamplingParams
from tests.conftest import assert_pool_whole, engine_config
from tests.test_hf_equivalence import MAX_MODEL_LEN, compare, make_prompts

NEW_TOKENS = 32
SETTINGS = {
    "default": {},
    "chunked_prefill": {"scheduler": {"max_num_batched_tokens": 48}},
    # too few blocks: requests are preempted, and their penalty state is rebuilt on resumption
    "preemption": {"kv_cache": {"num_blocks": 23}},
}


@pytest.fixture(scope="module")
def hf_model(llama_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


def hf_generate(model, prompts, repetition_penalty=1.0, presence=0.0, frequency=0.0):
    """Per prompt: (greedy tokens, penalized scores per step) from transformers."""
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    class OutputPenalties(LogitsProcessor):
        """vLLM's presence/frequency penalties: over the generated tokens only."""

        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            out = input_ids[:, self.prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(
                1, out, torch.ones(out.shape, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               repetition_penalty=repetition_penalty)
    results = []
    with torch.no_grad():
        for ids in prompts:
            extra = LogitsProcessorList([OutputPenalties(len(ids))]) if presence or frequency \
                else None
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), generation_config=gen_cfg,
                                 logits_processor=extra, return_dict_in_generate=True,
                                 output_scores=True)
            tokens = out.sequences[0, len(ids):].tolist()
            assert len(tokens) == NEW_TOKENS
            results.append((tokens, [s[0].float() for s in out.scores]))
    return results


def run_engine(path, prompts, params, **sections):
    cfg = engine_config(path, **sections)
    cfg["model"]["max_model_len"] = MAX_MODEL_LEN
    llm = LLM(cfg)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_whole(llm)
    return llm, [o.outputs[0].token_ids for o in outputs]


def check_against(reference, ours, label):
    notes = []
    for i, (tokens, (hf_tokens, hf_scores)) in enumerate(zip(ours, reference)):
        note = compare(tokens, hf_tokens, hf_scores)
        if note:
            notes.append(f"prompt {i}: {note}")
    if notes:
        warnings.warn(f"{label}: accepted near ties: {notes}")
    assert len(notes) <= 1, f"too many divergences for near ties to explain: {notes}"


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_transformers(hf_model, llama_path, penalty, setting):
    prompts = make_prompts(hf_model.config.vocab_size)
    reference = hf_generate(hf_model, prompts, repetition_penalty=penalty)
    plain = hf_generate(hf_model, prompts[:3])
    # the penalty changes transformers' own choices here, so the comparison is not vacuous
    assert [t for t, _ in reference[:3]] != [t for t, _ in plain]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            repetition_penalty=penalty)
    llm, ours = run_engine(llama_path, prompts, params, **SETTINGS[setting])
    check_against(reference, ours, f"repetition_penalty={penalty}/{setting}")
    assert (llm.get_stats().num_preemptions > 0) == (setting == "preemption")


@pytest.mark.parametrize("presence,frequency,repetition", [
    (1.0, 0.0, 1.0), (0.0, 0.7, 1.0), (-0.5, 0.3, 1.0), (0.5, 0.5, 1.2)])
def test_presence_frequency_match_reference(hf_model, llama_path, presence, frequency,
                                            repetition):
    prompts = make_prompts(hf_model.config.vocab_size)
    reference = hf_generate(hf_model, prompts, repetition, presence, frequency)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition)
    _, ours = run_engine(llama_path, prompts, params, **SETTINGS["chunked_prefill"])
    check_against(reference, ours, f"presence={presence} frequency={frequency}")


def test_frequency_and_presence_penalties_stop_repeats(llama_path):
    prompts = make_prompts(1024)
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    _, plain = run_engine(llama_path, prompts, SamplingParams(**greedy))
    repeats = [max(Counter(t).values()) for t in plain]
    assert max(repeats) >= 3, "the unpenalized greedy outputs should repeat tokens"
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        _, penalized = run_engine(llama_path, prompts, SamplingParams(**greedy, **kw))
        assert penalized != plain, kw
        for tokens, before in zip(penalized, repeats):
            assert max(Counter(tokens).values()) <= before, kw
        assert sum(len(set(t)) for t in penalized) > sum(len(set(t)) for t in plain), kw
    # a negative presence penalty favours repeats instead
    _, favoured = run_engine(llama_path, prompts,
                             SamplingParams(**greedy, presence_penalty=-2.0))
    assert sum(len(set(t)) for t in favoured) < sum(len(set(t)) for t in plain)


def test_penalized_and_plain_requests_in_one_batch(llama_path):
    prompts = make_prompts(1024)
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    penalties = [SamplingParams(**greedy, frequency_penalty=1.5),
                 SamplingParams(**greedy, repetition_penalty=1.3),
                 SamplingParams(**greedy, presence_penalty=1.0, repetition_penalty=0.8)]
    plain = SamplingParams(**greedy)
    # even prompts plain, odd prompts penalized (cycling through the kinds)
    mixed = [plain if i % 2 == 0 else penalties[i // 2 % 3] for i in range(len(prompts))]
    _, together = run_engine(llama_path, prompts, mixed)
    _, alone_plain = run_engine(llama_path, prompts[::2], plain)
    assert together[::2] == alone_plain
    for i in range(1, len(prompts), 2):
        _, alone = run_engine(llama_path, [prompts[i]], mixed[i])
        assert together[i] == alone[0], i
    _, all_plain = run_engine(llama_path, prompts[1::2], plain)
    assert together[1::2] != all_plain


def test_penalties_with_sampling_and_logprobs(llama_path):
    """Seeded sampling with penalties is reproducible, and logprobs stay the model's own."""
    prompts = make_prompts(1024)[:4]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True,
                            frequency_penalty=1.0, repetition_penalty=1.2, logprobs=2)
    cfg = engine_config(llama_path)
    llm = LLM(cfg)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    # greedy with logprobs: the reported top logprob is the unpenalized model's favourite,
    # even at a step where the penalty makes another token win
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=1, frequency_penalty=2.0)
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy, plain] * 2,
                        use_tqdm=False)
    differed = 0
    for o in outs[::2]:
        c = o.outputs[0]
        for token, lp in zip(c.token_ids, c.logprobs):
            best = max(lp.values(), key=lambda x: x.logprob)
            assert best.rank == 1
            if best is not lp[token]:
                differed += 1
                assert lp[token].rank > 1 and lp[token].logprob < best.logprob
    assert differed > 0
    assert_pool_whole(llm)
