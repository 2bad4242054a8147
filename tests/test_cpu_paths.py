"""The CPU fast paths change speed, not results: checked against the plain paths."""

from __future__ import annotations

import random

import pytest

from corellm import LLM, SamplingParams
from corellm_plugins.attn_torch_sdpa.backend import _decode_groups as groups_of
from tests.conftest import engine_config

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_packed_weights_give_the_same_tokens(llama_path):
    prompts = [{"prompt_token_ids": list(range(4, 4 + n))} for n in (1, 9, 33, 120)]
    packed = LLM(engine_config(llama_path))
    plain = LLM(engine_config(llama_path, model={"cpu_weight_packing": False}))
    linears = [m for m in packed.engine.executor.worker.runner.model.modules()
               if hasattr(m, "packed_weight")]
    from corellm.worker.cpu import _mkl_packing_available
    assert bool(linears) == _mkl_packing_available()
    assert not any(hasattr(m, "packed_weight")
                   for m in plain.engine.executor.worker.runner.model.modules())
    a = [o.outputs[0].token_ids for o in packed.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b


@pytest.mark.parametrize("seed", range(5))
def test_decode_groups_partition_and_reduce_padding(seed):
    rng = random.Random(seed)
    lens = sorted(rng.randint(1, 600) for _ in range(rng.randint(1, 64)))
    groups = groups_of(lens, 16)
    # contiguous, in order, covering every row exactly once
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    padded = sum((e - s) * -(-lens[e - 1] // 16) for s, e in groups)
    one_group = len(lens) * -(-lens[-1] // 16)
    assert padded <= one_group


def test_uniform_lengths_stay_one_group():
    assert groups_of([100] * 64, 16) == [(0, 64)]
    assert groups_of([], 16) == []


def test_malloc_tuning_is_opt_in(monkeypatch):
    from corellm.worker.cpu import tune_malloc
    monkeypatch.delenv("CORELLM_MALLOC_TUNING", raising=False)
    assert tune_malloc() is False                  # a library leaves the host process alone
    monkeypatch.setenv("CORELLM_MALLOC_TUNING", "0")
    assert tune_malloc() is False
    monkeypatch.setenv("CORELLM_MALLOC_TUNING", "1")
    import sys
    assert tune_malloc() is sys.platform.startswith("linux")
