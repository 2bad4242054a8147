"""The CPU platform's fused element-wise kernels (plugins/platform_cpu/cpu_ops.c, run by
``corellm_plugins.platform_cpu.ops.CpuDeviceOps``) against the reference ops of the same layers
(``corellm.ops.REFERENCE_OPS``, plain torch): RoPE bit for bit, RMSNorm and
SiLU-and-multiply to float32 rounding, every row independent of the batch around it, and the
torch code wherever a kernel does not apply."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from corellm import LLM, SamplingParams
from corellm.layers import RMSNorm, SiluAndMul
from corellm.ops import REFERENCE_OPS, bind_ops
from corellm.layers.rotary import RotaryEmbedding
from corellm_plugins.platform_cpu import kernels, native
from corellm_plugins.platform_cpu.ops import CpuDeviceOps
from tests.conftest import engine_config

pytestmark = pytest.mark.skipif(kernels.cpu_ops() is None,
                                reason="no C compiler on this machine")


@pytest.fixture(autouse=True)
def _silu_kernel_used(monkeypatch):
    """Check the SiLU kernel's results wherever it builds, whether or not it is the faster
    one on this machine (the check that decides is tested on its own below)."""
    monkeypatch.setattr(kernels, "_silu_faster", {torch.float32: True, torch.bfloat16: True})


def _fused(*modules):
    """The modules with the CPU platform's ops (fused kernels on, no weight packing) bound
    and prepared, as the platform's ``prepare_model`` gives them to a model's layers."""
    mods = torch.nn.ModuleList(modules)
    ops = CpuDeviceOps(weight_packing=False, fused_ops=True)
    assert bind_ops(mods, ops) == len(modules)
    ops.prepare(mods)
    assert ops.kernels is kernels.cpu_ops() and all(m.ops is ops for m in modules)
    return modules


def _ref_rope(rope, positions, q, k):
    """The reference (torch) rotation of ``rope``'s tables."""
    return REFERENCE_OPS.rotary(positions, q, k, rope.cos, rope.sin, rope.rotary_dim)


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
    want_q, want_k = _ref_rope(rope, positions, *_qkv(tokens, h, hkv, d, tokens, dtype))
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
    assert not rope.ops.kernels.rope_(torch.arange(3), q, k, rope.cos, rope.sin, 64)
    with pytest.raises(RuntimeError):
        rope(torch.arange(3), q, k)


@pytest.mark.parametrize("shape", [(1, 768), (64, 768), (5, 100), (0, 64)])
def test_rms_norm_matches_torch(shape):
    (norm,) = _fused(RMSNorm(shape[1], 1e-5))
    torch.nn.init.normal_(norm.weight.data)
    x = torch.randn(*shape) * 3
    with torch.inference_mode():
        got, want = norm(x), REFERENCE_OPS.rms_norm(x, norm.weight, norm.eps)
        assert torch.equal(got, norm.ops.kernels.rms_norm(x, norm.weight, 1e-5))  # the kernel's
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
        got, want = norm(x), REFERENCE_OPS.rms_norm(x, norm.weight, norm.eps)
        assert torch.equal(got, norm.ops.kernels.rms_norm(x, norm.weight, 1e-5))  # the kernel's
        _bf16_close(got, want)
        if shape[0] > 1:
            assert torch.equal(norm(x[1:2])[0], got[1])
        q, _ = _qkv(9, 6, 2, 64, dtype=torch.bfloat16)            # Qwen3's strided heads
        head_norm = _fused(RMSNorm(64, 1e-6).to(torch.bfloat16))[0]
        got = head_norm(q)
        assert torch.equal(got, head_norm.ops.kernels.rms_norm(q, head_norm.weight, 1e-6))
        _bf16_close(got, REFERENCE_OPS.rms_norm(q, head_norm.weight, head_norm.eps))


@pytest.mark.parametrize("rows", [0, 1, 64])
def test_bf16_silu_and_mul_matches_torch(rows):
    # in a bf16 model (the kernel is used for the dtypes of the model it was fused into)
    act, _ = _fused(SiluAndMul(), RMSNorm(8).to(torch.bfloat16))
    assert act.ops.silu_dtypes == {torch.bfloat16}
    x = (torch.randn(rows, 2 * 1000) * 8).to(torch.bfloat16)
    x[:, 0] = -1000.0                                     # exp(-g) overflows: -0, not NaN
    got = act(x)
    assert torch.equal(got, act.ops.kernels.silu_and_mul(x))  # the kernel's result
    assert not got.isnan().any()
    _bf16_close(got, REFERENCE_OPS.silu_and_mul(x))


