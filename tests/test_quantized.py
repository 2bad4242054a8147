"""Quantized weights (corellm/quant.py) and the CPU platform's kernels for them
(plugins/platform_cpu/quant_gemm.c through ``corellm_plugins.platform_cpu.qlinear``).

* ``dequantize``, the torch reference every kernel is held to, equals the ``gguf`` library's own
  dequantizers bit for bit on every GGUF format kept quantized, random blocks and edge cases
  (all-zero blocks, fp16 max and subnormal scales, negative scales) alike.
* The kernels' ``x @ W.T + bias`` is within a bound derived from the format: the GGUF formats
  round the activations to int8 per 32-value block (scale ``amax / 127``, perhaps rounded to
  fp16 as llama.cpp does), so each activation is off by at most half a step, and the output by
  at most that error weighted by ``|W|``, plus float32 accumulation (and 2^-11 of the offsets'
  terms, whose activation sums may be rounded to fp16 too); int8 (weight-only) only the
  accumulation. Activations in the thousands give finite results within the same bound. A
  tighter check holds the output to activations rounded exactly as described. Every row of
  the output is the same bits whatever the batch around it and however many threads run it.
* ``quantize_int8``, ``QuantizedTensor.narrow`` and ``QuantizedWeight.embed``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from corellm.quant import (GGUF_FORMATS, GROUPABLE, INTERLEAVABLE, QuantizedTensor,
                           QuantizedWeight, dequantize, quantize_int8)
from tests.cpu_threads import cpu_threads

GGUF = list(GGUF_FORMATS)
# Byte offsets, within one block, of each format's fp16 fields (d, and m / dmin) and of its
# quantized values (zeroed, a block dequantizes to its offsets alone: Q4_0's -8d, Q4_1's m, a
# k-quant's -dmin*min, Q6_K's -32*d*scale).
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}
QUANT_BYTES = {"Q8_0": (2, 34), "Q4_0": (2, 18), "Q4_1": (4, 20), "Q4_K": (16, 144),
               "Q5_K": (16, 176), "Q6_K": (0, 192)}
# fp16 scales at the edges: the largest finite, the smallest subnormal, the largest subnormal,
# the smallest normal, negative ones, zero (with nonzero quantized values).
EDGE_SCALES = (65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 1023 * 2.0 ** -24, 2.0 ** -14,
               -(2.0 ** -14), 0.0, -1.0, 0.5)
ACT_BLOCK = 32    # values per activation scale: llama.cpp's q8_0 / q8_1 blocks
KQ_ACT_BLOCK = 256   # and its q8_K super-blocks, which the k-quants multiply


def _act_block(q: QuantizedWeight) -> int:
    """The most values one activation scale covers in ``q``'s kernels."""
    return max(KQ_ACT_BLOCK if GGUF_FORMATS[t.qtype].block == 256 else ACT_BLOCK
               for _, t in q.parts)


# --------------------------------------------------------------------------------- helpers
def _random_fp16_bits(gen: torch.Generator, n: int) -> torch.Tensor:
    """n random finite fp16 values' bits (any sign, normal or subnormal): no NaN, no inf."""
    bits = torch.randint(0, 1 << 16, (n,), generator=gen, dtype=torch.int32)
    inf_nan = (bits & 0x7C00) == 0x7C00
    return torch.where(inf_nan, bits & ~0x4000, bits).to(torch.int16)


def _fp16_bits(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.int16)


