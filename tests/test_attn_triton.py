"""The ``triton`` attention backend, on the CPU under Triton's interpreter (TRITON_INTERPRET=1).

Two levels. The kernels, through the backend's own metadata builder, against attention computed
here in float64 from the paged cache with explicit masks: block sizes 4..32, GQA ratios 1..8
(one KV head included, and a group of 3 that pads), head sizes 64 and 128, fp32/fp16/bf16, a
batch mixing decodes, a whole prefill, a chunk after cached context and lengths that cross
block boundaries; sliding windows, logit soft-capping and the split-KV decode path. Outputs
are poisoned (NaN) first so an element no program writes fails, and so is the cache, so a read
of an unwritten slot fails too. Then the engine: greedy generation with ``attention.name:
triton`` equals ``torch_sdpa`` token for token on tiny Llama and Qwen3 checkpoints with chunked
prefill and prefix caching, and a sliding-window Mistral equals transformers on prompts longer
than its window. Shapes are small: the interpreter runs the kernels in numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Before triton is first imported, which caches it; and on the knob too, should anything have
# imported triton earlier. The kernels are defined (interpreted) at their module's first import.
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton",
                             reason="the triton backend's kernels need the 'triton' package")
if hasattr(triton, "knobs"):
    triton.knobs.runtime.interpret = True

from corellm.attention import AttentionBuildLimits  # noqa: E402
from corellm.errors import ConfigError  # noqa: E402
from corellm.interfaces import AttentionLayerSpec  # noqa: E402
from tests.attn_reference import common_metadata, paged_cache  # noqa: E402
from tests.attn_reference import reference_attention as _reference  # noqa: E402
from tests.conftest import assert_pool_whole, engine_config  # noqa: E402
from tests.test_hf_equivalence import compare, hf_greedy, make_prompts  # noqa: E402

CPU = torch.device("cpu")
NUM_BLOCKS = 40


def _backend(**options):
    from corellm_plugins.attn_triton import TritonAttentionOptions
    from corellm_plugins.attn_triton.backend import TritonAttentionBackend
    return TritonAttentionBackend(TritonAttentionOptions(**options))


def _step(backend, layer, reqs, bs, dtype, seed=0):
    """One step of ``reqs`` ((context length, new tokens), decodes first) over a poisoned cache
    whose context slots hold random K/V: returns (output, reference, metadata, cache, the new
    K/V and their slots)."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = layer.num_kv_heads, layer.head_size
    spec = backend.kv_cache_spec(layer, NUM_BLOCKS, bs, dtype)
    assert not spec.zero_init
    cache, tables = paged_cache(spec.shape, spec.dtype, reqs, bs, gen)
    t = sum(n for _, n in reqs)
    q = torch.randn(t, layer.num_heads, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    common = common_metadata(reqs, tables, bs)
    slots = common.slot_mapping
    builder = backend.make_metadata_builder(AttentionBuildLimits(
        block_size=bs, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, device=CPU))
    md = builder.build(common)
    backend.kernels.write_kv(k, v, cache, md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    backend.attend(layer, q, cache, md, out)
    return out, _reference(layer, q, cache, reqs, tables, bs), md, cache, (k, v, slots)


def _tolerance(dtype):
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


# Decodes (a one-token prompt, a 20-token context), a whole 19-token prefill, a 7-token chunk
# after 33 cached tokens, and a 5-token chunk starting exactly on a block boundary.
MIXED = [(0, 1), (20, 1), (0, 19), (33, 7), (32, 5)]


@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,dtype", [
    (4, 2, 64, 16, torch.float32),
    (8, 1, 128, 16, torch.float32),      # one KV head for eight query heads
    (4, 4, 64, 4, torch.float16),        # no grouping, 4-token blocks
    (6, 2, 64, 32, torch.bfloat16),      # a group of 3 (padded to 4 rows)
    (4, 2, 128, 8, torch.bfloat16),
])
def test_kernels_match_float64_reference(heads, kv_heads, head_size, block_size, dtype):
    backend = _backend()
    layer = AttentionLayerSpec(0, heads, kv_heads, head_size, scale=0.7 * head_size ** -0.5)
    assert backend.supports(layer, dtype, CPU) is None
    out, ref, md, cache, (k, v, slots) = _step(backend, layer, MIXED, block_size, dtype)
    assert md.num_splits == 1
    assert not out.isnan().any(), "an output element was never written"
    tol = _tolerance(dtype)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # write_kv put each new token's K and V at its slot, in the cache's dtype.
    flat = cache.flatten(1, 2)                                   # [2, slots, Hkv, D]
    torch.testing.assert_close(flat[0, torch.from_numpy(slots)], k, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, torch.from_numpy(slots)], v, atol=0, rtol=0)