def test_rms_norm_of_strided_heads_matches_torch():
    """Qwen3's per-head norm runs on q [T, H, D], a strided view of the QKV output."""
    (norm,) = _fused(RMSNorm(64, 1e-6))
    torch.nn.init.normal_(norm.weight.data)
    q, _ = _qkv(9, 6, 2, 64)
    assert not q.is_contiguous()
    with torch.inference_mode():
        got = norm(q)
        assert torch.equal(got, norm.ops.kernels.rms_norm(q, norm.weight, 1e-6))
        torch.testing.assert_close(got, REFERENCE_OPS.rms_norm(q, norm.weight, norm.eps),
                                   rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [0, 1, 64])
def test_silu_and_mul_matches_torch(rows):
    (act,) = _fused(SiluAndMul())
    assert act.ops.silu_dtypes == {torch.float32}
    x = torch.randn(rows, 2 * 1000) * 8          # deep into both tails of the sigmoid
    got = act(x)
    assert torch.equal(got, act.ops.kernels.silu_and_mul(x))
    torch.testing.assert_close(got, REFERENCE_OPS.silu_and_mul(x), rtol=2e-6, atol=2e-6)


def test_silu_and_mul_of_extreme_gates_is_finite():
    """exp(-g) overflows below g = -88.7: the kernel must give torch's -0, not NaN, wherever
    the value sits (vector body or scalar tail of a row)."""
    (act,) = _fused(SiluAndMul())
    d = 37                                       # 4 vectors of 8 and a tail of 5
    gate = torch.full((3, d), -1000.0)
    gate[1] = torch.linspace(-3e4, 3e4, d)
    gate[2, ::2] = 100.0
    x = torch.cat([gate, torch.full((3, d), 2.0)], dim=1)
    got, want = act(x), REFERENCE_OPS.silu_and_mul(x)
    assert torch.equal(got, act.ops.kernels.silu_and_mul(x))
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_inputs_the_kernels_do_not_take_run_the_torch_code():
    norm, act, rope = _fused(RMSNorm(64, 1e-6), SiluAndMul(), RotaryEmbedding(64, 128, 1e4))
    with torch.inference_mode():
        x = torch.randn(4, 64, dtype=torch.float16)               # no fp16 kernels
        assert norm.ops.kernels.rms_norm(x, norm.weight.half(), 1e-6) is None
        assert torch.equal(norm.to(torch.float16)(x),
                           REFERENCE_OPS.rms_norm(x, norm.weight, norm.eps))
        xb = x.to(torch.bfloat16)                                 # x and weight dtypes differ
        assert norm.ops.kernels.rms_norm(xb, norm.weight.float(), 1e-6) is None
        assert norm.ops.kernels.rms_norm(xb, norm.weight.bfloat16(), 1e-6) is not None
        g = torch.randn(64, 4).t()                                # last dim not contiguous
        assert act.ops.kernels.silu_and_mul(g) is None
        assert torch.equal(act(g), REFERENCE_OPS.silu_and_mul(g))
        q, k = _qkv(3, 2, 1, 64)
        q16, k16 = q.to(torch.float16), k.to(torch.float16)
        pos = torch.tensor([0, 5, 9])
        assert not rope.ops.kernels.rope_(pos, q16.clone(), k16.clone(), rope.cos, rope.sin, 64)
        for got, want in zip(rope(pos, q16, k16), _ref_rope(rope, pos, q16, k16)):
            assert torch.equal(got, want)


def test_rope_positions_outside_the_table_raise_as_torch_does():
    (rope,) = _fused(RotaryEmbedding(64, 128, 1e4))
    q, k = _qkv(2, 2, 1, 64)
    with pytest.raises(IndexError):
        rope(torch.tensor([0, 128]), q, k)
    # torch indexing wraps a negative position: so does this. The kernel checks every position
    # before it rotates any row in place (here the first row's is valid).
    for pos in (torch.tensor([-1, 3]), torch.tensor([3, -1])):
        want = _ref_rope(rope, pos, q, k)
        assert all(torch.equal(a, b) for a, b in zip(rope(pos, q.clone(), k.clone()), want))


