from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from corellm.interfaces import AttentionBackend, AttentionLayerSpec
from corellm.interfaces import attention_layer_specs  # noqa: F401  (its home until 0.4.1)


class Attention(nn.Module):
    """Glue between a model's attention layer and the configured backend: holds the layer's
    static facts and its KV-cache tensor (bound by the model runner after allocation)."""

    # What CausalLM.attention_layers() looks for (corellm.interfaces.attention_layer_specs).
    is_attention_layer: ClassVar[bool] = True

    def __init__(self, backend: AttentionBackend, layer_idx: int, num_heads: int,
                 num_kv_heads: int, head_size: int, scale: float | None = None, *,
                 sliding_window: int | None = None,
                 logit_soft_cap: float | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.spec = AttentionLayerSpec(layer_idx, num_heads, num_kv_heads, head_size,
                                       scale if scale is not None else head_size ** -0.5,
                                       sliding_window=sliding_window,
                                       logit_soft_cap=logit_soft_cap)
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: Any) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: the model runner must call bind_kv_caches()")
        return self.backend.forward(self.spec, q, k, v, self.kv_cache, metadata)


def _attention_modules(model: nn.Module) -> list[Attention]:
    return sorted((m for m in model.modules() if isinstance(m, Attention)),
                  key=lambda a: a.spec.layer_idx)


def bind_kv_caches(model: nn.Module, kv_caches: Sequence[torch.Tensor]) -> None:
    """Hand every ``Attention`` module of ``model`` its layer's cache tensor (``kv_caches[i]``
    to the layer with ``layer_idx == i``): the whole of most models' ``bind_kv_caches``."""
    layers = _attention_modules(model)
    if [a.spec.layer_idx for a in layers] != list(range(len(kv_caches))):
        raise ValueError(f"{len(kv_caches)} KV caches for attention layers "
                         f"{[a.spec.layer_idx for a in layers]}; expected layers 0.."
                         f"{len(kv_caches) - 1}, one each")
    for attn, cache in zip(layers, kv_caches):
        attn.kv_cache = cache