@pytest.mark.parametrize("options", [{"block_m": 16, "block_n": 16}, {"block_m": 128,
                                                                      "block_n": 64}])
def test_kernel_tile_sizes(options):
    backend = _backend(**options)
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    out, ref, *_ = _step(backend, layer, MIXED, 16, torch.float32, seed=1)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,soft_cap,dtype", [(8, None, torch.float32),
                                                   (None, 2.0, torch.float32),
                                                   (13, 5.0, torch.float32),
                                                   (13, 5.0, torch.float16)])
def test_sliding_window_and_soft_cap(window, soft_cap, dtype):
    backend = _backend()
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125, sliding_window=window,
                               logit_soft_cap=soft_cap)
    assert backend.supports(layer, dtype, CPU) is None
    out, ref, *_ = _step(backend, layer, MIXED, 16, dtype, seed=2)
    tol = _tolerance(dtype)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,dtype", [(None, torch.float32), (24, torch.float32),
                                          (None, torch.float16)])
def test_split_kv_decode_path(window, dtype):
    """Few decodes with long contexts take the split-KV path (partial results merged by a
    second kernel); a prefill in the same step takes the unified kernel."""
    backend = _backend(split_kv_min_len=32, block_n=16, max_kv_splits=4)
    layer = AttentionLayerSpec(0, 8, 2, 64, scale=0.125, sliding_window=window)
    reqs = [(100, 1), (61, 1), (3, 1), (0, 9)]
    out, ref, md, *_ = _step(backend, layer, reqs, 16, dtype, seed=3)
    assert md.num_splits == 4
    assert not out.isnan().any()
    tol = _tolerance(dtype)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_unsupported_layers_are_named():
    backend = _backend()
    base = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    odd = AttentionLayerSpec(0, 4, 2, 80, scale=0.125)
    assert backend.supports(odd, torch.float32, CPU) == (
        "head_size 80 is not supported (supported: 16, 32, 64, 128, 256)")
    assert "dtype float64 is not supported" in backend.supports(base, torch.float64, CPU)
    assert "on the CPU under TRITON_INTERPRET=1" in backend.supports(base, torch.float32,
                                                                    torch.device("meta"))


def test_cpu_needs_the_interpreter(monkeypatch):
    from corellm_plugins.attn_triton.backend import device_problem
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "Triton kernels run on CUDA devices" in device_problem(CPU)
    assert device_problem(torch.device("cuda", 0)) is None


# --------------------------------------------------------------------------- config and start-up
def test_kernel_options_validated(llama_path):
    from corellm import LLM
    with pytest.raises(ConfigError) as err:
        LLM(engine_config(llama_path, attention={"name": "triton", "block_m": 48,
                                                 "num_warps": 3, "blok_n": 32}))
    text = str(err.value)
    assert "attention.block_m: must be a power of two in 16..256 (got 48)" in text
    assert "attention.num_warps: must be a power of two in 1..16 (got 3)" in text
    assert "attention.blok_n: unknown option; did you mean block_n?" in text


def test_odd_head_size_refused_at_start_up(make_checkpoint):
    from corellm import LLM
    path = make_checkpoint("llama", head_dim=24)                  # 4 heads of 24
    with pytest.raises(ConfigError, match=r"attention.name: 'triton' \(plugin 'attn_triton' .*"
                       r"cannot run layer 0 of .* in float32 on cpu: head_size 24 is not "
                       r"supported \(supported: 16, 32, 64, 128, 256\)"):
        LLM(engine_config(path, attention={"name": "triton"}))


