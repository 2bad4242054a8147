"""The fused CPU element-wise kernels (corellm/worker/cpu_ops.c) against the torch code of the
same layers: RoPE bit for bit, RMSNorm and SiLU-and-multiply to float32 rounding, every row
independent of the batch around it, and the torch code wherever a kernel does not apply."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.layers import RMSNorm, SiluAndMul
from corellm.layers.rotary import RotaryEmbedding
from corellm.worker import cpu
from tests.conftest import engine_config

pytestmark = pytest.mark.skipif(cpu.cpu_ops() is None, reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _silu_kernel_used(monkeypatch):
    """Check the SiLU kernel's results wherever it builds, whether or not it is the faster
    one on this machine (the check that decides is tested on its own below)."""
    monkeypatch.setattr(cpu, "_silu_faster", {torch.float32: True, torch.bfloat16: True})


def _fused(*modules):
    mods = torch.nn.ModuleList(modules)
    assert cpu.fuse_elementwise(mods) == len(modules)
    return modules


def _qkv(t, h, hkv, d, seed=0, dtype=torch.float32):
    """q [t, h, d] and k [t, hkv, d] as strided views of one fused QKV output, as models make
    them."""
    qkv = torch.randn(t, (h + 2 * hkv) * d,
                      generator=torch.Generator().manual_seed(seed)).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    return q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
def test_rope_is_bit_equal_to_torch(rotary_dim, tokens, dtype):
    """In place on the views of a fused QKV output, as models call it: q and k rotated exactly
    as the torch code rotates them (in bf16: every product and sum rounded where torch rounds
    it); v, the rest of each head past rotary_dim, untouched."""
    (rope,) = _fused(RotaryEmbedding(64, 4096, 10000.0, rotary_dim=rotary_dim))
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    h, hkv, d = 12, 4, 64
    want_q, want_k = RotaryEmbedding.forward(rope, positions,
                                             *_qkv(tokens, h, hkv, d, tokens, dtype))
    qkv = torch.randn(tokens, (h + 2 * hkv) * d,
                      generator=torch.Generator().manual_seed(tokens)).to(dtype)
    before = qkv.clone()
    q, k = qkv[:, :h * d].view(tokens, h, d), qkv[:, h * d:(h + hkv) * d].view(tokens, hkv, d)
    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.data_ptr() == qkv.data_ptr()                   # rotated in place
    assert torch.equal(qkv[:, (h + hkv) * d:], before[:, (h + hkv) * d:])          # v
    if rotary_dim:
        rest = qkv[:, :(h + hkv) * d].view(tokens, h + hkv, d)[..., rotary_dim:]
        assert torch.equal(rest, before[:, :(h + hkv) * d].view(tokens, h + hkv, d)[
            ..., rotary_dim:])


def test_rope_refuses_heads_narrower_than_its_rotation():
    """A layout the kernel cannot rotate goes to the torch code (which raises), never to a
    write past the heads."""
    (rope,) = _fused(RotaryEmbedding(64, 128, 1e4))
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    assert not rope.cpu_ops.rope_(torch.arange(3), q, k, rope.cos, rope.sin, 64)
    with pytest.raises(RuntimeError):
        rope(torch.arange(3), q, k)


@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (5, 100), (0, 64)])
def test_rms_norm_matches_torch(shape):
    (norm,) = _fused(RMSNorm(shape[1], 1e-5))
    torch.nn.init.normal_(norm.weight.data)
    x = torch.randn(*shape) * 3
    with torch.inference_mode():
        got, want = norm(x), RMSNorm.forward(norm, x)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        if shape[0] > 1:   # a row's result does not depend on the rows around it
            assert torch.equal(norm(x[1:2])[0], got[1])


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results of float32 arithmetic that differs from torch's only in the last float32
    bits: equal but for values that sat on a bf16 rounding boundary, and there within a bf16
    step of each of the two roundings (the activation, then its product)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    differ = int((got != want).sum())
    assert differ <= 0.01 * got.numel(), f"{differ} of {got.numel()} differ"
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-30)


@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (5, 100), (0, 64)])
def test_bf16_rms_norm_matches_torch(shape):
    (norm,) = _fused(RMSNorm(shape[1], 1e-5).to(torch.bfloat16))
    torch.nn.init.normal_(norm.weight.data)
    x = (torch.randn(*shape) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        got, want = norm(x), RMSNorm.forward(norm, x)
        assert torch.equal(got, norm.cpu_ops.rms_norm(x, norm.weight, 1e-5))   # the kernel's
        _bf16_close(got, want)
        if shape[0] > 1:
            assert torch.equal(norm(x[1:2])[0], got[1])
        q, _ = _qkv(9, 6, 2, 64, dtype=torch.bfloat16)            # Qwen3's strided heads
        head_norm = _fused(RMSNorm(64, 1e-6).to(torch.bfloat16))[0]
        got = head_norm(q)
        assert torch.equal(got, head_norm.cpu_ops.rms_norm(q, head_norm.weight, 1e-6))
        _bf16_close(got, RMSNorm.forward(head_norm, q))


@pytest.mark.parametrize("rows", [0, 1, 64])
def test_bf16_silu_and_mul_matches_torch(rows):
    # in a bf16 model (the kernel is used for the dtypes of the model it was fused into)
    act, _ = _fused(SiluAndMul(), RMSNorm(8).to(torch.bfloat16))
    assert act.cpu_ops_dtypes == {torch.bfloat16}
    x = (torch.randn(rows, 2 * 1000) * 8).to(torch.bfloat16)
    x[:, 0] = -1000.0                                     # exp(-g) overflows: -0, not NaN
    got = act(x)
    assert torch.equal(got, act.cpu_ops.silu_and_mul(x))  # the kernel's result
    assert not got.isnan().any()
    _bf16_close(got, SiluAndMul.forward(act, x))


def test_rms_norm_of_strided_heads_matches_torch():
    """Qwen3's per-head norm runs on q [T, H, D], a strided view of the QKV output."""
    (norm,) = _fused(RMSNorm(64, 1e-6))
    torch.nn.init.normal_(norm.weight.data)
    q, _ = _qkv(9, 6, 2, 64)
    assert not q.is_contiguous()
    with torch.inference_mode():
        torch.testing.assert_close(norm(q), RMSNorm.forward(norm, q), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [0, 1, 64])
