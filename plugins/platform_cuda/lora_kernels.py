"""Multi-LoRA on the CUDA platform: each token's adapter products with its own adapter's weights
(the shape of Punica's BGMV), two Triton kernels per layer call and no gather or scatter.

* ``_lora_shrink``: one program per (token, part): ``h[t, p] = A[slot_t, p] @ x_t`` in float32
  (R values), over K in tiles; a token of the base model (slot -1) computes nothing.
* ``_lora_expand``: one program per (token, block of the part's columns), one launch per part:
  ``y[t, off_p + j] += h[t, p] . B_p[slot_t][:, j]``, added in float32 and rounded once to y's
  dtype.

``A`` is the layer's ``[slots, parts, R, K]``, ``B_p`` ``[slots, R, N_p]`` (B transposed), as
``corellm.lora.model.LoRALayer`` keeps them. Checked on the CPU under Triton's interpreter
(``tests/test_platform_cuda_ops.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_shrink(x_ptr, a_ptr, slots_ptr, h_ptr, stride_x, K, P, R,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    k_end = tl.where(slot >= 0, K, 0)          # a base-model token reads nothing
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    a_rows = a_ptr + ((slot * P + p) * R + r[:, None]) * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_x + k, mask=k < k_end, other=0.0).to(tl.float32)
        a = tl.load(a_rows + k[None, :], mask=(r[:, None] < R) & (k[None, :] < k_end),
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + (t * P + p) * BLOCK_R + r, acc)


@triton.jit
def _lora_expand(h_ptr, b_ptr, slots_ptr, y_ptr, stride_y, P, p, R, N, offset,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    n_end = tl.where(slot >= 0, N, 0)          # a base-model token's row is left as it is
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + (t * P + p) * BLOCK_R + r)
    b = tl.load(b_ptr + (slot * R + r[:, None]) * N + n[None, :],
                mask=(r[:, None] < R) & (n[None, :] < n_end), other=0.0).to(tl.float32)
    out = y_ptr + t * stride_y + offset + n
    mask = n < n_end
    y = tl.load(out, mask=mask, other=0.0)
    delta = tl.sum(h[:, None] * b, axis=0)
    tl.store(out, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def lora_linear(y: torch.Tensor, x: torch.Tensor, lora: Any) -> bool:
    """``y`` += the step's adapters' products for ``x``, in place (the
    ``DeviceOps.lora_linear`` contract); False (nothing done) for inputs the kernels do not
    take: 2-D tensors of one dtype, unit-strided rows, contiguous A and B, slots on x's
    device."""
    slots, a = lora.batch.slots, lora.a
    if (slots is None or x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1
            or a.dtype != x.dtype or y.dtype != x.dtype or not a.is_contiguous()
            or not all(b.is_contiguous() for b in lora.b) or slots.device != x.device
            or slots.shape[0] != x.shape[0]):
        return False
    tokens, k = x.shape
    _, parts, rank, _ = a.shape
    block_r = triton.next_power_of_2(rank)
    h = torch.empty(tokens, parts, block_r, dtype=torch.float32, device=x.device)
    _lora_shrink[(tokens, parts)](x, a, slots, h, x.stride(0), k, parts, rank,
                                  BLOCK_R=block_r, BLOCK_K=min(128, triton.next_power_of_2(k)))
    for p, (offset, n) in enumerate(lora.spans):
        block_n = min(128, triton.next_power_of_2(n))
        _lora_expand[(tokens, triton.cdiv(n, block_n))](
            h, lora.b[p], slots, y, y.stride(0), parts, p, rank, n, offset, BLOCK_R=block_r,
            BLOCK_N=block_n)
    return True
