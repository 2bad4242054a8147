"""The CUDA platform's element-wise kernels (``platform.triton_ops``): RMSNorm, the residual add
fused with RMSNorm, SiLU-and-multiply, RoPE, and Qwen3's per-head q/k RMSNorm fused with RoPE,
one Triton kernel each where the reference (``corellm.ops.REFERENCE_OPS``) launches
several (RMSNorm alone is eight: the float32 copy, the square, the mean, the add, the rsqrt, the
product, the cast and the weight). Each computes in float32 and rounds once to the input's dtype,
where the reference rounds after each step, so a bf16 result may differ from the reference's by
one unit in the last place; float32 results agree to float32 rounding.

The kernels run on the CUDA device, and on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how they are checked on a machine without a GPU. Inputs the
kernels do not take (a non-contiguous last dimension, a dtype outside float32 / bfloat16 /
float16) fall back to the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from corellm.ops import DeviceOps

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference's rounding: normalized, rounded to the dtype, then times the weight
    # (rounded once more).
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, stride_x, stride_r, stride_y,
                         stride_s, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum rounded to the dtype (the next residual), normalized as it was rounded.
    summed = (x + r).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * stride_s + cols, summed, mask=mask)
    v = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (v * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, D, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_table,
                   H, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates the first ``2 * HALF`` dimensions of every head of one token, in place."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < H) & (d < HALF)
    c = tl.load(cos_ptr + pos * stride_table + d)
    s = tl.load(sin_ptr + pos * stride_table + d)
    base = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_normed_kernel(x_ptr, pos_ptr, w_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh,
                          stride_table, H, eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """RMSNorm over each whole head (2 * HALF dimensions) of one token, then RoPE, in place."""
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < H) & (d < HALF)
    base = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
                         + eps)[:, None]
    dtype = x_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + d).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
    # The norm's rounding as in rms_norm, then the rotation in float32, rounded once.
    n1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    n2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_table + d)
    s = tl.load(sin_ptr + pos * stride_table + d)
    tl.store(base, (n1 * c - n2 * s).to(dtype), mask=mask)
    tl.store(base + HALF, (n2 * c + n1 * s).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as [rows, last] without a copy, or None when its last dimension is not
    contiguous (the kernels' one layout)."""
    if x.dtype not in _DTYPES or x.numel() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


class TritonOps(DeviceOps):
    """``DeviceOps`` with Triton kernels for the element-wise ops; the rest (the GEMMs, argmax)
    is the reference's."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        if rows is None or weight.dtype != x.dtype or not weight.is_contiguous():
            return super().rms_norm(x, weight, eps)
        n = rows.shape[-1]
        out = torch.empty_like(rows)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n,
                                           eps, BLOCK=triton.next_power_of_2(n))
        return out.view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows, res = _rows(x), _rows(residual)
        if (rows is None or res is None or residual.shape != x.shape
                or residual.dtype != x.dtype or weight.dtype != x.dtype
                or not weight.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        n = rows.shape[-1]
        out, summed = torch.empty_like(rows), torch.empty_like(rows)
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, summed, rows.stride(0), res.stride(0), out.stride(0),
            summed.stride(0), n, eps, BLOCK=triton.next_power_of_2(n))
        return out.view(x.shape), summed.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x)
        if rows is None or rows.shape[-1] % 2:
            return super().silu_and_mul(x)
        d = rows.shape[-1] // 2
        out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows, out, rows.stride(0), out.stride(0), d, BLOCK=block)
        return out.view(*x.shape[:-1], d)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        half = rotary_dim // 2
        if not _rotary_takes(q, k, cos, sin, rotary_dim):
            return super().rotary(positions, q, k, cos, sin, rotary_dim)
        positions = positions.contiguous()
        for x in (q, k):                          # in place, as the interface allows
            _rotary_kernel[(x.shape[0],)](x, positions, cos, sin, x.stride(0), x.stride(1),
                                          cos.stride(0), x.shape[1], HALF=half,
                                          BLOCK_H=triton.next_power_of_2(x.shape[1]))
        return q, k

    def rotary_normed(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor,
                      rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        half = rotary_dim // 2
        if (not _rotary_takes(q, k, cos, sin, rotary_dim) or rotary_dim != q.shape[-1]
                or q_weight.dtype != q.dtype or k_weight.dtype != q.dtype
                or not q_weight.is_contiguous() or not k_weight.is_contiguous()):
            return None
        positions = positions.contiguous()
        for x, w in ((q, q_weight), (k, k_weight)):
            _rotary_normed_kernel[(x.shape[0],)](
                x, positions, w, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                x.shape[1], eps, HALF=half, BLOCK_H=triton.next_power_of_2(x.shape[1]))
        return q, k


    def lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora: Any) -> torch.Tensor:
        """The step's LoRA adapters: each token's products with its own adapter's weights, two
        Triton kernels (``lora_kernels``); the reference for inputs they do not take."""
        from corellm_plugins.platform_cuda.lora_kernels import lora_linear
        if x.dtype in _DTYPES and lora_linear(y, x, lora):
            return y
        return super().lora_linear(y, x, lora)


def _rotary_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  rotary_dim: int) -> bool:
    """Whether the RoPE kernels take these inputs: [T, H, D] q and k of one kernel dtype with
    contiguous heads, a power-of-two half rotary width, contiguous float32 tables."""
    half = rotary_dim // 2
    return (q.dim() == 3 and k.dim() == 3 and not rotary_dim % 2 and half > 0
            and not half & (half - 1) and q.dtype in _DTYPES and k.dtype == q.dtype
            and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous() and q.shape[0] > 0)


TRITON_OPS = TritonOps()
