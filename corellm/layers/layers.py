from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


class SiluAndMul(nn.Module):
    """[..., 2*I] (gate | up) -> [..., I]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def load_shard(param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy a checkpoint tensor into rows [offset, offset + size) of a fused parameter."""
    if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit rows {offset}:{offset + size} "
                         f"of a parameter of shape {tuple(param.shape)}")
    param.data[offset:offset + size].copy_(loaded)