def test_silu_and_mul_matches_torch(rows):
    (act,) = _fused(SiluAndMul())
    x = torch.randn(rows, 2 * 1000) * 8          # deep into both tails of the sigmoid
    torch.testing.assert_close(act(x), SiluAndMul.forward(act, x), rtol=2e-6, atol=2e-6)


def test_silu_and_mul_of_extreme_gates_is_finite():
    """exp(-g) overflows below g = -88.7: the kernel must give torch's -0, not NaN, wherever
    the value sits (vector body or scalar tail of a row)."""
    (act,) = _fused(SiluAndMul())
    d = 37                                       # 4 vectors of 8 and a tail of 5
    gate = torch.full((3, d), -1000.0)
    gate[1] = torch.linspace(-3e4, 3e4, d)
    gate[2, ::2] = 100.0
    x = torch.cat([gate, torch.full((3, d), 2.0)], dim=1)
    got, want = act(x), SiluAndMul.forward(act, x)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_inputs_the_kernels_do_not_take_run_the_torch_code():
    norm, act, rope = _fused(RMSNorm(64, 1e-6), SiluAndMul(), RotaryEmbedding(64, 128, 1e4))
    with torch.inference_mode():
        x = torch.randn(4, 64, dtype=torch.float16)               # no fp16 kernels
        assert torch.equal(norm.to(torch.float16)(x), RMSNorm.forward(norm, x))
        xb = x.to(torch.bfloat16)                                 # x and weight dtypes differ
        assert norm.cpu_ops.rms_norm(xb, norm.weight.float(), 1e-6) is None
        assert norm.cpu_ops.rms_norm(xb, norm.weight.bfloat16(), 1e-6) is not None
        g = torch.randn(64, 4).t()                                # last dim not contiguous
        assert torch.equal(act(g), SiluAndMul.forward(act, g))
        q, k = _qkv(3, 2, 1, 64)
        q16, k16 = q.to(torch.float16), k.to(torch.float16)
        pos = torch.tensor([0, 5, 9])
        for got, want in zip(rope(pos, q16, k16), RotaryEmbedding.forward(rope, pos, q16, k16)):
            assert torch.equal(got, want)


def test_rope_positions_outside_the_table_raise_as_torch_does():
    (rope,) = _fused(RotaryEmbedding(64, 128, 1e4))
    q, k = _qkv(2, 2, 1, 64)
    with pytest.raises(IndexError):
        rope(torch.tensor([0, 128]), q, k)
    # torch indexing wraps a negative position: so does this. The kernel checks every position
    # before it rotates any row in place (here the first row's is valid).
    for pos in (torch.tensor([-1, 3]), torch.tensor([3, -1])):
        want = RotaryEmbedding.forward(rope, pos, q, k)
        assert all(torch.equal(a, b) for a, b in zip(rope(pos, q.clone(), k.clone()), want))


def test_a_silu_kernel_slower_than_torch_is_not_used(monkeypatch, caplog):
    monkeypatch.setattr(cpu, "_silu_faster", {})
    # 20 ms a call: far slower than torch's op (about 0.5 ms) even on a slow or busy machine
    monkeypatch.setattr(cpu.CpuOps, "silu_and_mul", lambda self, x: (time.sleep(0.02), x)[1])
    mods = torch.nn.ModuleList([RMSNorm(8), SiluAndMul()])
    with caplog.at_level(logging.INFO):
        assert cpu.fuse_elementwise(mods) == 1
    assert hasattr(mods[0], "cpu_ops") and not hasattr(mods[1], "cpu_ops")
    assert "slower than torch's here" in caplog.text
    monkeypatch.setattr(cpu, "_silu_faster", {})
    monkeypatch.undo()
    assert isinstance(cpu._silu_kernel_is_faster(cpu.cpu_ops()), bool)


def test_without_a_compiler_the_torch_ops_run(monkeypatch, tmp_path, caplog):
    from corellm import native
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(cpu, "_cpu_ops", [])
    with caplog.at_level(logging.INFO):
        assert cpu.fuse_elementwise(torch.nn.ModuleList([RMSNorm(8), SiluAndMul()])) == 0
    assert "using torch ops" in caplog.text


def test_engine_tokens_are_the_same_fused_or_not(llama_path):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(4, 4 + n))} for n in (1, 9, 33, 120)]
    runs = {}
    for fused in (True, False):
        with LLM(engine_config(llama_path, model={"cpu_fused_ops": fused})) as llm:
            model = llm.engine.executor.worker.runner.model
            assert any(hasattr(m, "cpu_ops") for m in model.modules()) == fused
            # the GEMM takes the norm and SiLU only with the fused ops on, where it is planned
            from corellm.layers import ColumnParallelLinear
            column = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)
                      and "native" in getattr(getattr(m, "gemm_plan", None), "paths", ())]
            assert all(hasattr(m, "linear_normed") == fused for m in column)
            if not fused:
                assert not any(hasattr(m, "linear_normed") or hasattr(m, "linear_silu_mul")
                               for m in model.modules())
            runs[fused] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert runs[True] == runs[False]
