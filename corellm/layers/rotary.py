"""Rotary position embeddings, in the rotate-half form of Hugging Face checkpoints (Llama, Qwen,
Mistral, Phi, GPT-NeoX), over all of each head's dimensions or, for partial rotary embeddings
(Phi: 0.5, GPT-NeoX: 0.25 of them), over the first ``rotary_dim`` only."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from corellm.errors import CheckpointError
from corellm.layers.layers import RMSNorm
from corellm.ops import OpsModule
from corellm.arch import ROPE_TYPES


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # Same arithmetic as the reference implementation, so cos/sin match bit for bit in float32.
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(OpsModule, nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hkv, D] at the given positions, from a cos/sin
    table precomputed for every position up to ``max_positions``. With ``rotary_dim < head_dim``
    only the first ``rotary_dim`` dimensions of each head are rotated (frequencies computed over
    ``rotary_dim``, as the reference does); the rest pass through unchanged.

    Callers use the returned tensors and must not rely on q and k being left as they were: a
    platform's ``ops.rotary`` may rotate them in place and return them (the CPU platform's
    fused kernel does)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, device: torch.device | str = "cpu",
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise CheckpointError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim="
                                  f"{head_dim}]")
        self.rotary_dim = rotary_dim
        self.partial = rotary_dim < head_dim
        with torch.device("cpu"):
            inv_freq = _inv_freq(rotary_dim, theta)
        attention_factor = 1.0
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise CheckpointError(f"rope_type {rope_type!r} is not supported "
                                  f"(supported: {', '.join(ROPE_TYPES)})")
        positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(positions, inv_freq)                  # [P, D/2]
        # Plain attributes rather than buffers: models are built on the meta device and
        # materialized with to_empty(), which would leave buffers uninitialized.
        self.cos = (freqs.cos() * attention_factor).to(device)      # [P, D/2] float32
        self.sin = (freqs.sin() * attention_factor).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)

    def normed(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               q_norm: nn.Module, k_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(positions, q_norm(q), k_norm(k))``, the per-head RMSNorms of Qwen3's
        attention then RoPE: one kernel where the platform fuses them (``ops.rotary_normed``)
        and both norms are core ``RMSNorm``s with one eps and their class's ``forward``; else
        the three layers. May write q and k in place."""
        if (all(isinstance(n, RMSNorm) and type(n).forward is RMSNorm.forward
                    for n in (q_norm, k_norm))
                and q_norm.eps == k_norm.eps and type(self).forward is RotaryEmbedding.forward):
            out = self.ops.rotary_normed(positions, q, k, q_norm.weight, k_norm.weight,
                                         q_norm.eps, self.cos, self.sin, self.rotary_dim)
            if out is not None:
                return out
        return self(positions, q_norm(q), k_norm(k))


def get_rope(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
             device: torch.device | str = "cpu", rotary_dim: int | None = None
             ) -> RotaryEmbedding:
    """A rotary embedding; ``rotary_dim`` (default: ``head_dim``) for partial rotary
    embeddings, e.g. ``int(head_dim * partial_rotary_factor)``."""
    return RotaryEmbedding(head_dim, max_positions, theta, scaling, device, rotary_dim)
