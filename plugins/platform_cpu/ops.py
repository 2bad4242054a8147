"""The CPU platform's ops for models: packed-weight GEMMs chosen per shape by measurement, RMSNorm
and SiLU-and-multiply fused into corellm's GEMM, and the element-wise kernels of cpu_ops.c.

Every method takes what its kernels take and hands anything else (autograd, another dtype or
device, strided inputs) to the reference (``DeviceOps``: plain torch), so the results are the
reference's wherever a kernel declines.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from corellm.ops import DeviceOps
from corellm_plugins.platform_cpu.gemm import PackedLinear, _run, native_gemm, pack_linear_weights
from corellm_plugins.platform_cpu.kernels import CpuOps, _silu_kernel_is_faster, cpu_ops
from corellm_plugins.platform_cpu.lora_kernels import lora_kernels
from corellm_plugins.platform_cpu.qlinear import QuantLinear, quant_kernels

logger = logging.getLogger(__name__)


class CpuDeviceOps(DeviceOps):
    """``weight_packing``: each linear layer runs the GEMM path measured fastest for its
    weight's shape and the call's rows (``platform.weight_packing``). ``fused_ops``: the C
    element-wise kernels, RMSNorm and SiLU-and-multiply inside corellm's GEMM where a layer's
    plan takes it, and greedy's argmax as one native pass (``platform.fused_ops``).
    ``weight_prefetch``: quantized layers have an idle pool thread fetch the next layers'
    weights between calls (``platform.weight_prefetch``)."""

    name = "cpu"
    # lora_linear: the most tokens a step may have for lora.c's per-token products
    LORA_KERNEL_MAX_TOKENS = 256

    def __init__(self, weight_packing: bool = True, fused_ops: bool = True,
                 weight_prefetch: bool = False) -> None:
        self.weight_packing = weight_packing
        self.fused_ops = fused_ops
        self.weight_prefetch = weight_prefetch
        self.kernels: CpuOps | None = None
        self.silu_dtypes: frozenset[torch.dtype] = frozenset()

    def prepare(self, model: torch.nn.Module) -> None:
        quantized = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
        kernels = quant_kernels() if quantized else None
        for module in quantized if kernels is not None else ():
            module.kernel = kernels.plan(module.qweight)
            if module.kernel is not None:
                module.kernel.prefetch = self.weight_prefetch
        if self.weight_packing:
            pack_linear_weights(model)
        if not self.fused_ops:
            return
        dtypes = ({p.dtype for p in model.parameters() if p.device.type == "cpu"}
                  & set(CpuOps.DTYPES))
        if not dtypes and next(model.parameters(), None) is not None:
            return                     # an fp16 or GPU model: the kernels take fp32 or bf16 CPU
        self.kernels = cpu_ops()
        if self.kernels is None:
            return
        # SiLU-and-multiply: only for the dtypes whose kernel measured faster than torch's.
        self.silu_dtypes = frozenset(d for d in (dtypes or {torch.float32})
                                     if _silu_kernel_is_faster(self.kernels, d))
        if kernels is not None:     # quantized layers run with their norm and SiLU (one call)
            kernels.use_neighbours(*self.kernels.float32_addresses())
        in_gemms = sum(1 for m in model.modules()
                       if isinstance(getattr(m, "kernel", None), PackedLinear)
                       and "native" in m.kernel.plan.paths)
        logger.info("fused CPU kernels (RMSNorm, RoPE%s, argmax; RMSNorm and "
                    "SiLU-and-multiply inside the GEMM of %d linear layers)",
                    ", SiLU-and-multiply" if self.silu_dtypes else "", in_gemms)

    # ------------------------------------------------------------------ linear layers
    def linear(self, layer: torch.nn.Module, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        kernel = layer.kernel
        if (not isinstance(kernel, PackedLinear) or x.dim() != 2
                or (torch.is_grad_enabled() and (
                    layer.weight.requires_grad or x.requires_grad
                    or (bias is not None and bias.requires_grad)))):
            return F.linear(x, layer.weight, bias)   # packed copies carry no autograd history
        path = kernel.plan.path_for(x.shape[0])
        return _run(path, x, layer.weight, kernel.packed[path], bias)

    def quantized_linear(self, layer: torch.nn.Module, x: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
        """The blocks multiplied in quant_gemm.c (float32 activations; others converted there
        and back); the reference where the kernels are missing or decline the input."""
        kernel = layer.kernel
        if (not isinstance(kernel, QuantLinear) or kernel.qweight is not layer.qweight
                or x.dim() != 2 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and x.requires_grad)):
            return super().quantized_linear(layer, x, bias)
        if x.dtype == torch.float32:
            return kernel(x, bias)
        return kernel(x.float(), bias).to(x.dtype)

    def lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora: Any) -> torch.Tensor:
        """A step of few tokens (decode): lora.c, each token's products with its own adapter's
        weights only, the tokens grouped by adapter (once per step), on the thread pool. A step
        of many (a prefill, whose requests' tokens are contiguous): each run of tokens of one
        adapter (found once per step) multiplied in place with torch's GEMM, neither gathered
        nor scattered. Otherwise (autograd, another device, or many short runs: a decode step
        the C kernel does not take): the reference."""
        batch = lora.batch
        if (batch.slots is None or x.device.type != "cpu" or x.dim() != 2
                or (torch.is_grad_enabled() and x.requires_grad)):
            return super().lora_linear(y, x, lora)
        kernels = lora_kernels() if x.shape[0] <= self.LORA_KERNEL_MAX_TOKENS else None
        if kernels is not None:
            order = batch.cache.get("order")
            if order is None:
                slots = batch.slots
                order = torch.argsort(slots, stable=True)
                order = batch.cache["order"] = order[slots[order] >= 0].contiguous()
            if kernels.apply(y, x, lora, order, batch.slots):
                return y
        runs = batch.cache.get("runs")
        if runs is None:
            s = batch.slots.numpy()
            cut = np.flatnonzero(np.diff(s)) + 1
            runs = batch.cache["runs"] = [
                (int(a), int(b), int(s[a])) for a, b in zip(np.r_[0, cut], np.r_[cut, len(s)])
                if s[a] >= 0]
        if len(runs) > 4 * len(batch.groups):      # interleaved (a bfloat16 decode): no loop
            return super().lora_linear(y, x, lora)  # over tokens, the reference's gathers
        _, parts, rank, k = lora.a.shape
        for start, end, slot in runs:
            h = F.linear(x[start:end], lora.a[slot].view(parts * rank, k).to(x.dtype))
            for p, (offset, n) in enumerate(lora.spans):
                y[start:end, offset:offset + n].addmm_(h[:, p * rank:(p + 1) * rank],
                                                       lora.b[p][slot].to(x.dtype))
        return y

    def _native_packed(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The layer's packed copy for corellm's GEMM, where fused paths are on and its plan
        takes that GEMM for x's rows; else None."""
        kernel = layer.kernel
        if (not self.fused_ops or not isinstance(kernel, PackedLinear) or x.dim() != 2
                or kernel.plan.path_for(x.shape[0]) != "native"
                or (torch.is_grad_enabled() and layer.weight.requires_grad)):
            return None
        return kernel.packed["native"]

    def _fused_quant(self, layer: torch.nn.Module, x: torch.Tensor,
                     norm_weight: torch.Tensor | None = None) -> QuantLinear | None:
        """The layer's quantized kernel where it may run with its RMSNorm and SiLU in one call
        (``QuantLinear.fused``: the platform's own float32 kernels inside it); else None."""
        kernel = getattr(layer, "kernel", None)
        if (not self.fused_ops or self.kernels is None or not isinstance(kernel, QuantLinear)
                or not kernel.fusable or kernel.qweight is not layer.qweight
                or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        if norm_weight is not None and not (
                norm_weight.dtype == torch.float32 and norm_weight.device.type == "cpu"
                and norm_weight.shape == (x.shape[1],) and norm_weight.is_contiguous()
                and not (torch.is_grad_enabled() and norm_weight.requires_grad)):
            return None
        return kernel

    def fuses_norm(self, layer: torch.nn.Module, x: torch.Tensor) -> bool:
        return self._native_packed(layer, x) is not None or self._fused_quant(layer, x) is not None

    def linear_normed(self, layer: torch.nn.Module, x: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
        packed = self._native_packed(layer, x)
        if packed is None:
            kernel = self._fused_quant(layer, x, norm_weight)
            return None if kernel is None else kernel.fused(x, layer.bias, (norm_weight, eps))
        return native_gemm().linear(x, packed, layer.weight.shape[0], layer.bias,
                                    k=layer.weight.shape[1], norm=(norm_weight, eps))

    def linear_silu_mul(self, layer: torch.nn.Module, x: torch.Tensor,
                        norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor | None:
        packed = self._native_packed(layer, x)
        if packed is None:
            if torch.float32 not in self.silu_dtypes:    # the unfused path's SiLU is torch's
                return None
            kernel = self._fused_quant(layer, x, None if norm is None else norm[0])
            return None if kernel is None else kernel.fused(x, layer.bias, norm, silu_mul=True)
        return native_gemm().linear_silu_mul(x, packed, layer.weight.shape[0], layer.bias,
                                             k=layer.weight.shape[1], norm=norm)

    # ------------------------------------------------------------------ element-wise
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = self.kernels.rms_norm(x, weight, eps) if self.kernels is not None else None
        return out if out is not None else super().rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = (self.kernels.silu_and_mul(x)
               if self.kernels is not None and x.dtype in self.silu_dtypes else None)
        return out if out is not None else super().silu_and_mul(x)

    def rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor,
               rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernels is not None and self.kernels.rope_(positions, q, k, cos, sin,
                                                           rotary_dim):
            return q, k
        return super().rotary(positions, q, k, cos, sin, rotary_dim)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """One native pass over the rows, split over the threads (torch's reduction would run
        on the one thread weight packing leaves torch; figures in docs/platform-cpu.md, "Fused
        element-wise kernels")."""
        out = self.kernels.argmax(logits) if self.kernels is not None else None
        return out if out is not None else super().argmax(logits)
