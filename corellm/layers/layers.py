"""Normalization, activations and weight-copy helpers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from corellm.errors import CheckpointError


class RMSNorm(nn.Module):
    """RMS normalization computed in float32, as the Llama reference does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)

    def into(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``linear(self(x))``: one kernel where the worker gave ``linear`` a fused path
        (``linear_normed``: on the CPU, corellm's GEMM normalizing the rows into a scratch of
        its own call before its tiles read them: no separate layer call, output tensor or
        pass), else the two layers. On the fused path neither module's ``forward`` (nor a
        forward hook on them) runs."""
        fused = getattr(linear, "linear_normed", None)
        if fused is not None and type(self).forward is RMSNorm.forward:
            out = fused(x, (self.weight, self.eps))
            if out is not None:
                return out
        return linear(self(x))


class SiluAndMul(nn.Module):
    """[..., 2*I] (gate | up) -> [..., I]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def after(self, linear: nn.Module, x: torch.Tensor,
              norm: RMSNorm | None = None) -> torch.Tensor:
        """``self(linear(norm(x)))`` for a merged gate/up projection (``norm`` optional): one
        kernel where the worker gave ``linear`` a fused path (``linear_silu_mul``: on the CPU,
        corellm's GEMM multiplying each pair of gate and up tiles while they are in cache, so
        the [T, 2I] product is never written, and normalizing the rows it multiplies), else
        the layers one by one."""
        fused = getattr(linear, "linear_silu_mul", None)
        if fused is not None and type(self).forward is SiluAndMul.forward and (
                norm is None or type(norm).forward is RMSNorm.forward):
            out = fused(x, None if norm is None else (norm.weight, norm.eps))
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


def load_shard(param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy a checkpoint tensor into rows [offset, offset + size) of a fused parameter."""
    if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit rows {offset}:{offset + size} "
                         f"of a parameter of shape {tuple(param.shape)}")
    param.data[offset:offset + size].copy_(loaded)
