"""The CUDA platform's element-wise kernels (``platform.triton_ops``): RMSNorm, SiLU-and-multiply
and RoPE, one Triton kernel each where the reference (``corellm.ops.REFERENCE_OPS``) launches
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
        if (q.dim() != 3 or k.dim() != 3 or rotary_dim % 2 or half & (half - 1)
                or q.dtype not in _DTYPES or k.dtype != q.dtype or q.stride(-1) != 1
                or k.stride(-1) != 1 or cos.dtype != torch.float32 or not cos.is_contiguous()
                or not sin.is_contiguous() or q.shape[0] == 0):
            return super().rotary(positions, q, k, cos, sin, rotary_dim)
        positions = positions.contiguous()
        for x in (q, k):                          # in place, as the interface allows
            _rotary_kernel[(x.shape[0],)](x, positions, cos, sin, x.stride(0), x.stride(1),
                                          cos.stride(0), x.shape[1], HALF=half,
                                          BLOCK_H=triton.next_power_of_2(x.shape[1]))
        return q, k


TRITON_OPS = TritonOps()
