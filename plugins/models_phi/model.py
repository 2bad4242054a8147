"""The Phi decoder: each layer is ``h + attn(ln(h)) + mlp(ln(h))`` with one LayerNorm shared by
the attention and the MLP branches, Q/K/V fused into one biased matmul, and RoPE on the first
``rotary_dim`` dimensions of each head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from corellm.components import BuildContext
from corellm.platforms.distributed import ParallelContext
from corellm.interfaces import AttentionBackend
from corellm.layers import (Attention, ColumnParallelLinear, DecoderForCausalLM,
                            QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                            get_activation, get_rope, load_weights, materialize)
from corellm_plugins.models_phi import PhiArchConfig


class PhiAttention(nn.Module):
    def __init__(self, arch: PhiArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, parallel: ParallelContext) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, self.head_dim,
                                          arch.num_attention_heads, arch.num_key_value_heads,
                                          bias=True, parallel=parallel)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.dense = RowParallelLinear(arch.num_attention_heads * self.head_dim,
                                       arch.hidden_size, bias=True, parallel=parallel)
        self.qk_layernorm = arch.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=arch.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=arch.layer_norm_eps)
        self.rope = rope
        self.attn = Attention(backend, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=arch.layer_sliding_window(layer_idx))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, md: Any) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rope(positions, q, k)
        return self.dense(self.attn(q, k, v, md).reshape(t, self.q_size))


class PhiMLP(nn.Module):
    def __init__(self, arch: PhiArchConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(arch.hidden_size, arch.intermediate_size, bias=True,
                                        parallel=parallel)
        self.fc2 = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=True,
                                     parallel=parallel)
        self.act = get_activation(arch.hidden_act)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class PhiDecoderLayer(nn.Module):
    def __init__(self, arch: PhiArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, parallel: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.self_attn = PhiAttention(arch, layer_idx, backend, rope, parallel)
        self.mlp = PhiMLP(arch, parallel)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, md: Any) -> torch.Tensor:
        x = self.input_layernorm(h)
        return h + self.self_attn(positions, x, md) + self.mlp(x)


class PhiModel(nn.Module):
    def __init__(self, arch: PhiArchConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device, parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel)
        rope = get_rope(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device,
                        rotary_dim=arch.rotary_dim)
        self.layers = nn.ModuleList(PhiDecoderLayer(arch, i, backend, rope, parallel)
                                    for i in range(arch.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(positions, h, md)
        return self.final_layernorm(h)


_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"))


class PhiForCausalLM(DecoderForCausalLM):
    lazy_weights = True

    def __init__(self, arch: PhiArchConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device, parallel: ParallelContext) -> None:
        super().__init__(arch, PhiModel(arch, backend, max_positions, device, parallel),
                         lm_head_bias=True, tie_word_embeddings=arch.tie_word_embeddings,
                         parallel=parallel)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tied = self.arch.tie_word_embeddings
        load_weights(self, weights, stacked=_STACKED,
                     skip=lambda name: tied and name == "lm_head.weight", model_name="phi")


def build_model(arch: PhiArchConfig, ctx: BuildContext) -> PhiForCausalLM:
    max_positions = max(arch.max_position_embeddings, ctx.max_model_len or 0)
    with torch.device("meta"):
        model = PhiForCausalLM(arch, ctx.attention_backend, max_positions, ctx.device,
                               ctx.parallel)
    return materialize(model, ctx.device, ctx.dtype)
