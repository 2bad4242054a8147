"""The torch_sdpa backend's native paths on the CPU (``paged_cpu.c``, built on first use by the
platform: ``Platform.native_library``, which the CPU platform implements with
``corellm_plugins.platform_cpu.native``): decode, and prefill on the CPU platform's GEMM tiles;
and the gather path the decode kernel replaces there (and that runs wherever no platform builds
the kernels).

The backend runs whole steps (decodes next to a prefill and a chunk after cached context)
against attention computed here in float64 from the paged cache. The cache is poisoned with NaN
everywhere no token was written, so a kernel that reads a slot past a sequence's end, or a block
it does not own, fails; outputs are poisoned too. Then the engine: native and gather decodes give
the same greedy tokens, and both equal transformers. Then the choices: ``decode: native`` where
it cannot run (no platform, a platform that builds no kernels, no compiler) is a ConfigError
naming ``attention.decode``; ``auto`` falls back to gather with the reason; a failed build names
the compiler and its message.
"""

from __future__ import annotations

import logging

import pytest
import torch

from corellm.attention import AttentionBuildLimits
from corellm.errors import ConfigError
from corellm.interfaces import AttentionLayerSpec
from corellm.platforms.interface import NativeUnavailable
from corellm_plugins.platform_cpu import CpuOptions
from corellm_plugins.platform_cpu.platform import CpuPlatform
from tests.attn_reference import common_metadata, paged_cache, reference_attention
from tests.conftest import assert_pool_whole, engine_config
from tests.cpu_threads import cpu_threads
from tests.test_hf_equivalence import compare, hf_greedy, make_prompts

CPU = torch.device("cpu")
NUM_BLOCKS = 48
PLATFORM = CpuPlatform(CpuOptions())          # builds the kernels with the host's compiler


def _backend(decode: str, dtype=torch.float32, prefill: str = "auto", platform=PLATFORM):
    from corellm_plugins.attn_torch_sdpa.backend import TorchSDPABackend
    return TorchSDPABackend(decode, CPU, dtype, prefill, platform)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of x's values (NaNs compared as bits, not as values)."""
    return x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()])