def _set_fp16(blocks: torch.Tensor, offset: int, bits: torch.Tensor) -> None:
    """blocks uint8 [B, type_size]: the fp16 field at ``offset`` of each block := bits [B]."""
    blocks[:, offset:offset + 2] = bits.reshape(-1, 1).view(torch.uint8)


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0, scales: str = "normal",
            zero_rows: tuple[int, ...] = ()) -> QuantizedTensor:
    """A [rows, cols] tensor of random blocks: random bytes, the fp16 fields overwritten with
    finite values; ``scales`` "normal" (about the size of a model's, either sign), "wild" (any
    finite fp16) or "edge" (drawn from EDGE_SCALES, the first block all zero bytes)."""
    fmt = GGUF_FORMATS[qtype]
    gen = torch.Generator().manual_seed(seed)
    nblk = rows * (cols // fmt.block)
    blocks = torch.randint(0, 256, (nblk, fmt.type_size), generator=gen, dtype=torch.uint8)
    for off in FP16_FIELDS[qtype]:
        if scales == "normal":
            bits = _fp16_bits(torch.randn(nblk, generator=gen) * 0.01)
        elif scales == "wild":
            bits = _random_fp16_bits(gen, nblk)
        else:
            pick = torch.randint(0, len(EDGE_SCALES), (nblk,), generator=gen)
            bits = _fp16_bits(torch.tensor(EDGE_SCALES, dtype=torch.float64)[pick])
        _set_fp16(blocks, off, bits)
    data = blocks.reshape(rows, fmt.row_bytes(cols))
    if scales == "edge":
        data[0, :fmt.type_size] = 0
    for r in zero_rows:
        data[r] = 0
    return QuantizedTensor(data.contiguous(), qtype, cols)


def _gguf_dequantize(t: QuantizedTensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    out = gguf_dequantize(t.data.numpy(), GGMLQuantizationType[t.qtype])
    return np.asarray(out, dtype=np.float64).reshape(t.shape)


def _offsets(t: QuantizedTensor) -> torch.Tensor:
    """float64 [rows, cols]: |c| for each value w = s * u + c (the format's scale times its
    unsigned quantized value, plus its offset: Q4_0's -8d, Q4_1's m, a k-quant's -dmin*min,
    Q6_K's -32*d*scale; none for Q8_0 and int8): the blocks with their quantized values zeroed."""
    if t.qtype in ("int8", "Q8_0"):
        return torch.zeros(t.shape, dtype=torch.float64)
    t = t.ungrouped()                 # the file's byte layout (the CPU kernels regroup Q4_x)
    blocks = t.data.reshape(t.shape[0], -1, t.format.type_size).clone()
    lo, hi = QUANT_BYTES[t.qtype]
    blocks[..., lo:hi] = 0
    offsets = dequantize(QuantizedTensor(blocks.reshape(t.data.shape), t.qtype, t.cols))
    return offsets.double().abs()


def _weight_ref(q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight's values, float64 [rows, cols]; its offsets' magnitudes |c| (``_offsets``);
    and at least |s * u| + |c| for each value, which the kernels sum separately (|w| + 2|c|)."""
    w = q.dequantize().double()
    offs = torch.cat([_offsets(t) for _, t in q.parts])
    return w, offs, w.abs() + 2 * offs


FP16_ULP_MIN = 2.0 ** -24          # fp16's subnormal spacing


def _act_error(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """float64 [M, K]: how far an activation may move when rounded to int8 (|q| <= 127) in its
    block of ``block`` values: half a step d = amax / 127; and with the step rounded to fp16 (by
    at most 2^-11 of itself, or half fp16's subnormal spacing; the q8_0 / q8_1 blocks' scales),
    that rounding times |q|."""
    xd = x.double()
    m, k = xd.shape
    amax = xd.abs().reshape(m, k // block, block).amax(-1)
    half_step = (0.5 * amax / 127 * (1 + 2.0 ** -10)).repeat_interleave(block, 1)
    return (half_step + (2.0 ** -11 + 1e-6) * (xd.abs() + half_step)
            + 127 * FP16_ULP_MIN / 2)


ACC = 1e-5        # float32 accumulation, relative to the sum of the terms' magnitudes


def _check_gguf(y: torch.Tensor, x: torch.Tensor, q: QuantizedWeight,
                bias: torch.Tensor | None, what: str) -> None:
    """|y - (x @ W.T + bias)| <= sum_k |W[n, k]| err[m, k] + float32 accumulation, elementwise,
    all in float64 from the actual x and W; and where the offsets' terms (sum_k c_k a_k, from
    the blocks' sums of activations) see the activations with a scale or a sum rounded to fp16
    where the scales' terms do not (llama.cpp's block_q8_1 keeps its sum in fp16), 2^-11 of
    each such activation, twice, times |c|."""
    w, offs, mag = _weight_ref(q)
    xd, err = x.double(), _act_error(x, _act_block(q))
    b = torch.zeros(q.rows, dtype=torch.float64) if bias is None else bias.double()
    ref = xd @ w.T + b
    xa = xd.abs() + err
    bound = (err @ w.abs().T + 2.0 ** -10 * xa @ offs.T + ACC * (xa @ mag.T + b.abs())
             + 1e-30)
    assert y.dtype == torch.float32 and y.shape == ref.shape, (what, y.dtype, y.shape)
    bad = ~torch.isfinite(y)
    if bad.any():
        m, n = (int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {y.numel()} outputs not finite (rows "
            f"{sorted(set(bad.nonzero()[:, 0].tolist()))}); y[{m}, {n}] = {y[m, n].item()!r}, "
            f"reference {ref[m, n].item()!r}")
    excess = (y.double() - ref).abs() - bound
    if (excess > 0).any():
        m, n = np.unravel_index(int(excess.argmax()), tuple(excess.shape))
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} outputs out of bound; "
            f"worst y[{m}, {n}] = {y[m, n].item()!r}, reference {ref[m, n].item()!r}, "
            f"|diff| {abs(y[m, n].item() - ref[m, n].item()):.6g} > bound "
            f"{bound[m, n].item():.6g}")


def _check_int8(y: torch.Tensor, x: torch.Tensor, q: QuantizedWeight,
                bias: torch.Tensor | None, what: str) -> None:
    """Weight-only: float32 accumulation error alone."""
    w = q.dequantize().double()
    xd = x.double()
    b = torch.zeros(q.rows, dtype=torch.float64) if bias is None else bias.double()
    ref = xd @ w.T + b
    bound = ACC * (xd.abs() @ w.abs().T + b.abs()) + 1e-30
    assert y.dtype == torch.float32 and y.shape == ref.shape, (what, y.dtype, y.shape)
    diff = (y.double() - ref).abs()
    worst = int((diff - bound).argmax())
    m, n = divmod(worst, ref.shape[1])
    assert (diff <= bound).all(), (
        f"{what}: worst y[{m}, {n}] = {y[m, n].item()!r}, reference {ref[m, n].item()!r}, "
        f"|diff| {diff[m, n].item():.6g} > bound {bound[m, n].item():.6g}")


@pytest.fixture(scope="module", params=["native", "portable"])
def kernels(request):
    """This CPU's build (AVX2 / VNNI paths where it has them) and the plain-C build a CPU
    without them gets."""
    from corellm_plugins.platform_cpu.qlinear import quant_kernels
    k = quant_kernels(portable=request.param == "portable")
    if k is None:
        pytest.skip("no C compiler on this machine: quant_gemm.c's kernels did not build "
                    "(quant_kernels() is None)")
    return k


def _run(kernels, q: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None,
         threads: int) -> torch.Tensor:
    with cpu_threads(threads):
        return kernels.linear(q, x, bias)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(1000 + seed))


# ----------------------------------------------------------------- dequantize against gguf
@pytest.mark.parametrize("scales", ["wild", "normal", "edge"])
@pytest.mark.parametrize("rows,nblocks", [(1, 1), (1, 3), (7, 1), (7, 3)])
@pytest.mark.parametrize("qtype", GGUF)
def test_dequantize_matches_gguf(qtype, rows, nblocks, scales):
    """The torch reference computes in float32 like ggml: the same bits as gguf's numpy."""
    cols = nblocks * GGUF_FORMATS[qtype].block
    t = _blocks(qtype, rows, cols, seed=rows * 10 + nblocks, scales=scales)
    ours = dequantize(t).double().numpy()
    ref = _gguf_dequantize(t)
    assert ours.shape == ref.shape == (rows, cols)
    assert np.isfinite(ref).all()
    diff = np.abs(ours - ref)
    assert (diff == 0).all(), (
        f"{qtype}: {int((diff > 0).sum())} values differ, max |diff| {diff.max():.6g} at "
        f"{np.unravel_index(diff.argmax(), diff.shape)}")
    # the float64 output is the float32 values widened
    assert torch.equal(dequantize(t, torch.float64), dequantize(t).double())


@pytest.mark.parametrize("qtype", GGUF)
def test_dequantize_all_zero_blocks(qtype):
    cols = 2 * GGUF_FORMATS[qtype].block
    t = QuantizedTensor(torch.zeros(3, GGUF_FORMATS[qtype].row_bytes(cols), dtype=torch.uint8),
                        qtype, cols)
    assert torch.equal(dequantize(t), torch.zeros(3, cols))
    assert (_gguf_dequantize(t) == 0).all()


@pytest.mark.parametrize("qtype", GGUF)
def test_dequantize_extreme_scales_stay_finite(qtype):
    """Every fp16 field at +-65504 and every quantized byte at its most: finite values, equal
    to gguf's."""
    fmt = GGUF_FORMATS[qtype]
    for sign in (1.0, -1.0):
        for fill in (0xFF, 0x80, 0x7F):
            blocks = torch.full((2, fmt.type_size), fill, dtype=torch.uint8)
            for off in FP16_FIELDS[qtype]:
                _set_fp16(blocks, off, _fp16_bits(torch.tensor([sign * 65504.0] * 2)))
            t = QuantizedTensor(blocks.reshape(1, -1).contiguous(), qtype, 2 * fmt.block)
            ours = dequantize(t).double().numpy()
            assert np.isfinite(ours).all() and np.abs(ours).max() > 0
            assert (ours == _gguf_dequantize(t)).all(), (qtype, sign, hex(fill))


# ---------------------------------------------------------------------- kernels vs reference
MS = (1, 2, 3, 4, 5, 7, 9, 14, 33)  # the kernels tile activation rows by 4 or 8


@pytest.mark.parametrize("n,kblocks", [(7, 1), (257, 3)], ids=["N7-K1blk", "N257-Kbig"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("qtype", GGUF)
def test_gguf_kernel_within_activation_rounding(kernels, qtype, m, n, kblocks):
    """x @ W.T (+ bias) within the bound of int8 activations, on 1 and 2 pool threads (the
    same bits), with and without a bias. K: one block, or 768 (24 blocks of 32 / 3 of 256)."""
    fmt = GGUF_FORMATS[qtype]
    k = fmt.block if kblocks == 1 else 768
    q = QuantizedWeight([(0, _blocks(qtype, n, k, seed=m + n, zero_rows=(n // 2,)))])
    x = _x(m, k, seed=m * 7 + n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)) * 0.1
    y1 = _run(kernels, q, x, bias, threads=1)
    _check_gguf(y1, x, q, bias, f"{qtype} M={m} N={n} K={k} bias, 1 thread")
    y2 = _run(kernels, q, x, bias, threads=2)
    assert torch.equal(y1, y2), f"{qtype} M={m} N={n} K={k}: 1 and 2 threads differ"
    # an all-zero row of blocks gives exactly the bias
    assert torch.equal(y1[:, n // 2], bias[n // 2].expand(m)), (qtype, m, n, k)
    y0 = _run(kernels, q, x, None, threads=2)
    _check_gguf(y0, x, q, None, f"{qtype} M={m} N={n} K={k} no bias, 2 threads")
    assert (y0[:, n // 2] == 0).all()


@pytest.mark.parametrize("scales", ["wild", "edge"])
@pytest.mark.parametrize("qtype", GGUF)
def test_gguf_kernel_extreme_scales(kernels, qtype, scales):
    """Any finite fp16 weight scales (65504, subnormal, negative, zero), and activations from
    block to block from 1e-5 (an fp16 activation scale is subnormal there) to 1e3, a zero
    activation block and a zero activation row."""
    k = 512 if GGUF_FORMATS[qtype].block == 256 else 256
    q = QuantizedWeight([(0, _blocks(qtype, 19, k, seed=5, scales=scales))])
    x = _x(6, k, seed=3) * torch.logspace(-5, 3, k // ACT_BLOCK).repeat_interleave(ACT_BLOCK)
    x[1, 32:64] = 0
    x[4] = 0
    bias = torch.randn(19, generator=torch.Generator().manual_seed(9))
    for threads in (1, 2):
        y = _run(kernels, q, x, bias, threads)
        _check_gguf(y, x, q, bias, f"{qtype} {scales} scales, {threads} threads")
        assert torch.equal(y[4], bias), (qtype, scales, "a zero activation row gives the bias")


@pytest.mark.parametrize("qtype", GGUF)
def test_gguf_kernel_large_activations(kernels, qtype):
    """Activations in the thousands (a model's outlier channels): one block of 32 values of
    about 4000, of one sign (its sum, 1.3e5, is past fp16's 65504, though its step, 31, is far
    inside it), beside ordinary ones. The result is finite and within the bound."""
    k = 256
    q = QuantizedWeight([(0, _blocks(qtype, 13, k, seed=7))])
    x = _x(3, k, seed=7)
    x[0, 64:96] = 4000 + 100 * x[0, 64:96]
    x[1, :32] = -(3000 + 100 * x[1, :32].abs())
    x[2, 96:128] *= 3000                                   # mixed signs: a small sum
    y = _run(kernels, q, x, None, 2)
    _check_gguf(y, x, q, None, f"{qtype}, a block of activations ~4000")


def _simulated_int8_activations(x: torch.Tensor, fp16_scale: bool,
                                block: int = ACT_BLOCK) -> torch.Tensor:
    """The activations as the kernels round them, float64 [M, K]: per block of ``block``
    values d = amax / 127 in float32, q = round-half-even(x * (127 / amax)) (0 for an all-zero
    block), d * q with d rounded to fp16 or not."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(d > 0, 127 / amax, torch.zeros_like(amax))
    qv = torch.round(xb * inv)
    if fp16_scale:
        d = d.half()
    return (qv.double() * d.double()).reshape(m, k)


@pytest.mark.parametrize("qtype", GGUF)
def test_gguf_kernel_matches_simulated_int8_activations(kernels, qtype):
    """Tighter: against the activations rounded as the kernels round them (scale amax / 127
    per 32 values, in float32 or rounded to fp16: whichever the build does; the k-quants' per
    256 values, in float32, as llama.cpp's q8_K), the output is off by float32 accumulation
    alone, plus the offsets' terms' fp16 rounding (``_check_gguf``)."""
    k = 768
    q = QuantizedWeight([(0, _blocks(qtype, 33, k, seed=11))])
    x = _x(9, k, seed=4)
    bias = torch.randn(33, generator=torch.Generator().manual_seed(3))
    y = _run(kernels, q, x, bias, 2).double()
    w, offs, mag = _weight_ref(q)
    block = _act_block(q)
    err = _act_error(x, block)
    xa = x.double().abs() + err
    worst = []
    for fp16_scale in (False,) if block == KQ_ACT_BLOCK else (False, True):
        xq = _simulated_int8_activations(x, fp16_scale, block)
        assert ((xq - x.double()).abs() <= err).all()
        ref = xq @ w.T + bias.double()
        bound = ACC * (xa @ mag.T + bias.double().abs()) + 2.0 ** -10 * xa @ offs.T
        diff = (y - ref).abs()
        if (diff <= bound).all():
            return
        worst.append((fp16_scale, diff.max().item(), (diff / bound).max().item()))
    raise AssertionError(f"{qtype}: neither rounding of the activations' scale gives the "
                         f"kernel's output (fp16 scale, max |diff|, max diff/bound): {worst}")


@pytest.mark.parametrize("qtype", [*GGUF, "int8"])
def test_rows_do_not_depend_on_the_batch(kernels, qtype):
    """Row m of a batch of 13 (tiles of 8 and 5, or of 4, 4, 4 and 1) is the same bits as row m
    alone, in the interleaved kernels' groups of 8 output columns and in the 1 column after
    them."""
    k = 512
    if qtype == "int8":
        t = quantize_int8(torch.randn(41, k, generator=torch.Generator().manual_seed(6)))
    else:
        t = _blocks(qtype, 41, k, seed=6)
    q = QuantizedWeight([(0, t)])
    x = _x(13, k, seed=6)
    bias = torch.randn(41, generator=torch.Generator().manual_seed(6))
    for threads in (1, 2):
        batch = _run(kernels, q, x, bias, threads)
        for m in range(13):
            alone = _run(kernels, q, x[m:m + 1].clone(), bias, threads)
            assert torch.equal(alone[0], batch[m]), (
                f"{qtype}, {threads} threads: row {m} alone differs from row {m} of 13 by up to "
                f"{(alone[0] - batch[m]).abs().max().item():.6g}")
        # and inside other batches: the first 5 rows, the last 4
        assert torch.equal(_run(kernels, q, x[:5].clone(), bias, threads), batch[:5])
        assert torch.equal(_run(kernels, q, x[5:].clone(), bias, threads), batch[5:])


@pytest.mark.parametrize("qtype", INTERLEAVABLE)
def test_interleaved_kernels_without_vnni_give_the_same_bits(qtype):
    """The interleaved kernels built for a CPU with AVX2 but neither AVX-512 nor VNNI (byte
    products through vpmaddubsw + vpmaddwd, Q8_0's signs moved onto the activations, tiles of
    4 rows) give this CPU's build's results bit for bit: the same integers, then the same float
    operations per output element."""
    from corellm_plugins.platform_cpu import native
    from corellm_plugins.platform_cpu.qlinear import _SOURCE, QuantKernels, quant_kernels
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2: only the plain-C build runs here")
    here = quant_kernels()
    avx2 = QuantKernels(native.load_library("corellm_quant_gemm_avx2_only", _SOURCE,
                                            ("-mno-avx512f", "-mno-avxvnni")))
    for m in (1, 3, 8, 13):
        q = QuantizedWeight([(0, _blocks(qtype, 24, 512, seed=m))])
        x = _x(m, 512, seed=m)
        assert torch.equal(here.linear(q, x, None), avx2.linear(q, x, None)), (qtype, m)


def test_multi_part_weight_columns_land_in_place(kernels):
    """A merged projection whose parts came in different formats (Q8_0 rows, Q4_K rows, Q6_K
    rows, given out of order): each part's outputs land in its columns, with its bias."""
    k = 512
    parts = [(12, _blocks("Q6_K", 7, k, seed=3)), (0, _blocks("Q8_0", 3, k, seed=1)),
             (3, _blocks("Q4_K", 9, k, seed=2))]
    q = QuantizedWeight(parts)
    assert q.qtypes == ("Q8_0", "Q4_K", "Q6_K") and (q.rows, q.cols) == (19, k)
    x = _x(6, k, seed=8)
    bias = torch.randn(19, generator=torch.Generator().manual_seed(8))
    for threads in (1, 2):
        y = _run(kernels, q, x, bias, threads)
        _check_gguf(y, x, q, bias, f"Q8_0+Q4_K+Q6_K, {threads} threads")
        for start, t in parts:
            n = t.shape[0]
            alone = _run(kernels, QuantizedWeight([(0, t)]), x, bias[start:start + n], threads)
            assert torch.equal(y[:, start:start + n], alone), (t.qtype, start, threads)


def test_multi_part_weight_with_an_int8_part(kernels):
    k = 256
    w8 = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    parts = [(0, _blocks("Q4_K", 4, k, seed=4)), (4, quantize_int8(w8))]
    q = QuantizedWeight(parts)
    x = _x(3, k, seed=2)
    bias = torch.randn(9, generator=torch.Generator().manual_seed(1))
    y = _run(kernels, q, x, bias, 2)
    _check_gguf(y[:, :4], x, QuantizedWeight(parts[:1]), bias[:4], "Q4_K part")
    _check_int8(y[:, 4:], x, QuantizedWeight([(0, parts[1][1])]), bias[4:], "int8 part")


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_fused_norm_and_silu_equal_the_layers_one_by_one(kernels, qtype, m):
    """``QuantLinear.fused``: RMSNorm before the layer and SiLU-and-multiply after it, inside
    one C call, are the CPU platform's own element-wise kernels (cpu_ops.c), so the result is
    the three calls' bit for bit, on 1 and 2 threads, with and without a bias."""
    from corellm_plugins.platform_cpu.kernels import cpu_ops
    ops = cpu_ops()
    if ops is None:
        pytest.skip("no C compiler: cpu_ops.c did not build")
    kernels.use_neighbours(*ops.float32_addresses())
    k, n = 512, 2 * 19
    plan = kernels.plan(QuantizedWeight([(0, _blocks(qtype, n, k, seed=m))]))
    assert plan.fusable
    x = _x(m, k, seed=m + 1) * 3
    norm_w = torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for threads in (1, 2):
        with cpu_threads(threads):
            for b in (None, bias):
                normed = ops.rms_norm(x, norm_w, 1e-5)
                assert torch.equal(plan.fused(x, b, (norm_w, 1e-5)), plan(normed, b))
                both = plan.fused(x, b, (norm_w, 1e-5), silu_mul=True)
                assert both.shape == (m, n // 2)
                assert torch.equal(both, ops.silu_and_mul(plan(normed, b)))
                assert torch.equal(plan.fused(x, b, None, silu_mul=True),
                                   ops.silu_and_mul(plan(x, b)))
                wide = torch.cat([x, x], 1)[:, :k]              # rows k + k apart
                assert torch.equal(plan.fused(wide, b, (norm_w, 1e-5)), plan(normed, b))


def test_layers_learn_their_successors_and_hand_them_to_the_pool(kernels):
    """Each layer learns the layer called after it (weakly: it keeps none alive) and, once the
    order is known, hands the pool the heads of the next layers, up to WARM_RANGES ranges and
    WARM_BYTES, after each call; ``prefetch = False`` hands nothing. Outputs are the same."""
    import gc

    from corellm_plugins.platform_cpu.qlinear import QuantLinear
    QuantLinear._last = None
    layers = [kernels.plan(QuantizedWeight([(0, _blocks(q, 64, 512, seed=i))]))
              for i, q in enumerate(["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q4_0"])]
    x = _x(1, 512, seed=1)
    first = [layer(x, None) for layer in layers]
    assert [layer.next for layer in layers] == [*layers[1:], None]
    assert layers[0]._follow()[1] == 4                     # the next 4 layers, whole
    flat, n = layers[0]._warm
    assert [(flat[2 * i], flat[2 * i + 1]) for i in range(n)] == [lay.head for lay in layers[1:]]
    assert layers[-1].next is layers[0]                      # the order wraps round
    assert all(torch.equal(a, layer(x, None)) for a, layer in zip(first, layers))
    QuantLinear.WARM_BYTES, old = layers[2].head[1] + 100, QuantLinear.WARM_BYTES
    try:
        QuantLinear._last, layers[1]._warm = None, None
        flat, n = layers[1]._follow()
        assert n == 2 and (flat[1], flat[3]) == (layers[2].head[1], 100)   # capped in bytes
    finally:
        QuantLinear.WARM_BYTES = old
    layers[0].prefetch = False
    assert layers[0]._follow() == (None, 0)
    ref = layers.pop(2)._ref
    del first
    gc.collect()
    assert ref() is None and layers[1].next is None          # nothing kept it alive
    QuantLinear._last = None


def test_fused_declines_a_multi_part_weight(kernels):
    """A weight in parts of different formats runs one call per part: not fusable (the
    platform then runs the norm and SiLU as their own layers)."""
    q = QuantizedWeight([(0, _blocks("Q8_0", 4, 256, seed=1)), (4, _blocks("Q4_K", 4, 256))])
    assert not kernels.plan(q).fusable
    assert not kernels.plan(QuantizedWeight([(0, quantize_int8(torch.randn(4, 64)))])).fusable


@pytest.mark.parametrize("n", [7, 257])
@pytest.mark.parametrize("k", [1, 16, 45, 300])
@pytest.mark.parametrize("m", MS)
def test_int8_kernel_float32_accumulation(kernels, m, n, k):
    """Weight-only int8: float activations, float32 accumulation error alone; K not a multiple
    of the vector width (45, 300) included; an all-zero weight row gives exactly the bias."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(m * 31 + k))
    w[n // 2] = 0
    q = QuantizedWeight([(0, quantize_int8(w))])
    x = _x(m, k, seed=m + k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    y1 = _run(kernels, q, x, bias, 1)
    _check_int8(y1, x, q, bias, f"int8 M={m} N={n} K={k}, 1 thread")
    assert torch.equal(y1, _run(kernels, q, x, bias, 2)), (m, n, k, "1 and 2 threads differ")
    assert torch.equal(y1[:, n // 2], bias[n // 2].expand(m))
    _check_int8(_run(kernels, q, x, None, 2), x, q, None, f"int8 M={m} N={n} K={k} no bias")


def test_int8_kernel_strided_activations(kernels):
    """A column slice of a wider activation (rows ldx apart) reads the right values."""
    k = 45
    q = QuantizedWeight([(0, quantize_int8(torch.randn(11, k)))])
    wide = _x(5, 3 * k, seed=1)
    x = wide[:, k:2 * k]
    assert x.stride(0) == 3 * k
    y = _run(kernels, q, x, None, 2)
    _check_int8(y, x, q, None, "int8 strided x")
    assert torch.equal(y, _run(kernels, q, x.contiguous(), None, 2))


# -------------------------------------------------------------------------- quantize_int8
def test_quantize_int8_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(9, 45, generator=gen) * torch.logspace(-4, 3, 9).unsqueeze(1)
    w[3] = 0
    w[5, 7] = -w[5].abs().max() * 2          # the row's amax on a negative value
    t = quantize_int8(w)
    assert t.qtype == "int8" and t.shape == (9, 45)
    assert t.data.dtype == torch.int8 and t.scale.dtype == torch.float32
    assert t.data.abs().max() <= 127
    amax = w.abs().amax(1)
    nonzero = amax > 0
    assert torch.equal(t.scale[nonzero], amax[nonzero] / 127)
    assert (t.data.abs().amax(1)[nonzero] == 127).all()        # each row's amax maps to +-127
    assert t.data[5, 7] == -127
    err = (t.dequantize().double() - w.double()).abs()
    bound = t.scale.double().unsqueeze(1) / 2 * (1 + 1e-6) + 1e-7 * w.double().abs()
    assert (err <= bound).all(), (err / bound).max().item()
    # an all-zero row: zeros, scale 1
    assert t.scale[3].item() == 1.0 and (t.data[3] == 0).all()
    assert (t.dequantize()[3] == 0).all()
    assert torch.equal(dequantize(t, torch.float64), t.dequantize().double())


# ------------------------------------------------------------------------------------ narrow
@pytest.mark.parametrize("qtype", GGUF)
def test_narrow_columns_on_block_boundaries(qtype):
    block = GGUF_FORMATS[qtype].block
    t = _blocks(qtype, 5, 3 * block, seed=2)
    full = t.dequantize()
    for start, size in ((0, block), (block, block), (block, 2 * block), (0, 3 * block)):
        part = t.narrow(1, start, size)
        assert part.shape == (5, size) and part.qtype == qtype
        assert torch.equal(part.dequantize(), full[:, start:start + size]), (start, size)
    rows = t.narrow(0, 1, 3)
    assert torch.equal(rows.dequantize(), full[1:4])
    assert torch.equal(t.narrow(0, 1, 3).narrow(1, block, block).dequantize(),
                       full[1:4, block:2 * block])


@pytest.mark.parametrize("qtype", GGUF)
def test_narrow_columns_off_block_boundaries_raises(qtype):
    block = GGUF_FORMATS[qtype].block
    t = _blocks(qtype, 2, 3 * block, seed=3)
    for start, size in ((1, block), (0, block + 1), (block // 2, block), (block, 16),
                        (block + 8, 2 * block - 8)):
        with pytest.raises(ValueError, match=rf"{qtype}.*{block}-value blocks") as info:
            t.narrow(1, start, size)
        assert f"{start}:{start + size}" in str(info.value)


def test_narrow_int8_columns_anywhere():
    w = torch.randn(4, 45, generator=torch.Generator().manual_seed(1))
    t = quantize_int8(w)
    part = t.narrow(1, 3, 10)
    assert torch.equal(part.dequantize(), t.dequantize()[:, 3:13])
    assert torch.equal(t.narrow(0, 1, 2).dequantize(), t.dequantize()[1:3])


# ------------------------------------------------------------------------------------- embed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_equals_dequantized_rows(dtype):
    k = 256
    q = QuantizedWeight([(5, _blocks("Q6_K", 7, k, seed=1)), (0, _blocks("Q4_K", 5, k, seed=2)),
                         (12, quantize_int8(torch.randn(3, k)))])
    assert q.qtypes == ("Q4_K", "Q6_K", "int8") and q.rows == 15
    full = q.dequantize(dtype)
    ids = torch.tensor([[0, 4, 5, 11], [14, 12, 4, 4], [7, 0, 13, 6]])
    out = q.embed(ids, dtype)
    assert out.shape == (3, 4, k) and out.dtype == dtype
    assert torch.equal(out, full[ids])
    assert torch.equal(q.embed(torch.tensor([3]), dtype), full[3:4])
    assert q.embed(torch.tensor([], dtype=torch.long), dtype).shape == (0, k)


@pytest.mark.parametrize("qtype", GGUF)
def test_embed_single_format(qtype):
    k = GGUF_FORMATS[qtype].block * 2
    q = QuantizedWeight([(0, _blocks(qtype, 9, k, seed=4, scales="wild"))])
    ids = torch.tensor([8, 0, 3, 3, 7])
    assert torch.equal(q.embed(ids, torch.float32), q.dequantize()[ids])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("nblocks", [1, 7, 8, 18, 19])
def test_grouped_layout_is_the_same_bytes_reordered(qtype, nblocks):
    """The grouped layout (8 blocks' scales together, then their values; the last run shorter)
    round-trips to the file's bytes, and dequantizes, looks up rows and narrows as the file's."""
    t = _blocks(qtype, 5, 32 * nblocks, seed=nblocks)
    g = t.grouped()
    assert g.layout == "grouped" and g.data.shape == t.data.shape
    assert torch.equal(g.ungrouped().data, t.data)
    assert torch.equal(g.dequantize(), t.dequantize())
    idx = torch.tensor([4, 0, 4])
    assert torch.equal(g.rows(idx).dequantize(), t.dequantize()[idx])
    assert torch.equal(g.narrow(1, 0, 32).dequantize(), t.dequantize()[:, :32])
    if nblocks >= 2:      # run 0: block 1's scale follows block 0's
        size = t.format.type_size
        assert torch.equal(g.data[:, 2:4], t.data[:, size:size + 2])


@pytest.mark.parametrize("qtype", INTERLEAVABLE)
@pytest.mark.parametrize("rows", [3, 8, 21])
def test_interleaved_layout_is_the_same_bytes_reordered(qtype, rows):
    """The interleaved layout (rows in groups of 8, each block's 8 scales side by side, the
    values 4 bytes of each row in turn; the rows after the last whole group grouped or as they
    are) round-trips to the file's bytes, dequantizes, looks up rows (in a group, in the rest,
    both at once) and narrows as the file's, and merges with an adjacent part only where both
    hold whole groups."""
    block = GGUF_FORMATS[qtype].block
    t = _blocks(qtype, rows, block * 3, seed=rows)
    x = t.interleaved()
    assert x.layout == "interleaved" and x.data.shape == t.data.shape
    assert x.interleaved() is x
    assert torch.equal(x.ungrouped().data, t.data)
    assert torch.equal(x.grouped().dequantize() if qtype in GROUPABLE else x.dequantize(),
                       t.dequantize())
    idx = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(x.rows(idx).data, t.data[idx])
    for start, size in [(0, min(rows, 8)), (rows - 2, 2), (1, rows - 1)]:
        assert torch.equal(x.narrow(0, start, size).dequantize(),
                           t.dequantize()[start:start + size]), (start, size)
    assert torch.equal(x.narrow(1, block, block).dequantize(),
                       t.dequantize()[:, block:2 * block])
    if rows >= 8:       # the group's first block opens with its 8 rows' fp16 scales
        d = 208 if qtype == "Q6_K" else 0                 # Q6_K's d ends its block
        assert torch.equal(x.data.reshape(-1)[:16], t.data[:8, d:d + 2].reshape(-1))
    other = _blocks(qtype, 8, block * 3, seed=99).interleaved()
    merged = QuantizedWeight([(0, x), (rows, other)])
    assert len(merged.parts) == (1 if rows % 8 == 0 else 2)
    assert torch.equal(merged.dequantize(), torch.cat([t.dequantize(), other.dequantize()]))
    assert torch.equal(merged.embed(torch.tensor([rows + 7, 2]), torch.float32),
                       merged.dequantize()[[rows + 7, 2]])


@pytest.mark.parametrize("rows", [16, 21])
def test_interleaved_rows_index_as_the_file_layout_does(rows):
    """An interleaved tensor's rows (and a weight's embedding lookup) take ids counted from the
    end, and refuse ids past either end with indexing's IndexError, whole groups only or with
    rows after them."""
    t = _blocks("Q8_0", rows, 64, seed=rows)
    x = t.interleaved()
    ids = torch.tensor([-1, -rows, 0, rows - 1])
    assert torch.equal(x.rows(ids).data, t.data[ids])
    q = QuantizedWeight([(0, x)])
    assert torch.equal(q.embed(ids, torch.float32), t.dequantize()[ids])
    for bad in (rows, rows + 7, 1000, -rows - 1):
        with pytest.raises(IndexError):
            t.rows(torch.tensor([bad]))
        with pytest.raises(IndexError):
            x.rows(torch.tensor([3, bad]))
        with pytest.raises(IndexError):
            q.embed(torch.tensor([bad]), torch.float32)
