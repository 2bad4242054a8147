"""The CPU platform's own GEMM (plugins/platform_cpu/cpu_gemm.c, the "native" GEMM path of
``corellm_plugins.platform_cpu.gemm``) for fp32 and bf16 weights: checked against float64
products, with torch's fp32 error as the yardstick; and the platform's ops
(``corellm_plugins.platform_cpu.ops.CpuDeviceOps``) that run core linear layers on it."""

from __future__ import annotations

import logging

import pytest
import torch

from corellm_plugins.platform_cpu import gemm, native
from corellm_plugins.platform_cpu import ops as cpu_ops_module
from corellm_plugins.platform_cpu.gemm import GemmPlan, PackedLinear
from corellm_plugins.platform_cpu.kernels import cpu_ops
from corellm_plugins.platform_cpu.ops import CpuDeviceOps
from tests.cpu_threads import cpu_threads

GEMM = gemm.native_gemm()
pytestmark = pytest.mark.skipif(GEMM is None, reason="no C compiler on this machine")


def _case(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """Within a few times torch's own fp32 error of the float64 product."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    torch_err = (torch.nn.functional.linear(x, w, bias).double() - ref).abs().max().item()
    err = (y.double() - ref).abs().max().item() if y.numel() else 0.0
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert err <= 4 * torch_err + 1e-6 * (1 + ref.abs().max().item()), (err, torch_err)


# n around the panel width (one vector pair) and a big one; m around the tile's rows (6 with
# AVX2; 8 with AVX-512 up to 64 rows, 6 above), and past the 192-row block; k down to 1
@pytest.mark.parametrize("n,k", [(1, 5), (15, 7), (16, 64), (17, 1), (33, 100), (1280, 768)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 8, 9, 64, 65, 193, 400])
def test_matches_float64_with_and_without_bias(m, n, k):
    x, w, b = _case(m, n, k)
    packed = GEMM.pack(w)
    _check(GEMM.linear(x, packed, n, b), x, w, b)
    _check(GEMM.linear(x, packed, n, None), x, w, None)


@pytest.mark.parametrize("n,k", [(17, 5), (1280, 96)])
@pytest.mark.parametrize("m", [1, 6, 7, 8, 9, 64, 193])
def test_bf16_weights_widened_exactly(m, n, k):
    """bf16 weights and inputs: fp32 products of the bf16 values (widening is exact), one
    rounding of the output to bf16; tiles that widen in registers (up to a tile's 6 or 8 rows)
    and blocks that
    widen a panel once agree bit for bit on a row."""
    x, w, b = (t.bfloat16() for t in _case(m, n, k))
    packed = GEMM.pack(w)
    assert packed.dtype == torch.bfloat16
    y = GEMM.linear(x, packed, n, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-5 * k)
    assert torch.equal(GEMM.linear(x[-1:], packed, n, b), y[-1:])
    assert GEMM.linear(x.float(), packed, n, b.float()) is None        # dtype not the weight's


def test_tile_height_follows_the_vector_width():
    """8-row tiles where the build has AVX-512's 32 vector registers (panels of 32 floats), 6
    with AVX2's 16 (panels of 16)."""
    assert (GEMM.panel, GEMM.tile_rows) in ((32, 8), (16, 6))


def test_bf16_dot_products_where_the_cpu_has_them():
    """With AVX512-BF16 (this machine's compiler targets its own CPU) bf16 weights are packed in
    pairs of k (k rounded up to even) and take a bf16 input as it is; elsewhere they are widened
    to meet an fp32 input. Both give the same values up to fp32 summation order."""
    import subprocess
    from pathlib import Path

    from corellm_plugins.platform_cpu.native import compiler
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    macros = subprocess.run([compiler(), "-march=native", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True).stdout
    # the CPU has it, and the compiler can target it (GCC 10 or later, clang 9 or later); on
    # an AVX2 machine (or any other) the widened path runs, and the rest checks it the same way
    assert GEMM.bf16_dot == ("avx512_bf16" in flags and "__AVX512BF16__" in macros)
    x, w, b = (t.bfloat16() for t in _case(7, 40, 9))
    packed = GEMM.pack(w)
    k = 10 if GEMM.bf16_dot else 9
    nr = GEMM.panel                                      # 32 columns with AVX-512, 16 with AVX2
    assert packed.numel() == -(-40 // nr) * nr * k       # whole panels, zero-padded
    if GEMM.bf16_dot:                                    # [panel][k / 2][32][2], zero-padded
        pairs = packed.view(2, 5, 32, 2)
        assert torch.equal(pairs[0, :, 3, :].reshape(-1)[:9], w[3])
        assert torch.equal(pairs[0, 4, :, 1], torch.zeros(32, dtype=torch.bfloat16))
        assert torch.equal(pairs[1, :, 8:], torch.zeros(5, 24, 2, dtype=torch.bfloat16))
    y = GEMM.linear(x, packed, 40, b, k=9)
    ref = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-4)
    # k given: an input of k + 1 (same packed size when k is paired) is refused, as torch would
    x10 = torch.randn(7, 10).bfloat16()
    assert GEMM.linear(x10, packed, 40, b, k=9) is None
    assert gemm._run("native", x10[:, :9], w, packed, b).shape == (7, 40)
    with pytest.raises(RuntimeError):
        gemm._run("native", x10, w, packed, b)          # torch's error, not a silent product


def test_bf16_outputs_are_rounded_as_torch_rounds():
    """A bf16 layer's output is rounded once, by the kernel, from the fp32 sum: to nearest even,
    infinities kept, NaN as NaN. With k = 2 the fp32 sum is exact products rounded
    once, whatever the order or instruction, so it must equal torch's fp32 product rounded."""
    x, w, _ = (t.bfloat16() for t in _case(7, 40, 2, seed=3))
    x[1, 0], x[2, :] = float("inf"), torch.tensor([float("inf"), -float("inf")])
    w[5, :] = torch.tensor([1.0, 1.0])                   # row 2: inf - inf = NaN
    x[3, 0] = float("nan")
    y = GEMM.linear(x, GEMM.pack(w), 40, None)
    want = (x.float() @ w.float().T).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    nan = want.isnan()                 # (torch's NaN bits differ between its own code paths)
    assert torch.equal(y.isnan(), nan) and nan[2, 5] and y[1].isinf().any()
    assert torch.equal(y.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def test_rows_are_batch_invariant_and_threads_do_not_change_bits():
    """Each output is one in-order sum over k, whatever the batch it is in and the thread
    count: a request's logits do not depend on what it was batched with."""
    x, w, b = _case(200, 70, 96)
    packed = GEMM.pack(w)
    full = GEMM.linear(x, packed, 70, b)
    for i in (0, 5, 6, 191, 192, 199):
        assert torch.equal(GEMM.linear(x[i:i + 1], packed, 70, b), full[i:i + 1])
    assert torch.equal(GEMM.linear(x[7:50], packed, 70, b), full[7:50])
    for t in (1, 3, 7):
        with cpu_threads(t):
            assert torch.equal(GEMM.linear(x, packed, 70, b), full)


def test_strided_inputs_and_weights():
    x, w, b = _case(9, 40, 24)
    wide = torch.randn(9, 50)
    wide[:, 3:27] = x
    view = wide[:, 3:27]                       # rows strided: read in place
    packed = GEMM.pack(w)
    assert torch.equal(GEMM.linear(view, packed, 40, b), GEMM.linear(x, packed, 40, b))
    xt = x.T.contiguous().T                    # columns strided: copied first
    assert torch.equal(GEMM.linear(xt, packed, 40, b), GEMM.linear(x, packed, 40, b))
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()   # bf16: widened, then copied
    packed_b = GEMM.pack(wb)
    assert torch.equal(GEMM.linear(xb.T.contiguous().T, packed_b, 40, bb),
                       GEMM.linear(xb, packed_b, 40, bb))
    assert torch.equal(GEMM.linear(wide.bfloat16()[:, 3:27], packed_b, 40, bb),
                       GEMM.linear(xb, packed_b, 40, bb))
    wwide = torch.randn(40, 30)
    wwide[:, :24] = w
    assert torch.equal(GEMM.pack(wwide[:, :24]), packed)   # weight rows strided


def test_empty_dimensions():
    w, b = torch.randn(8, 0), torch.randn(8)
    out = GEMM.linear(torch.randn(3, 0), GEMM.pack(w), 8, b)
    assert torch.equal(out, b.expand(3, 8))
    assert torch.equal(GEMM.linear(torch.randn(3, 0), GEMM.pack(w), 8, None), torch.zeros(3, 8))
    x, w, b = _case(0, 8, 4)
    assert GEMM.linear(x, GEMM.pack(w), 8, b).shape == (0, 8)


def test_inputs_it_does_not_take_are_refused():
    x, w, b = _case(4, 8, 16)
    packed = GEMM.pack(w)
    assert GEMM.linear(x.bfloat16(), packed, 8, b) is None
    assert GEMM.linear(x.requires_grad_(), packed, 8, b) is None        # autograd
    with torch.no_grad():
        assert GEMM.linear(x, packed, 8, b) is not None
    x = x.detach()
    assert GEMM.linear(x, packed, 8, b[:4]) is None                     # bias of another size
    assert GEMM.linear(x, packed, 8, b.double()) is None
    assert GEMM.linear(x[:, :8], packed, 8, b) is None                  # k is not the weight's
    assert GEMM.linear(x.unsqueeze(0), packed, 8, b) is None            # not 2-D
    with pytest.raises(ValueError, match="fp32 or bf16 \\[out, in\\] CPU weights"):
        GEMM.pack(w.half())
    with pytest.raises(ValueError, match="contiguous rows"):
        GEMM.pack(w.T)


def _silu_mul64(x, w, bias):
    y = x.double() @ w.double().T + (0 if bias is None else bias.double())
    d = y.shape[1] // 2
    return torch.nn.functional.silu(y[:, :d]) * y[:, d:]


# d a multiple of the panel (NR = 2 vector widths: 32 with AVX-512, 16 with AVX2); m around
# the tile's rows (6 or 8) and past the 192-row block
PANEL = GEMM.panel if GEMM else 32


@pytest.mark.parametrize("d,k", [(PANEL, 5), (2 * PANEL, 100), (2048, 768)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 8, 9, 64, 193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_in_the_gemm_matches_the_two_layers(m, d, k, dtype):
    """``linear_silu_mul`` = SiLU-and-multiply of the [gate | up] product, without writing the
    product: within fp32 rounding of float64 (as the unfused layers are) and of the unfused
    layers themselves; in bf16, the unfused layers' roundings (the exp polynomial may move a
    value across a bf16 rounding boundary: a few in ten thousand)."""
    x, w, b = (t.to(dtype) for t in _case(m, 2 * d, k))
    packed = GEMM.pack(w)
    ops = cpu_ops()
    for bias in (b, None):
        fused = GEMM.linear_silu_mul(x, packed, 2 * d, bias, k=k)
        assert fused.dtype == dtype and fused.shape == (m, d)
        unfused = ops.silu_and_mul(GEMM.linear(x, packed, 2 * d, bias, k=k))
        ref = _silu_mul64(x, w, bias)
        scale = ref.abs().max().item()
        if dtype == torch.float32:
            err = (fused.double() - ref).abs().max().item()
            unfused_err = (unfused.double() - ref).abs().max().item()
            assert err <= 2 * unfused_err + 1e-6 * scale, (err, unfused_err)
            torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6 * scale)
        else:
            differ = int((fused != unfused).sum())          # each by a bf16 step or two
            assert differ <= max(2, fused.numel() // 500), differ
            torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6, atol=1e-30)
            torch.testing.assert_close(fused.double(), ref, rtol=2 ** -6, atol=1e-3 * scale)
        assert torch.equal(GEMM.linear_silu_mul(x[-1:], packed, 2 * d, bias, k=k), fused[-1:])


def test_silu_mul_in_the_gemm_refuses_what_it_cannot_split():
    """A width whose halves are not whole panels, and what ``linear`` refuses, give None (the
    caller runs the two layers); extreme gates give silu's limits, NaN stays NaN."""
    d = GEMM.panel
    x, w, _ = _case(3, 2 * d + 2, 8)
    assert GEMM.linear_silu_mul(x, GEMM.pack(w), 2 * d + 2, None) is None
    x, w, _ = _case(3, 2 * d, 8)
    packed = GEMM.pack(w)
    assert GEMM.linear_silu_mul(x.double(), packed, 2 * d, None) is None
    w = torch.zeros(2 * d, 1)
    w[:d, 0] = torch.tensor([1e4, -1e4, float("inf"), float("nan")]).repeat(d // 4)
    w[d:, 0] = 2.0
    out = GEMM.linear_silu_mul(torch.ones(1, 1), GEMM.pack(w), 2 * d, None)
    big, small, inf, nan = out[0, :4].tolist()
    assert big == 2e4 and -1e-30 < small <= 0 and inf == float("inf") and nan != nan


@pytest.mark.parametrize("n,k", [(17, 5), (2 * PANEL, 100), (1280, 768)])
@pytest.mark.parametrize("m", [1, 6, 7, 64, 193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_in_the_gemm_matches_the_two_layers(m, n, k, dtype):
    """``norm=`` normalizes the rows inside the GEMM as ``corellm.layers.RMSNorm`` does (bf16:
    its roundings), alone and before SiLU-and-multiply: within fp32 rounding of the two layers
    (a different summation order of the squares), in bf16 within a step of them in a few
    elements; a row's result does not depend on the others."""
    from corellm.layers import RMSNorm
    x, w, b = (t.to(dtype) for t in _case(m, n, k, seed=1))
    x = x * 3
    norm = RMSNorm(k, 1e-5)
    norm.weight.data = (torch.rand(k, generator=torch.Generator().manual_seed(2)) + .5).to(dtype)
    packed = GEMM.pack(w)
    with torch.inference_mode():
        xn = norm(x)
        cases = [(GEMM.linear(x, packed, n, b, k=k, norm=(norm.weight, norm.eps)),
                  GEMM.linear(xn, packed, n, b, k=k))]
        if n % (2 * PANEL) == 0:
            cases.append((GEMM.linear_silu_mul(x, packed, n, b, k=k, norm=(norm.weight, norm.eps)),
                          GEMM.linear_silu_mul(xn, packed, n, b, k=k)))
    for fused, unfused in cases:
        assert fused.dtype == dtype and fused.shape == unfused.shape
        scale = unfused.abs().max().item()
        if dtype == torch.float32:
            torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=2e-6 * scale)
        else:
            # a normalized input a bf16 step apart moves a sum by about that step of one term
            assert int((fused != unfused).sum()) <= max(2, fused.numel() // 200)
            torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6,
                                       atol=2 ** -7 * scale)
    with torch.inference_mode():
        row = GEMM.linear(x[-1:], packed, n, b, k=k, norm=(norm.weight, norm.eps))
    assert torch.equal(row, cases[0][0][-1:])
    # a norm weight being trained: the caller runs the layers (autograd)
    assert GEMM.linear(x, packed, n, b, k=k, norm=(norm.weight, norm.eps)) is None


def test_fused_bf16_paths_widened_where_the_cpu_has_dot_products_too():
    """bf16 panels widened to fp32 (pairs of panels in the SiLU mode, through a per-thread
    scratch for blocks of more than a tile's rows), as a CPU without bf16 dot products runs
    them: the fused norm and SiLU give the unfused layers' values there too. On a CPU with
    AVX512-BF16 a build without it (-mno-avx512bf16) is the one checked; elsewhere the default
    build widens."""
    from corellm.layers import RMSNorm
    plain = GEMM
    if GEMM.bf16_dot:
        plain = gemm.NativeGemm(native.load_library("corellm_gemm", gemm._GEMM_SOURCE,
                                                    (*gemm._GEMM_FLAGS, "-mno-avx512bf16")))
    assert not plain.bf16_dot
    d, k = 2 * PANEL, 40
    x, w, b = (t.bfloat16() for t in _case(70, 2 * d, k, seed=3))
    norm = RMSNorm(k, 1e-5).bfloat16().requires_grad_(False)
    packed = plain.pack(w)
    for m in (5, 9, 70):
        with torch.inference_mode():
            fused = plain.linear_silu_mul(x[:m], packed, 2 * d, b, k=k, norm=(norm.weight, 1e-5))
            unfused = cpu_ops().silu_and_mul(plain.linear(norm(x[:m]), packed, 2 * d, b, k=k))
        assert int((fused != unfused).sum()) <= max(2, fused.numel() // 200)
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6,
                                   atol=2 ** -7 * unfused.abs().max().item())


def test_rms_norm_in_the_gemm_refuses_a_weight_it_cannot_take():
    x, w, _ = _case(3, 8, 16)
    packed = GEMM.pack(w)
    for bad in (torch.ones(16, dtype=torch.float64), torch.ones(15), torch.ones(32)[::2]):
        assert GEMM.linear(x, packed, 8, None, k=16, norm=(bad, 1e-6)) is None


def _force_plan(monkeypatch, bounds: tuple[int, ...], paths: tuple[str, ...]) -> None:
    """Every weight shape gets this plan instead of a measured one."""
    monkeypatch.setattr(gemm, "gemm_plan", lambda shape, paths_=None, dtype=torch.float32:
                        GemmPlan(shape, bounds, paths))


def _platform_ops(model: torch.nn.Module, **options) -> CpuDeviceOps:
    """The CPU platform's ops bound to every core layer of ``model`` and prepared (weights
    packed, kernels built), as the platform's ``prepare_model`` does for a loaded model."""
    from corellm_plugins.platform_cpu import CpuOptions
    from corellm_plugins.platform_cpu.platform import CpuPlatform
    platform = CpuPlatform(CpuOptions(**options))
    platform.prepare_model(model)
    return platform.ops


def test_a_merged_gate_up_layer_takes_the_fused_path_only_on_native_rows(monkeypatch):
    """The CPU platform's ops give a [gate; up] layer of two equal halves ``linear_silu_mul``
    (and every column-parallel layer ``linear_normed``) on the rows its plan runs on the native
    GEMM, with the fused ops on; rows planned on another path, and every row with the fused ops
    off, run the layers one by one, with the same values."""
    from corellm.layers import MergedColumnParallelLinear, RMSNorm, SiluAndMul
    _force_plan(monkeypatch, (4,), ("native", "dense"))
    d = 2 * GEMM.panel
    layer = MergedColumnParallelLinear(16, [d, d])
    torch.manual_seed(0)
    layer.weight.data.normal_()
    silu_calls, normed_calls = [], []
    fused_path, linear_path = GEMM.linear_silu_mul, GEMM.linear
    monkeypatch.setattr(type(GEMM), "linear_silu_mul",
                        lambda self, *a, **k: (silu_calls.append(1), fused_path(*a, **k))[1])
    monkeypatch.setattr(type(GEMM), "linear", lambda self, *a, **k: (
        normed_calls.append(1) if k.get("norm") is not None else None, linear_path(*a, **k))[1])
    act, norm = SiluAndMul(), RMSNorm(16)            # the reference ops: the unfused layers
    norm.weight.data.uniform_(0.5, 1.5)
    for fused_ops in (False, True):
        ops = _platform_ops(torch.nn.Sequential(layer), fused_ops=fused_ops)
        assert layer.ops is ops and isinstance(ops, CpuDeviceOps)
        assert isinstance(layer.kernel, PackedLinear)
        assert layer.kernel.plan.paths == ("native", "dense")
        assert layer.kernel.packed["dense"] is None and layer.kernel.packed["native"] is not None
        assert (ops.kernels is not None) == fused_ops
        for m, native_rows in ((3, True), (9, False)):
            x = torch.randn(m, 16)
            with torch.inference_mode():
                fused = fused_ops and native_rows
                assert (ops.linear_silu_mul(layer, x) is not None) == fused
                assert (ops.linear_normed(layer, x, norm.weight, norm.eps) is not None) == fused
                assert ops.fuses_norm(layer, x) == fused
                # A residual add before the norm: a plain add, the norm left to the GEMM where
                # it fuses; else the add and the norm (ops.add_rms_norm) before the GEMM.
                r = torch.randn(m, 16)
                given, left, summed = norm.add(x, r, layer)
                torch.testing.assert_close(summed, x + r)
                if fused:
                    assert left is norm and given is summed
                else:
                    assert left is None
                    torch.testing.assert_close(given, norm(x + r))
                assert norm.add(x, None, layer)[2] is x
                silu_calls.clear(), normed_calls.clear()
                out = act.after(layer, x)
                normed = act.after(layer, x, norm)
                qkv = norm.into(layer, x)
            assert len(silu_calls) == 2 * fused and len(normed_calls) == fused
            torch.testing.assert_close(out, act(x @ layer.weight.T), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(normed, act(norm(x) @ layer.weight.T), rtol=1e-5,
                                       atol=1e-5)
            torch.testing.assert_close(qkv, norm(x) @ layer.weight.T, rtol=1e-5, atol=1e-5)
    # halves of different sizes: no SiLU inside the GEMM, but the norm still is
    uneven = MergedColumnParallelLinear(16, [d, 2 * d])
    uneven.weight.data.normal_()
    ops = _platform_ops(torch.nn.Sequential(uneven))
    assert isinstance(uneven.kernel, PackedLinear)
    x = torch.randn(3, 16)
    silu_calls.clear(), normed_calls.clear()
    with torch.inference_mode():
        out, qkv = act.after(uneven, x), norm.into(uneven, x)
    assert silu_calls == [] and len(normed_calls) == 1
    torch.testing.assert_close(out, act(x @ uneven.weight.T), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv, norm(x) @ uneven.weight.T, rtol=1e-5, atol=1e-5)
    # a row-parallel layer (its forward all-reduces) and the LM head (it gathers) are packed
    # but keep their forward: neither takes a norm inside its GEMM. An nn.Linear is not a core
    # layer: not packed.
    from corellm.layers import ParallelLMHead, RowParallelLinear
    row, head, plain = RowParallelLinear(16, 8), ParallelLMHead(40, 16), torch.nn.Linear(16, 8)
    row.weight.data.normal_(), head.weight.data.normal_()
    ops = _platform_ops(torch.nn.Sequential(row, head, plain))
    assert isinstance(row.kernel, PackedLinear) and isinstance(head.kernel, PackedLinear)
    assert row.ops is ops and head.ops is ops and getattr(plain, "kernel", None) is None
    assert not row.local_output
    normed_calls.clear()
    with torch.inference_mode():
        for linear in (row, head):
            torch.testing.assert_close(norm.into(linear, x), norm(x) @ linear.weight.T,
                                       rtol=1e-5, atol=1e-5)
    assert normed_calls == []


def test_planned_path_falls_back_to_torch_for_what_the_kernel_refuses():
    x, w, b = _case(4, 8, 16)
    packed = GEMM.pack(w)
    out = gemm._run("native", x.requires_grad_(), w, packed, b)
    assert out.requires_grad                                            # torch's, with a graph
    _check(out.detach(), x.detach(), w, b)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("path", ["native", "mkl", "onednn"])
def test_a_planned_layer_whose_weight_needs_grad_keeps_autograd(monkeypatch, path, bias):
    """Packed copies have no autograd history: a layer being trained (weight or bias that
    requires grad, grad mode on) takes torch's linear, and gets the same gradients."""
    from corellm.layers import ReplicatedLinear
    if path not in gemm.available_gemm_paths():
        pytest.skip(f"{path} path not in this torch build")
    _force_plan(monkeypatch, (1,), (path,))
    torch.manual_seed(0)
    ref = torch.nn.Linear(16, 8, bias=bias)
    layer = ReplicatedLinear(16, 8, bias=bias)
    layer.weight.data.copy_(ref.weight.data)
    layer.weight.requires_grad_(True)
    if bias:
        layer.bias.data.copy_(ref.bias.data)
        layer.bias.requires_grad_(True)
    ops = _platform_ops(torch.nn.Sequential(layer), fused_ops=False)
    assert layer.ops is ops and layer.kernel.plan.paths == (path,)
    ran = []
    run = cpu_ops_module._run
    monkeypatch.setattr(cpu_ops_module, "_run", lambda p, *a: (ran.append(p), run(p, *a))[1])
    x = torch.randn(5, 16)
    out = layer(x)
    assert out.requires_grad and ran == []         # torch's linear, not the packed copy
    out.square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
    with torch.no_grad():                          # inference: the packed path, same values
        torch.testing.assert_close(layer(x), ref(x))
    assert ran == [path]


def test_native_is_a_measured_path_with_a_compiler_and_absent_without(monkeypatch, tmp_path,
                                                                      caplog):
    assert "native" in gemm.available_gemm_paths()
    assert "native" in gemm.available_gemm_paths(torch.bfloat16)
    plan = gemm.measure_gemm_plan((48, 32), ("dense", "native"))
    assert set(plan.gflops["1"]) == {"dense", "native"}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    monkeypatch.setattr(gemm, "_native_gemm", [])
    with caplog.at_level(logging.INFO):
        assert "native" not in gemm.available_gemm_paths()
    assert "native GEMM unavailable" in caplog.text