def test_a_silu_kernel_slower_than_torch_is_not_used(monkeypatch, caplog):
    """The kernels are built, but SiLU-and-multiply keeps the torch code when its kernel
    measured slower (the other kernels are used)."""
    monkeypatch.setattr(kernels, "_silu_faster", {})
    # 20 ms a call: far slower than torch's op (about 0.5 ms) even on a slow or busy machine
    slow = []
    monkeypatch.setattr(kernels.CpuOps, "silu_and_mul",
                        lambda self, x: (slow.append(1), time.sleep(0.02), x)[2])
    norm, act = RMSNorm(8), SiluAndMul()
    ops = CpuDeviceOps(weight_packing=False, fused_ops=True)
    mods = torch.nn.ModuleList([norm, act])
    bind_ops(mods, ops)
    with caplog.at_level(logging.INFO):
        ops.prepare(mods)
    assert ops.kernels is not None and ops.silu_dtypes == frozenset()
    assert "slower than torch's here" in caplog.text
    slow.clear()
    x = torch.randn(3, 16)
    assert torch.equal(act(x), REFERENCE_OPS.silu_and_mul(x)) and slow == []   # torch's
    with torch.inference_mode():                                  # the norm's kernel still runs
        assert torch.equal(norm(x[:, :8]), ops.kernels.rms_norm(x[:, :8], norm.weight, norm.eps))
    monkeypatch.undo()
    assert isinstance(kernels._silu_kernel_is_faster(kernels.cpu_ops()), bool)


def test_without_a_compiler_the_torch_ops_run(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(kernels, "_cpu_ops", [])
    norm, act = RMSNorm(8), SiluAndMul()
    ops = CpuDeviceOps(weight_packing=False, fused_ops=True)
    mods = torch.nn.ModuleList([norm, act])
    bind_ops(mods, ops)
    with caplog.at_level(logging.INFO):
        ops.prepare(mods)
    assert ops.kernels is None and norm.ops is ops
    assert "using torch ops" in caplog.text
    x = torch.randn(3, 8)
    assert torch.equal(norm(x), REFERENCE_OPS.rms_norm(x, norm.weight, norm.eps))
    assert torch.equal(act(x), REFERENCE_OPS.silu_and_mul(x))


def test_engine_tokens_are_the_same_fused_or_not(llama_path, monkeypatch):
    """Every linear layer planned on the native GEMM (so the fused paths have every chance to
    run): with ``platform.fused_ops`` on, the norms and SiLU run inside the GEMMs, RoPE and
    greedy's argmax in the kernels; off, none of them does; the tokens are the same."""
    from corellm.layers import ColumnParallelLinear
    from corellm_plugins.platform_cpu import gemm
    from corellm_plugins.platform_cpu.gemm import GemmPlan, PackedLinear
    monkeypatch.setattr(gemm, "gemm_plan", lambda shape, paths=None, dtype=torch.float32:
                        GemmPlan(shape, (1,), ("native",)))
    native_gemm = gemm.native_gemm()
    calls = {"silu_mul": 0, "normed": 0, "argmax": 0, "rope": 0}

    def spy(cls, name, key, counts=lambda *a, **k: True):
        real = getattr(cls, name)

        def wrapped(self, *a, **k):
            calls[key] += bool(counts(*a, **k))
            return real(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)

    spy(type(native_gemm), "linear_silu_mul", "silu_mul")
    spy(type(native_gemm), "linear", "normed", lambda *a, **k: k.get("norm") is not None)
    spy(kernels.CpuOps, "argmax", "argmax")
    spy(kernels.CpuOps, "rope_", "rope")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(4, 4 + n))} for n in (1, 9, 33, 120)]
    runs = {}
    for fused in (True, False):
        with LLM(engine_config(llama_path, platform={"name": "cpu", "fused_ops": fused})) as llm:
            runner = llm.engine.executor.worker.runner
            ops = runner.platform.ops
            assert isinstance(ops, CpuDeviceOps) and ops.fused_ops == fused
            assert (ops.kernels is not None) == fused
            layers = [m for m in runner.model.modules() if isinstance(m, ColumnParallelLinear)]
            assert layers and all(m.ops is ops and isinstance(m.kernel, PackedLinear)
                                  for m in layers)
            # the GEMM takes the norm (and the SiLU) only with the fused ops on
            with torch.inference_mode():
                for m in layers:
                    x = torch.randn(3, m.in_features)
                    normed = ops.linear_normed(m, x, torch.ones(m.in_features), 1e-6)
                    assert (normed is not None) == fused
            for key in calls:
                calls[key] = 0
            runs[fused] = [o.outputs[0].token_ids
                           for o in llm.generate(prompts, greedy, use_tqdm=False)]
            if fused:
                assert all(calls.values()), calls
            else:
                assert not any(calls.values()), calls
    assert runs[True] == runs[False]
