from __future__ import annotations

from typing import Any

import torch
from torch import nn

from corellm.interfaces import AttentionBackend, AttentionLayerSpec


class Attention(nn.Module):
    """Glue between a model's attention layer and the configured backend: holds the layer's
    static facts and its KV-cache tensor (bound by the model runner after allocation)."""

    def __init__(self, backend: AttentionBackend, layer_idx: int, num_heads: int,
                 num_kv_heads: int, head_size: int, scale: float | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.spec = AttentionLayerSpec(layer_idx, num_heads, num_kv_heads, head_size,
                                       scale if scale is not None else head_size ** -0.5)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner must call bind_kv_caches()")
        return self.backend.forward(self.spec, q, k, v, self.kv_cache, metadata)