def test_auto_picks_by_device(llama_path, caplog):
    from corellm import LLM
    from corellm.config.compose import load_config
    from corellm.plugins.discovery import load_registry
    from corellm.config.setup import attention_candidates
    from corellm_plugins.attn_torch_sdpa.backend import TorchSDPABackend

    config = load_config(engine_config(llama_path))
    assert config.attention.name == "auto"
    registry = load_registry()
    # On a CUDA platform auto tries Triton first, then torch SDPA.
    assert attention_candidates(config, registry, "cuda") == (["triton", "torch_sdpa"], [])
    # On the CPU, even under the interpreter, auto takes torch SDPA and says why.
    with caplog.at_level("INFO", logger="corellm.worker.model_runner"):
        with LLM(engine_config(llama_path)) as llm:
            assert isinstance(llm.engine.executor.worker.runner.attn_backend, TorchSDPABackend)
    assert ("attention.name: auto -> torch_sdpa on cpu (not triton: auto picks it only on "
            "cuda)") in caplog.text


def test_missing_triton_is_listed_and_refused(tmp_path, llama_path):
    """Without the package, `corellm plugins` lists the backend as unavailable with the reason,
    and selecting it is a config error naming the plugin, its distribution and the reason."""
    import yaml
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(engine_config(llama_path, attention={"name": "triton"})))
    hide = "import sys; sys.modules['triton'] = None; from corellm.cli.commands import main; "
    listing = subprocess.run([sys.executable, "-c", hide + "sys.exit(main(['plugins']))"],
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert ("UNAVAILABLE: needs the optional dependency 'triton' (pip install "
            "'corellm[triton]'") in listing.stdout
    check = subprocess.run([sys.executable, "-c",
                            hide + f"sys.exit(main(['config', 'validate', {str(cfg)!r}]))"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode != 0
    assert ("attention.name: attention 'triton' (plugin 'attn_triton' (entry point attn_triton "
            "= corellm_plugins.attn_triton, from corellm") in check.stderr
    assert "is unavailable: needs the optional dependency 'triton'" in check.stderr


# --------------------------------------------------------------------------- end to end
NEW_TOKENS = 10


def _greedy(path, prompts, attention, prefix_rounds=True, **sections):
    from corellm import LLM, SamplingParams
    cfg = engine_config(path, attention={"name": attention}, **sections)
    cfg["model"]["max_model_len"] = 160
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(cfg) as llm:
        backend = type(llm.engine.executor.worker.runner.attn_backend).__name__
        if prefix_rounds:   # the prompts' first halves first: the second round hits the cache
            llm.generate([{"prompt_token_ids": p[:len(p) // 2 + 1]} for p in prompts],
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        cached = sum(o.num_cached_tokens for o in outs)
        assert_pool_whole(llm)
    return [o.outputs[0].token_ids for o in outs], cached, backend


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_equals_torch_sdpa_end_to_end(make_checkpoint, arch):
    """Chunked prefill (a 24-token budget beside decodes) and prefix-cache hits."""
    path = make_checkpoint(arch)
    prompts = make_prompts(1000)[:6]                      # 1, 5, 16, 17, 64 and 131 tokens
    sched = {"max_num_batched_tokens": 24}
    ours, cached, name = _greedy(path, prompts, "triton", scheduler=sched)
    theirs, cached_sdpa, _ = _greedy(path, prompts, "torch_sdpa", scheduler=sched)
    assert name == "TritonAttentionBackend"
    assert cached > 0 and cached == cached_sdpa
    assert ours == theirs


@pytest.mark.slow
def test_sliding_window_matches_transformers(make_checkpoint):
    """A Mistral checkpoint with a 24-token window, served with max_model_len 160 (refused
    before backends declared windows): both backends equal transformers' greedy output on
    prompts up to 131 tokens, which differs from full attention's."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = make_checkpoint("mistral", sliding_window=24)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)[3:6]          # 17, 64 and 131 tokens
    gen_cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
    reference = hf_greedy(model, prompts, gen_cfg)
    full, *_ = _greedy(make_checkpoint("mistral"), prompts, "torch_sdpa", prefix_rounds=False)
    assert full != [t for t, _ in reference], "the window changes nothing: no test"
    sched = {"max_num_batched_tokens": 40}
    for attention in ("torch_sdpa", "triton"):
        ours, *_ = _greedy(path, prompts, attention, prefix_rounds=True, scheduler=sched)
        notes = [note for o, (t, logits) in zip(ours, reference) if (note := compare(o, t, logits))]
        assert not notes, (attention, notes)
