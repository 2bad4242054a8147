"""The Llama-family decoder, written against corellm's attention backend interface.

Built from the core's tensor-parallel layers: Q/K/V and gate/up are fused column-parallel
matmuls, o_proj and down_proj row-parallel (one all-reduce each), the embedding and head
vocab-parallel; each rank holds its attention heads and loads only its slices. Variants: "llama"
(Llama, Mistral), "qwen2" (bias on Q/K/V), "qwen3" (RMSNorm on each head of Q and K before
RoPE).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from corellm.components import BuildContext
from corellm.platforms.distributed import ParallelContext
from corellm.errors import CheckpointError
from corellm.interfaces import AttentionBackend
from corellm.layers import (Attention, DecoderForCausalLM, MergedColumnParallelLinear,
                            QKVParallelLinear, RMSNorm, RowParallelLinear, SiluAndMul,
                            VocabParallelEmbedding, get_rope, load_weights, materialize)
from corellm.checkpoint.reader import LlamaArchConfig


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, variant: str, parallel: ParallelContext) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        qkv_bias = arch.attention_bias or variant == "qwen2"
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, self.head_dim,
                                          arch.num_attention_heads, arch.num_key_value_heads,
                                          bias=qkv_bias, parallel=parallel)
        self.num_heads = self.qkv_proj.num_heads             # this rank's
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(arch.num_attention_heads * self.head_dim,
                                        arch.hidden_size, bias=arch.attention_bias,
                                        parallel=parallel)
        self.qk_norm = variant == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.rope = rope
        self.attn = Attention(backend, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=arch.layer_sliding_window(layer_idx))

    def forward(self, positions: torch.Tensor, h: torch.Tensor, md: Any,
                norm: RMSNorm | None = None) -> torch.Tensor:
        """``norm``: an RMSNorm not yet applied to ``h``, applied here (inside the QKV GEMM where
        the platform fuses the two)."""
        t = h.shape[0]
        qkv = self.qkv_proj(h) if norm is None else norm.into(self.qkv_proj, h)  # [T, (H+2Hkv)*D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)                   # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.rope.normed(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rope(positions, q, k)
        o = self.attn(q, k, v, md)                                     # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArchConfig, parallel: ParallelContext) -> None:
        super().__init__()
        if arch.hidden_act not in ("silu", "swish"):
            raise CheckpointError(f"hidden_act {arch.hidden_act!r} is not supported by the "
                                  "Llama-family decoder (only silu)")
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter, inter],
                                                       bias=arch.mlp_bias, parallel=parallel)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, bias=arch.mlp_bias,
                                           parallel=parallel)
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        return self.down_proj(self.act.after(self.gate_up_proj, h, norm))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, variant: str, parallel: ParallelContext) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, backend, rope, variant, parallel)
        self.mlp = LlamaMLP(arch, parallel)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the previous layer's output, not yet added to ``residual``, the residual
        stream (None at the first layer, whose ``h`` is the embedding). Returns this layer's
        output and the residual, so each add fuses with the norm after it where the platform
        fuses so (``RMSNorm.add``)."""
        x, norm, residual = self.input_layernorm.add(h, residual, self.self_attn.qkv_proj)
        h = self.self_attn(positions, x, md, norm=norm)
        x, norm, residual = self.post_attention_layernorm.add(h, residual,
                                                              self.mlp.gate_up_proj)
        return self.mlp(x, norm=norm), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArchConfig, backend: AttentionBackend, variant: str,
                 max_positions: int, device: torch.device, parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, parallel)
        rope = get_rope(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, backend, rope, variant, parallel)
                                    for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None             # [T, hidden]
        for layer in self.layers:
            h, residual = layer(positions, h, residual, md)
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


# checkpoint name part -> (fused parameter name part, shard_id its weight_loader takes)
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))


class LlamaForCausalLM(DecoderForCausalLM):
    lazy_weights = True       # load_weights reads lazy slices: each rank reads only its shard

    def __init__(self, arch: LlamaArchConfig, backend: AttentionBackend, variant: str,
                 max_positions: int, device: torch.device, parallel: ParallelContext) -> None:
        super().__init__(arch, LlamaModel(arch, backend, variant, max_positions, device, parallel),
                         tie_word_embeddings=arch.tie_word_embeddings, parallel=parallel)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tied = self.arch.tie_word_embeddings      # the embedding is the one weight of both

        def skip(name: str) -> bool:
            return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")
        load_weights(self, weights, stacked=_STACKED, skip=skip,
                     model_name=self.arch.model_type or "llama")


def build_model(arch: LlamaArchConfig, ctx: BuildContext, variant: str) -> LlamaForCausalLM:
    if ctx.attention_backend is None or ctx.device is None or ctx.dtype is None:
        raise ValueError("model factories need ctx.attention_backend, ctx.device and ctx.dtype")
    max_positions = max(arch.max_position_embeddings, ctx.max_model_len or 0)
    # Build on the meta device (no memory, no random init), then allocate on the target device
    # this rank's shard of each layer; load_weights() fills every parameter and raises if the
    # checkpoint leaves one unset.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, ctx.attention_backend, variant, max_positions, ctx.device,
                                 ctx.parallel)
    return materialize(model, ctx.device, ctx.dtype)
