"""The example attention backend, examples/corellm-naive-attention, registered in-process.

It is checked at two levels. Directly, through the ``AttentionBackend`` interface with metadata
built by hand: two steps over a shared KV cache, against dense causal attention. Through the
engine: greedy outputs equal transformers' and the built-in ``torch_sdpa`` backend's, token for
token, with whole prefills, chunked prefills, preemption and prefix-cache hits.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_pool_whole, engine_config
from tests.test_hf_equivalence import compare, hf_greedy, make_prompts

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "corellm-naive-attention"
EXAMPLE_MODULE = "corellm_naive_attn"
EXAMPLE_ENTRY_POINT = "attn_naive"         # [project.entry-points.corellm] in its pyproject.toml
NAIVE = "naive"

NUM_PROMPTS = 6                            # make_prompts' first six: 1, 5, 16, 17, 64, 131 tokens
NEW_TOKENS = 12
MAX_MODEL_LEN = 160
SETTINGS = {
    "default": {},
    # 24-token budget: the 64- and 131-token prompts are prefilled in chunks, next to decodes.
    "chunked_prefill": {"scheduler": {"max_num_batched_tokens": 24}},
    # 10 blocks x 16 = 160 slots for 21 blocks' worth of requests: some are preempted.
    "preemption": {"kv_cache": {"num_blocks": 10}},
    # An earlier request computes the first half of every prompt; the prompts start from it.
    "prefix_cached": {"scheduler": {"max_num_batched_tokens": 40}},
}


@pytest.fixture
def naive_module(monkeypatch):
    """The example's plugin module, imported from the source tree, not installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    names = [EXAMPLE_MODULE, f"{EXAMPLE_MODULE}.backend"]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    module = importlib.import_module(EXAMPLE_MODULE)
    assert Path(module.__file__).resolve().is_relative_to(EXAMPLE)
    yield module
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def _config(path, **sections) -> dict:
    # Disable the entry point in case the example is also installed in this environment.
    cfg = engine_config(path, plugins={"disable": [EXAMPLE_ENTRY_POINT]}, **sections)
    cfg["model"]["max_model_len"] = MAX_MODEL_LEN
    return cfg


