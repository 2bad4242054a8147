"""The kernels a platform gives models: one typed interface, with plain torch as the reference.

Every core layer (``LinearBase`` and the parallel linears, ``ParallelLMHead``, ``RMSNorm``,
``SiluAndMul``, ``RotaryEmbedding``) runs its arithmetic through ``self.ops``, a ``DeviceOps``.
The class attribute is ``REFERENCE_OPS`` (this module's plain torch code, the arithmetic of the
Hugging Face reference implementations), and ``bind_ops`` gives every layer of a built model its
platform's ops (``Platform.prepare_model`` calls it). A platform subclasses ``DeviceOps`` and
overrides what it runs faster; what it does not override stays the reference.

Two kinds of methods:

* **ops** (``linear``, ``quantized_linear``, ``lora_linear``, ``rms_norm``, ``add_rms_norm``,
  ``silu_and_mul``, ``rotary``, ``argmax``) always return their result: a subclass that
  cannot take an input falls back to ``super()``.
* **fusions** (``linear_normed``, ``linear_silu_mul``, ``rotary_normed``) return None where the
  platform has no fused kernel for the inputs; the layer then runs the unfused layers one by
  one (their ``forward``, hooks included). The reference fuses nothing.

Where a residual add meets an RMSNorm, a platform fuses one of two ways, and ``fuses_norm``
says which for each linear layer: the norm inside the following GEMM (the CPU platform: the add
stays a torch add), or the add inside the norm (``add_rms_norm``: the CUDA platform's Triton
kernel), the GEMM then reading normalized rows. ``RMSNorm.add`` asks and takes the right one.

Per-layer state a platform prepares (the CPU platform's packed weight copies and GEMM plan) is
kept in the layer's ``kernel`` attribute, declared by the layer classes, set by ``prepare``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn


class DeviceOps:
    """The reference ops: plain torch, on any device."""

    #: Shown in the start-up log and ``corellm plugins``.
    name = "torch"

    def prepare(self, model: nn.Module) -> None:
        """Called once after the weights are loaded and ``bind_ops`` ran: prepare per-layer
        state (``layer.kernel``) for the kernels. The reference has none."""

    # ------------------------------------------------------------------ linear layers
    def linear(self, layer: nn.Module, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ layer.weight.T + bias``: the one matmul of a core linear layer (``layer`` is
        a ``corellm.layers.linear.LinearBase`` or ``ParallelLMHead``; its ``kernel`` holds
        what ``prepare`` made for it)."""
        return F.linear(x, layer.weight, bias)

    def quantized_linear(self, layer: nn.Module, x: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for a layer whose weight is quantized: ``layer.qweight``, a
        ``corellm.quant.QuantizedWeight`` (row ranges, each in one format of
        ``corellm.quant.FORMATS``). The reference dequantizes it to ``x``'s dtype for the call
        (correct anywhere, slow); a platform multiplies the blocks directly."""
        return F.linear(x, layer.qweight.dequantize(x.dtype), bias)

    def lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora: Any) -> torch.Tensor:
        """``y`` [T, N] plus the LoRA adapters' products (multi-LoRA) for ``x`` [T, K]. ``lora``
        is the layer's ``corellm.lora.model.LoRALayer``: ``a`` [slots, P, R, K] (each device
        slot's A for each of the layer's P parts), ``b[p]`` [slots, R, N_p] (B transposed,
        scaled) for part p's output columns ``spans[p]`` = (offset, N_p), zero where an adapter
        has no weights; and ``batch`` (``corellm.lora.model.LoRABatch``): ``groups``, one
        ``(slot, tokens)`` per adapter of the step (``tokens`` an int64 index tensor, None for
        every row), ``slots`` each token's slot (-1: none), ``cache`` for what a platform
        derives once per step. Rows ``tokens`` of part p's columns get ``(x[tokens] @
        a[slot, p].T) @ b[p][slot]`` (the shrink, then the expand). The reference gathers each
        adapter's rows, shrinks them for every part in one matmul and expands each part into its
        columns of ``y``, in place."""
        _, parts, rank, k = lora.a.shape
        for slot, tokens in lora.batch.groups:
            xs = x if tokens is None else x.index_select(0, tokens)
            h = xs @ lora.a[slot].view(parts * rank, k).T.to(x.dtype)
            for p, (offset, n) in enumerate(lora.spans):
                part = (h[:, p * rank:(p + 1) * rank] @ lora.b[p][slot].to(x.dtype)).to(y.dtype)
                if tokens is None:
                    y[:, offset:offset + n] += part
                else:
                    y[:, offset:offset + n].index_add_(0, tokens, part)
        return y

    def linear_normed(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
        """``linear(rms_norm(x))`` in one kernel, or None (not fused here). Asked only for
        layers whose output needs no collective (column-parallel or replicated)."""
        return None

    def linear_silu_mul(self, layer: nn.Module, x: torch.Tensor,
                        norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        """``silu_and_mul(linear(x))`` (after ``rms_norm`` when ``norm``, its weight and eps,
        is given) for a merged [gate; up] layer of two equal halves, in one kernel, or None."""
        return None

    def fuses_norm(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether ``linear_normed`` and ``linear_silu_mul`` with a norm run as one kernel for
        ``layer`` and an input shaped like ``x``: then an RMSNorm is best left to the GEMM and a
        residual add before it stays a plain add (``corellm.layers.RMSNorm.add``). False in
        the reference, which fuses nothing."""
        return False

    # ------------------------------------------------------------------ element-wise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMS normalization computed in float32, then scaled by ``weight`` (the Llama
        reference's arithmetic)."""
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``: a decoder's residual add and the
        RMSNorm after it, the sum rounded to ``x``'s dtype before it is normalized (the
        reference's order). Neither input is modified."""
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2*I] (gate | up) -> [..., I]: silu(gate) * up."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE in the rotate-half form on q [T, H, D] and k [T, Hkv, D] at ``positions``, from
        float32 tables ``cos``/``sin`` [P, rotary_dim / 2]; dimensions past ``rotary_dim`` pass
        through. May rotate q and k in place and return them: callers use the result."""
        c = cos[positions].unsqueeze(1).to(q.dtype)      # [T, 1, R/2]
        s = sin[positions].unsqueeze(1).to(q.dtype)
        if rotary_dim < q.shape[-1]:
            r = rotary_dim
            return (torch.cat((_rotate(q[..., :r], c, s), q[..., r:]), dim=-1),
                    torch.cat((_rotate(k[..., :r], c, s), k[..., r:]), dim=-1))
        return _rotate(q, c, s), _rotate(k, c, s)

    def rotary_normed(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor,
                      rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``rotary(positions, rms_norm(q, q_weight), rms_norm(k, k_weight), ...)``: an
        RMSNorm over each head of q and k, then RoPE (Qwen3's attention), in one kernel, or None
        (not fused here). May write q and k in place and return them."""
        return None

    # ------------------------------------------------------------------ sampling
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token: the index of its first maximum (NaN counting as the
        maximum), as ``logits.max(dim=-1).indices``."""
        return logits.max(dim=-1).indices


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


REFERENCE_OPS = DeviceOps()


class OpsModule:
    """Mixin of the core layers that run through a platform's ops: ``ops`` is the reference
    until ``bind_ops`` sets the platform's; ``kernel`` is per-layer state the ops prepared."""

    ops: DeviceOps = REFERENCE_OPS
    kernel: object | None = None


def bind_ops(model: nn.Module, ops: DeviceOps) -> int:
    """Give every core layer of ``model`` (every ``OpsModule``) the platform's ``ops``.
    Returns how many layers got them."""
    count = 0
    for module in model.modules():
        if isinstance(module, OpsModule):
            module.ops = ops
            count += 1
    return count
