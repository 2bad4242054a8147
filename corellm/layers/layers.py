"""Normalization and activations."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from corellm.errors import CheckpointError
from corellm.layers.linear import LinearBase, MergedColumnParallelLinear
from corellm.layers.loading import load_shard  # noqa: F401 - re-exported (corellm.layers)
from corellm.ops import OpsModule


class RMSNorm(OpsModule, nn.Module):
    """RMS normalization computed in float32, as the Llama reference does (``ops.rms_norm``).

    ``self(x, residual)`` adds the residual first and returns ``(normed, summed)``
    (``ops.add_rms_norm``: one kernel where the platform has it), as vLLM's norms do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def _fuses_into(self, linear: nn.Module) -> bool:
        """Whether the norm may run inside ``linear``'s GEMM: a core linear layer whose output
        needs no collective and that runs no LoRA adapter this step, and a norm whose
        ``forward`` is this class's (a subclass's or a hook's arithmetic would be skipped)."""
        return (isinstance(linear, LinearBase) and linear.local_output
                and not linear.lora_active and type(self).forward is RMSNorm.forward)

    def into(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``linear(self(x))``: one kernel where the platform fuses them
        (``ops.linear_normed``: on the CPU, corellm's GEMM normalizing the rows into a scratch
        of its own call before its tiles read them), else the two layers. Fused only for a
        core linear layer whose output needs no collective and a norm whose ``forward`` is
        this class's; on the fused path neither module's ``forward`` (nor a hook on it) runs."""
        if self._fuses_into(linear):
            out = linear.ops.linear_normed(linear, x, self.weight, self.eps)
            if out is not None:
                return out
        return linear(self(x))

    def add(self, x: torch.Tensor, residual: torch.Tensor | None, linear: nn.Module
            ) -> tuple[torch.Tensor, RMSNorm | None, torch.Tensor]:
        """The residual add before this norm, and the norm, for the input of ``linear``, fused
        the way the platform fuses best (``ops.fuses_norm``). Returns ``(x', norm, summed)``:
        ``summed`` is ``x + residual`` (``x`` itself when ``residual`` is None: the first
        layer), the next residual; ``norm`` is this norm where it is left to ``linear``'s GEMM
        (pass ``x'``, the sum, to ``into`` or ``SiluAndMul.after``), or None where ``x'`` is
        already normalized (by ``ops.add_rms_norm``: on CUDA one kernel for the add and the
        norm)."""
        if self._fuses_into(linear) and linear.ops.fuses_norm(linear, x):
            summed = x if residual is None else x + residual
            return summed, self, summed
        if residual is None:
            return self(x), None, x
        normed, summed = self(x, residual)
        return normed, None, summed


class SiluAndMul(OpsModule, nn.Module):
    """[..., 2*I] (gate | up) -> [..., I]: silu(gate) * up (``ops.silu_and_mul``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)

    def after(self, linear: nn.Module, x: torch.Tensor,
              norm: RMSNorm | None = None) -> torch.Tensor:
        """``self(linear(norm(x)))`` for a merged gate/up projection (``norm`` optional): one
        kernel where the platform fuses them (``ops.linear_silu_mul``: on the CPU, corellm's
        GEMM multiplying each pair of gate and up tiles while they are in cache, so the
        [T, 2I] product is never written, and normalizing the rows it multiplies), else the
        layers one by one."""
        if (isinstance(linear, MergedColumnParallelLinear) and linear.local_output
                and not linear.lora_active and len(linear.output_sizes) == 2
                and linear.output_sizes[0] == linear.output_sizes[1]
                and type(self).forward is SiluAndMul.forward
                and (norm is None or type(norm).forward is RMSNorm.forward)):
            out = linear.ops.linear_silu_mul(linear, x,
                                             None if norm is None else (norm.weight, norm.eps))
            if out is not None:
                return out
        return self(linear(x) if norm is None else norm.into(linear, x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation spelt out as GPT-2 and Phi's reference does (bit-equal to it;
    # F.gelu(approximate="tanh") differs in the last bit).
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


# Hugging Face ``hidden_act`` names -> functions with the same arithmetic as transformers'.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_new, "gelu_pytorch_tanh": _gelu_tanh, "gelu_fast": _gelu_fast,
    "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a checkpoint's ``hidden_act`` names, or a CheckpointError listing the
    supported ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise CheckpointError(f"hidden_act {name!r} is not supported (supported: "
                              f"{', '.join(sorted(ACTIVATIONS))})") from None