@pytest.fixture(scope="module")
def reference(make_checkpoint):
    """(checkpoint path, prompts, per prompt (transformers' greedy tokens, logits per step))."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = make_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)[:NUM_PROMPTS]
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
    return path, prompts, hf_greedy(model, prompts, gen_cfg)


def _generate(path, prompts, setting: str, attention: str, plugins=()):
    """Greedy completions of ``prompts`` under ``SETTINGS[setting]`` with the named backend, the
    backend's class and the shape of a layer's KV cache. Checks the run's preemptions,
    prefix-cache hits and KV pool on the way."""
    from corellm import LLM, SamplingParams

    cfg = _config(path, attention={"name": attention}, **SETTINGS[setting])
    with LLM(cfg, plugins=list(plugins)) as llm:
        if setting == "prefix_cached":
            llm.generate([{"prompt_token_ids": p[:len(p) // 2 + 1]} for p in prompts],
                         SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                              ignore_eos=True), use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert (llm.get_stats().num_preemptions > 0) == (setting == "preemption")
        if setting == "prefix_cached":
            assert [o.num_cached_tokens for o in outputs] == [
                (len(p) // 2 + 1) // 16 * 16 for p in prompts]
            assert sum(o.num_cached_tokens for o in outputs) > 0
        assert_pool_whole(llm)
        runner = llm.engine.executor.worker.runner
        return ([o.outputs[0].token_ids for o in outputs], type(runner.attn_backend),
                tuple(runner.kv_caches[0].shape))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(naive_module, reference, setting):
    path, prompts, results = reference
    tokens, backend, kv_shape = _generate(path, prompts, setting, NAIVE, plugins=[naive_module])
    assert backend is naive_module.backend.NaiveAttentionBackend
    # The runner allocated the backend's own layout: [blocks, K|V, slot, kv head, head dim].
    assert kv_shape[1:] == (2, 16, 2, 16)
    notes = [note for ours, (theirs, logits) in zip(tokens, results)
             if (note := compare(ours, theirs, logits))]
    if notes:
        warnings.warn(f"{setting}: accepted near ties: {notes}", stacklevel=1)
    assert len(notes) <= 1, f"too many divergences for near ties to explain: {notes}"


@pytest.mark.parametrize("setting", ["default", "chunked_prefill"])
def test_greedy_matches_torch_sdpa(naive_module, reference, setting):
    path, prompts, _ = reference
    ours, *_ = _generate(path, prompts, setting, NAIVE, plugins=[naive_module])
    theirs, *_ = _generate(path, prompts, setting, "torch_sdpa")
    assert ours == theirs


# --------------------------------------------------------------------------- the interface alone
def _metadata(reqs: list[tuple[int, int]], block_ids: list[list[int]], block_size: int):
    """The step's metadata for requests given as (context_len, new tokens), decodes first, as
    the model runner computes the common facts and the core's default builder turns them into
    the backend's ``AttentionMetadata``."""
    import numpy as np

    from corellm.attention import (AttentionBuildLimits, CommonAttentionMetadata,
                                   CommonMetadataBuilder)

    ctx = [c for c, _ in reqs]
    seq = [c + n for c, n in reqs]
    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    table = np.zeros((len(reqs), max(map(len, block_ids))), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = ids
    slots = [block_ids[i][p // block_size] * block_size + p % block_size
             for i, (c, s) in enumerate(zip(ctx, seq)) for p in range(c, s)]
    num_decodes = sum(n == 1 for _, n in reqs)
    assert all(n == 1 for _, n in reqs[:num_decodes]), "decodes come first"
    common = CommonAttentionMetadata(
        num_reqs=len(reqs), num_decodes=num_decodes, num_actual_tokens=qsl[-1],
        query_start_loc=np.array(qsl), seq_lens=np.array(seq), context_lens=np.array(ctx),
        block_table=table, slot_mapping=np.array(slots, dtype=np.int64), max_seq_len=max(seq),
        max_query_len=max(n for _, n in reqs), block_size=block_size)
    limits = AttentionBuildLimits(block_size=block_size, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_model_len=64,
                                  device=torch.device("cpu"))
    return CommonMetadataBuilder(limits).build(common)


@pytest.mark.parametrize("dtype,compute_dtype", [(torch.float32, "float32"),
                                                 (torch.bfloat16, "float32"),
                                                 (torch.bfloat16, "model")])
def test_backend_matches_dense_causal_attention(naive_module, dtype, compute_dtype):
    """Step 1 prefills three contexts; step 2 decodes two of them, continues the third with a
    3-token chunk, and prefills a fourth request. Both steps' outputs equal dense causal GQA
    attention over each request's whole sequence, with a non-default scale."""
    import torch.nn.functional as F
    from corellm_naive_attn.backend import NaiveAttentionBackend

    from corellm.interfaces import AttentionLayerSpec

    H, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 16
    layer = AttentionLayerSpec(layer_idx=0, num_heads=H, num_kv_heads=HKV, head_size=D, scale=0.3)
    backend = NaiveAttentionBackend(compute_dtype)
    kv_cache = torch.zeros(backend.kv_cache_spec(layer, NUM_BLOCKS, BS, dtype).shape, dtype=dtype)

    gen = torch.Generator().manual_seed(0)
    seq_lens = [6, 10, 7, 6]                     # final lengths of requests 0..3
    q, k, v = ([torch.randn(n, h, D, generator=gen).to(dtype) for n in seq_lens]
               for h in (H, HKV, HKV))
    # Scattered, non-contiguous blocks, enough for each request's final length.
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    blocks = [perm[0:2], perm[2:5], perm[5:7], perm[7:9]]

    def expected(r: int) -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q[r].float().transpose(0, 1), k[r].float().transpose(0, 1),
            v[r].float().transpose(0, 1), is_causal=True, scale=layer.scale, enable_gqa=True)
        return o.transpose(0, 1)                 # [seq, H, D]

    def step(plan: list[tuple[int, int, int]]) -> None:
        """plan: (request, context_len, new tokens), in the runner's order."""
        md = _metadata([(c, n) for _, c, n in plan], [blocks[r] for r, _, _ in plan], BS)
        cat = [torch.cat([t[r][c:c + n] for r, c, n in plan]) for t in (q, k, v)]
        out = backend.forward(layer, *cat, kv_cache, md)
        assert out.shape == cat[0].shape and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for (r, c, n), start in zip(plan, md.query_start_loc_list):
            torch.testing.assert_close(out[start:start + n].float(), expected(r)[c:c + n],
                                       atol=tol, rtol=tol)

    step([(0, 0, 5), (1, 0, 9), (2, 0, 4)])
    step([(0, 5, 1), (1, 9, 1), (2, 4, 3), (3, 0, 6)])


# --------------------------------------------------------------------------- options and docs
def test_option_typo_and_bad_value_are_config_errors(naive_module):
    from corellm.config.compose import load_config
    from corellm.errors import ConfigError
    from corellm.plugins.discovery import load_registry

    registry = load_registry(disable=[EXAMPLE_ENTRY_POINT], plugins=[naive_module])
    config = load_config(EXAMPLE / "config.yaml", registry=registry)
    assert (config.attention.name, config.attention.compute_dtype) == (NAIVE, "float32")

    with pytest.raises(ConfigError) as err:
        load_config({"attention": {"name": NAIVE, "compute_dtyp": "model"}}, registry=registry)
    assert err.value.problems[0][0] == "attention.compute_dtyp"
    assert "did you mean compute_dtype?" in str(err.value)

    with pytest.raises(ConfigError) as err:
        load_config({"attention": {"name": NAIVE, "compute_dtype": "float16"}}, registry=registry)
    assert "attention.compute_dtype" in str(err.value) and "float16" in str(err.value)


def test_entry_module_does_not_import_torch(naive_module):
    """Discovery imports the entry module for every run; torch waits for the factory."""
    code = (f"import sys, {EXAMPLE_MODULE}; "
            "print(sorted({'torch', 'numpy', 'transformers'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(EXAMPLE)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    with pytest.raises(ValueError, match="'float16'"):
        importlib.import_module(f"{EXAMPLE_MODULE}.backend").NaiveAttentionBackend("float16")