def _step(backend, layer, reqs, bs, dtype, seed=0, fill=float("nan"), num_blocks=NUM_BLOCKS,
          kv_dtype=None, strided_heads=False, edit=None):
    """One step of ``reqs`` ((context length, new tokens), decodes first) through
    ``backend.forward`` over a cache that is ``fill`` (NaN) wherever no token was written.
    The new K/V are views into one fused projection, as the model hands them, unless
    ``kv_dtype`` (K/V of another dtype than the cache's) or ``strided_heads`` (heads not
    contiguous within a token) ask for inputs the kernels do not write themselves. ``edit``:
    called with q, k and v (views of the projection) before the step, to plant values."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = layer.num_kv_heads, layer.head_size
    spec = backend.kv_cache_spec(layer, num_blocks, bs, dtype)
    cache, tables = paged_cache(spec.shape, spec.dtype, reqs, bs, gen, fill)
    t = sum(n for _, n in reqs)
    qkv = torch.randn(t, (layer.num_heads + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([layer.num_heads * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.reshape(t, -1, d), k.view(t, hkv, d), v.view(t, hkv, d)
    if edit is not None:
        edit(q, k, v)
    if kv_dtype is not None:
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    if strided_heads:                          # the same values, [T, D, Hkv] in memory
        k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    common = common_metadata(reqs, tables, bs, pad_blocks=1)
    slots = torch.from_numpy(common.slot_mapping)
    builder = backend.make_metadata_builder(AttentionBuildLimits(
        block_size=bs, max_num_seqs=max(8, len(reqs)), max_num_batched_tokens=max(64, t),
        max_model_len=1024, device=CPU))
    out = backend.forward(layer, q, k, v, cache, builder.build(common))
    ref = reference_attention(layer, q, cache, reqs, tables, bs)
    flat = cache.flatten(1, 2)                                     # [2, slots, Hkv, D]
    # the new K/V at their slots, bit for bit (the kernels copy rows of the cache's dtype)
    assert torch.equal(_bits(flat[0, slots]), _bits(k.to(cache.dtype)))
    assert torch.equal(_bits(flat[1, slots]), _bits(v.to(cache.dtype)))
    return out, ref


# Decodes (a one-token prompt, contexts inside one block, on a block boundary, across many
# blocks), then a whole 19-token prefill and a 7-token chunk after 33 cached tokens.
MIXED = [(0, 1), (5, 1), (15, 1), (16, 1), (70, 1), (0, 19), (33, 7)]
_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,dtype", [
    (4, 2, 64, 16, torch.float32),
    (8, 1, 128, 16, torch.float32),      # one KV head for eight query heads
    (6, 2, 64, 4, torch.float32),        # a group of 3, 4-token blocks
    (4, 4, 80, 8, torch.float32),        # a head size without an unrolled loop
    (3, 1, 96, 12, torch.float32),       # blocks of 12 tokens
    (4, 2, 36, 16, torch.float32),       # a head size not a multiple of 8 (no full vectors)
    (4, 2, 64, 16, torch.bfloat16),
    (6, 3, 128, 8, torch.bfloat16),
    (2, 2, 256, 5, torch.bfloat16),      # a large head, blocks of 5 tokens
    (4, 2, 36, 16, torch.bfloat16),
])
def test_native_decode_matches_float64_reference(heads, kv_heads, head_size, block_size, dtype):
    backend = _backend("native", dtype)
    assert backend.decode_path == "native"
    layer = AttentionLayerSpec(0, heads, kv_heads, head_size, scale=0.7 * head_size ** -0.5)
    out, ref = _step(backend, layer, MIXED, block_size, dtype)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=_TOL[dtype], rtol=_TOL[dtype])


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_with_fewer_requests_than_threads(threads, dtype):
    """Fewer decodes than threads split by KV head (one work item per request and KV head);
    as many or more take whole requests: the same results either way."""
    with cpu_threads(threads):
        layer = AttentionLayerSpec(0, 6, 3, 64, scale=0.125, sliding_window=40)
        for reqs in ([(70, 1)], [(70, 1), (33, 1), (0, 19)]):
            out, ref = _step(_backend("native", dtype), layer, reqs, 16, dtype, seed=threads)
            torch.testing.assert_close(out.double(), ref, atol=_TOL[dtype], rtol=_TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("reqs", [MIXED[:5], [(70, 1)], [(0, 1)]])
def test_decode_only_steps(threads, reqs):
    """Steps of decodes only (the kernel writes every new row itself; a lone one-token prompt;
    one sequence split by KV head across threads), a head size without an unrolled loop."""
    with cpu_threads(threads):
        layer = AttentionLayerSpec(0, 6, 3, 80, scale=0.1)
        out, ref = _step(_backend("native"), layer, reqs, 16, torch.float32, seed=threads)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("reqs,kind,prefill", [
    (MIXED, "strided_heads", "native"), (MIXED, "strided_heads", "sdpa"),
    (MIXED[:5], "strided_heads", "native"), (MIXED[5:], "strided_heads", "sdpa"),
    (MIXED, "other_dtype", "native"), (MIXED[:5], "other_dtype", "native"),
    (MIXED[5:], "other_dtype", "native"),
])
def test_native_decode_of_kv_the_kernels_do_not_write(reqs, kind, prefill):
    """K/V the kernels do not take (another dtype than the cache's, heads not contiguous within
    a token): every row is written first (torch's index_copy_) and the decode kernel only
    reads; the cache and the outputs are the same."""
    backend = _backend("native", torch.bfloat16, prefill)
    assert backend.decode_path == "native"
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125, sliding_window=20)
    kw = {"kv_dtype": torch.float32} if kind == "other_dtype" else {"strided_heads": True}
    out, ref = _step(backend, layer, reqs, 8, torch.bfloat16, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_a_decode_step_makes_no_separate_kv_write(monkeypatch):
    """The decode kernel writes its rows' K/V: a step of decodes calls no write, a mixed step
    writes its prefill rows only."""
    backend = _backend("native")
    written, real = [], backend._native._write
    monkeypatch.setattr(backend._native, "_write", lambda *a: written.append(a[8]) or real(*a))
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    _step(backend, layer, MIXED[:5], 16, torch.float32)
    assert written == []
    _step(backend, layer, MIXED, 16, torch.float32)
    assert written == [19 + 7]                        # the two prefills' rows


@pytest.mark.parametrize("reqs", [MIXED[:5], MIXED[5:]])
def test_a_slot_outside_the_cache_is_an_error_and_nothing_is_written(reqs):
    """A slot mapping past the cache (a KV manager's bug) raises, naming the slot, before the
    decode kernel or the KV write touches the cache."""
    backend = _backend("native")
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    spec = backend.kv_cache_spec(layer, NUM_BLOCKS, 16, torch.float32)
    cache, tables = paged_cache(spec.shape, spec.dtype, reqs, 16, torch.Generator(), 0.0)
    before = cache.clone()
    t = sum(n for _, n in reqs)
    q, k, v = torch.randn(t, 4, 64), torch.randn(t, 2, 64), torch.randn(t, 2, 64)
    common = common_metadata(reqs, tables, 16, pad_blocks=1)
    common.slot_mapping[-1] = NUM_BLOCKS * 16             # one past the last slot
    md = backend.make_metadata_builder(AttentionBuildLimits(
        block_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
        device=CPU)).build(common)
    with pytest.raises(IndexError, match=f"slot {NUM_BLOCKS * 16} of token {t - 1} is outside"):
        backend.forward(layer, q, k, v, cache, md)
    assert torch.equal(cache, before)


# Prefills: several row chunks (up to 192 rows each) and key panels, after cached context (a
# prefix-cache hit, a later chunk of a chunked prefill), a one-token prompt, next to decodes.
LONG = [(9, 1), (130, 1), (0, 131), (40, 70), (200, 61), (0, 1), (3, 2), (0, 450), (250, 400)]


@pytest.mark.parametrize("heads,kv_heads,head_size,block_size,dtype,window", [
    (4, 2, 64, 16, torch.float32, None),
    (8, 1, 128, 16, torch.float32, None),
    (6, 2, 64, 128, torch.float32, None),       # the CPU's default block size
    (4, 4, 80, 8, torch.float32, None),         # head size: 2.5 vectors of 32 (a partial panel)
    (4, 2, 36, 16, torch.float32, 50),          # and a window shorter than the prompts
    (3, 1, 96, 12, torch.float32, 1),           # each token sees itself only
    (4, 2, 64, 16, torch.bfloat16, None),
    (6, 3, 80, 16, torch.bfloat16, 64),
])
def test_native_prefill_matches_float64_reference(heads, kv_heads, head_size, block_size,
                                                  dtype, window):
    layer = AttentionLayerSpec(0, heads, kv_heads, head_size, scale=0.7 * head_size ** -0.5,
                               sliding_window=window)
    out, ref = _step(_backend("native", dtype), layer, LONG, block_size, dtype,
                     num_blocks=sum(-(-(c + n) // block_size) for c, n in LONG) + 1)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=_TOL[dtype], rtol=_TOL[dtype])


@pytest.mark.parametrize("decode,prefill,sdpa_calls", [
    ("native", "native", 0),        # one kernel call covers the step's prefills
    ("native", "sdpa", 2),          # one SDPA call per prefill
    ("gather", "native", 1),        # one SDPA call for the decode group
    ("gather", "sdpa", 3),
])
def test_prefill_and_decode_paths_are_chosen_apart(monkeypatch, decode, prefill, sdpa_calls):
    import torch.nn.functional as F
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    backend = _backend(decode, prefill=prefill)
    assert (backend.decode_path, backend.prefill_path) == (decode, prefill)
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125, sliding_window=12)
    out, ref = _step(backend, layer, [(5, 1), (0, 19), (33, 7)], 16, torch.float32,
                     fill=0.0 if decode == "gather" else float("nan"))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert len(calls) == sdpa_calls


@pytest.mark.parametrize("threads", [1, 3, 16])
def test_native_prefill_thread_counts(threads):
    """Work items (prefill, row chunk, KV head) go to threads dynamically, in smaller chunks
    while there are fewer items than threads (one KV head, one prompt, 16 threads): the result
    does not depend on how many."""
    with cpu_threads(threads):
        layer = AttentionLayerSpec(0, 6, 1, 64, scale=0.125)
        out, ref = _step(_backend("native"), layer, [(0, 131), (17, 3)], 16, torch.float32)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 8, 16, 100])
def test_native_decode_sliding_window(window):
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125, sliding_window=window)
    out, ref = _step(_backend("native"), layer, MIXED, 8, torch.float32, seed=window)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_gather_path_still_matches_reference():
    """The path every non-CPU device takes (and CPUs without a C compiler): zero-filled
    cache, since a gathered group pads short rows with slots nobody wrote."""
    backend = _backend("gather")
    assert backend.decode_path == "gather"
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    assert backend.kv_cache_spec(layer, 4, 16, torch.float32).zero_init
    assert not _backend("native").kv_cache_spec(layer, 4, 16, torch.float32).zero_init
    # the gather path reads padding slots (masked out): a zeroed cache, as zero_init asks
    out, ref = _step(backend, layer, [(5, 1), (70, 1), (33, 7)], 16, torch.float32, fill=0.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_native_refusals_name_the_key(caplog):
    from corellm_plugins.attn_torch_sdpa.backend import TorchSDPABackend
    with pytest.raises(ConfigError, match=r"attention\.decode.*CPU only"):
        TorchSDPABackend("native", torch.device("cuda"), torch.float32, "auto", PLATFORM)
    with pytest.raises(ConfigError, match=r"attention\.decode.*float32 or bfloat16"):
        TorchSDPABackend("native", CPU, torch.float16, "auto", PLATFORM)
    with pytest.raises(ConfigError, match=r"attention\.prefill.*CPU only"):
        TorchSDPABackend("gather", torch.device("cuda"), torch.float32, "native", PLATFORM)
    with caplog.at_level(logging.INFO):
        backend = TorchSDPABackend("auto", CPU, torch.float16, "auto", PLATFORM)
        assert (backend.decode_path, backend.prefill_path) == ("gather", "sdpa")
    assert "float32 or bfloat16" in caplog.text


def test_without_a_compiler_auto_gathers(monkeypatch, tmp_path, caplog):
    from corellm_plugins.platform_cpu import native
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))        # nothing cached to fall back on
    monkeypatch.setattr(native, "compiler", lambda: None)
    with caplog.at_level(logging.INFO):
        assert _backend("auto").decode_path == "gather"
    assert "needs a C compiler" in caplog.text
    with pytest.raises(ConfigError, match=r"attention\.decode.*needs a C compiler"):
        _backend("native")
    with pytest.raises(ConfigError, match=r"attention\.prefill.*needs a C compiler"):
        _backend("auto", prefill="native")


class _NoKernelsPlatform(CpuPlatform):
    """A CPU platform that builds no native kernels (as a platform without a toolchain)."""

    def native_library(self, name, source, flags=()):
        raise NativeUnavailable(f"platform {self.name!r} builds no native C kernels here")


@pytest.mark.parametrize("platform", [None, _NoKernelsPlatform(CpuOptions())],
                         ids=["no-platform", "no-kernels"])
def test_the_kernels_need_a_platform_that_builds_them(monkeypatch, caplog, platform):
    """Without a platform (None), or with one whose ``native_library`` raises
    ``NativeUnavailable``, ``auto`` takes the torch paths (gather, SDPA), says why, and builds
    and loads nothing; ``native`` is a ConfigError naming its key and the reason. The CPU
    platform is asked for the library (and builds it) where it is given."""
    from corellm_plugins.platform_cpu import native
    built = []
    load = native.load_library
    monkeypatch.setattr(native, "load_library",
                        lambda name, *a, **k: built.append(name) or load(name, *a, **k))
    reason = "none given" if platform is None else "builds no native C kernels here"
    for dtype in (torch.float32, torch.bfloat16):
        with caplog.at_level(logging.INFO):
            backend = _backend("auto", dtype, platform=platform)
        assert (backend.decode_path, backend.prefill_path) == ("gather", "sdpa")
        assert backend._native is None and reason in caplog.text
        assert backend.kv_cache_spec(AttentionLayerSpec(0, 4, 2, 64, scale=0.125), 4, 16,
                                     dtype).zero_init
        with pytest.raises(ConfigError, match=rf"attention\.decode.*{reason}"):
            _backend("native", dtype, platform=platform)
        with pytest.raises(ConfigError, match=rf"attention\.prefill.*{reason}"):
            _backend("auto", dtype, "native", platform=platform)
    assert built == []
    # the torch paths give the reference's results (a zeroed cache, as zero_init asks)
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125, sliding_window=20)
    out, ref = _step(_backend("auto", platform=platform), layer, MIXED, 16, torch.float32,
                     fill=0.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert _backend("auto").decode_path == "native" and built == ["corellm_paged_cpu"]


_BF16_NAN = 0x7fc0                                 # torch's (and the kernels') NaN in bf16


@pytest.mark.parametrize("prefill", ["native", "sdpa"])
def test_bf16_nan_bits(prefill):
    """The kernels' K/V writes (the decode kernel's own rows and ``corellm_write_kv``'s) copy
    bf16 rows bit for bit, NaN payloads included; a NaN the kernels compute is stored as
    torch's 0x7fc0 (a negative or signalling NaN rounded as a number would keep its sign or
    payload, and some would become infinities), and a NaN V reaches exactly the outputs that
    attend to it."""
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    neg_nan, snan = (torch.tensor([b - 0x10000 if b >= 0x8000 else b], dtype=torch.int16)
                     .view(torch.bfloat16) for b in (0xffc1, 0x7fa1))

    def plant(q, k, v):
        v[2, 0] = neg_nan            # a decode (15 + 1 tokens): its new V, KV head 0
        v[5, 1] = snan               # the first token of the 19-token prompt, KV head 1
        k[6, 1, :3] = neg_nan        # a K NaN: copied as it is (and poisons its scores)

    out, ref = _step(_backend("native", torch.bfloat16, prefill), layer, MIXED, 16,
                     torch.bfloat16, edit=plant)
    nan = out.isnan()
    assert torch.equal(nan, ref.isnan())
    assert nan[2, :2].all() and not nan[2, 2:].any() and nan[5:24, 2:].all()
    if prefill == "native":          # the native prefill's outputs; SDPA's are torch's
        assert (_bits(out)[nan] == _BF16_NAN).all()
    else:
        assert (_bits(out[:5])[nan[:5]] == _BF16_NAN).all()
    torch.testing.assert_close(out.double()[~nan], ref[~nan], atol=2e-2, rtol=2e-2)


def test_native_build_is_cached_and_errors_are_clear(monkeypatch, tmp_path):
    from corellm_plugins.platform_cpu import native
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = tmp_path / "k.c"
    src.write_text("int twice(int x) { return 2 * x; }\n")
    lib = native.load_library("k", src)
    assert lib.twice(21) == 42
    built = list((tmp_path / "corellm" / "native").glob("k-*/libk.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_loaded", {})                 # a new process: disk only
    assert native.load_library("k", src).twice(2) == 4
    assert built[0].stat().st_mtime_ns == mtime                 # not rebuilt
    src.write_text("int twice(int x) { return 2 * x }\n")       # edited, and broken
    with pytest.raises(native.NativeBuildError, match=r"(?s)building k failed.*error"):
        native.load_library("k", src)
    # through the platform: the error every plugin catches
    with pytest.raises(NativeUnavailable, match=r"(?s)building k failed.*error"):
        PLATFORM.native_library("k", src)


def test_decode_paths_equal_transformers(make_checkpoint):
    """Greedy tokens of the native and the SDPA/gather paths equal transformers' (GQA
    checkpoint, prompts from 1 to 131 tokens, chunked prefill beside decodes), and each
    other."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from corellm import LLM, SamplingParams
    path = make_checkpoint("llama", num_key_value_heads=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size)[:6]
    reference = hf_greedy(model, prompts, GenerationConfig(
        max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for decode, prefill in (("native", "native"), ("gather", "sdpa")):
        cfg = engine_config(path, attention={"name": "torch_sdpa", "decode": decode,
                                             "prefill": prefill},
                            scheduler={"max_num_batched_tokens": 48})
        with LLM(cfg) as llm:
            backend = llm.engine.executor.worker.runner.attn_backend
            assert (backend.decode_path, backend.prefill_path) == (decode, prefill)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            assert_pool_whole(llm)
        tokens[decode] = [o.outputs[0].token_ids for o in outs]
        notes = [n for o, (t, lg) in zip(tokens[decode], reference) if (n := compare(o, t, lg))]
        assert not notes, (decode, notes)
    assert tokens["native"] == tokens["gather"]


def test_decode_and_prefill_options_are_validated_at_their_keys():
    from corellm.config.compose import load_config
    attention = load_config({"attention": {"name": "torch_sdpa"}}).attention
    assert (attention.decode, attention.prefill) == ("auto", "auto")
    with pytest.raises(ConfigError, match=r"attention\.decode.*'auto', 'native' or 'gather'"):
        load_config({"attention": {"name": "torch_sdpa", "decode": "inplace"}})
    with pytest.raises(ConfigError, match=r"attention\.prefill.*'auto', 'native' or 'sdpa'"):
        load_config({"attention": {"name": "torch_sdpa", "prefill": "flash"}})


def test_loading_the_kernel_keeps_ieee_subnormals(tmp_path, monkeypatch):
    """Built with -ffast-math for its own loops, the library must not switch the process to
    flush-to-zero / denormals-are-zero on load (GCC's crtfastmath.o, linked into shared
    libraries built with -ffast-math, does): that would change every float op of the program."""
    import subprocess
    import sys
    code = ("import numpy as np, torch; from corellm_plugins.attn_torch_sdpa.backend import "
            "TorchSDPABackend; from corellm_plugins.platform_cpu import CpuOptions; "
            "from corellm_plugins.platform_cpu.platform import CpuPlatform; "
            "b = TorchSDPABackend('native', torch.device('cpu'), torch.float32, 'auto', "
            "CpuPlatform(CpuOptions())); assert b.decode_path == 'native'; "
            "tiny = np.finfo(np.float32).smallest_subnormal;"
            " print(float(tiny * np.float32(3)) > 0, float(torch.tensor(tiny) * 3) > 0)")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # a fresh build
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]
