"""The Llama-family decoder, written against corellm's attention backend interface.

Q/K/V and gate/up projections are fused into one matmul each; checkpoint tensors are loaded into
their row ranges. Variants: "llama" (Llama, Mistral), "qwen2" (bias on Q/K/V), "qwen3" (RMSNorm
on each head of Q and K before RoPE).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from corellm.components import BuildContext
from corellm.errors import CheckpointError
from corellm.interfaces import AttentionBackend, CausalLM
from corellm.layers import Attention, RMSNorm, SiluAndMul, get_rope, load_shard
from corellm.model_config import ModelArchConfig


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, variant: str) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = arch.attention_bias or variant == "qwen2"
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.attention_bias)
        self.qk_norm = variant == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        self.rope = rope
        self.attn = Attention(backend, layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, md: Any) -> torch.Tensor:
        t = h.shape[0]
        qkv = self.qkv_proj(h)                                         # [T, (H + 2Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)                   # [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)                # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        o = self.attn(q, k, v, md)                                     # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise CheckpointError(f"hidden_act {arch.hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size,
                                      bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, backend: AttentionBackend,
                 rope: nn.Module, variant: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, backend, rope, variant)
        self.mlp = LlamaMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, md: Any) -> torch.Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h), md)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, variant: str,
                 max_positions: int, device: torch.device) -> None:
        super().__init__()
        # An explicit (meta) weight skips nn.Embedding's random init, whose normal_ on the meta
        # device imports torch._dynamo: about 0.7 s of start-up, for values never used.
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        rope = get_rope(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i, backend, rope, variant)
                                    for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any) -> torch.Tensor:
        h = self.embed_tokens(input_ids)                               # [T, hidden]
        for layer in self.layers:
            h = layer(positions, h, md)
        return self.norm(h)


# checkpoint shard name -> (fused parameter name, index of the shard in it)
_STACKED = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module, CausalLM):
    def __init__(self, arch: ModelArchConfig, backend: AttentionBackend, variant: str,
                 max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, backend, variant, max_positions, device)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = arch.num_hidden_layers
        self.num_kv_heads = arch.num_key_value_heads
        self.head_size = arch.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()                    # [N, vocab]

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        for layer, cache in zip(self.model.layers, kv_caches):
            layer.self_attn.attn.kv_cache = cache

    def _shard_sizes(self, fused: str) -> list[int]:
        attn = self.model.layers[0].self_attn
        if fused == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.arch.intermediate_size
        return [inter, inter]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.arch.tie_word_embeddings:    # re-tie: materializing with to_empty() unties
            self.lm_head.weight = self.model.embed_tokens.weight
        params = dict(self.named_parameters())
        expected: set[tuple[str, int | None]] = set()
        for name in params:
            fused = next((f for _, f, _ in _STACKED if f".{f}." in name), None)
            if fused is None:
                expected.add((name, None))
            else:
                expected.update((name, i) for i in range(len(self._shard_sizes(fused))))
        if self.arch.tie_word_embeddings:
            expected.discard(("lm_head.weight", None))
        loaded: set[tuple[str, int | None]] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            for shard, fused, idx in _STACKED:
                if f".{shard}." in name:
                    target = name.replace(f".{shard}.", f".{fused}.")
                    if target not in params:
                        unexpected.append(name)
                        break
                    sizes = self._shard_sizes(fused)
                    try:
                        load_shard(params[target], tensor, sum(sizes[:idx]), sizes[idx])
                    except ValueError as exc:
                        raise CheckpointError(f"weight {name}: {exc}") from exc
                    loaded.add((target, idx))
                    break
            else:
                param = params.get(name)
                if param is None:
                    unexpected.append(name)
                    continue
                if param.shape != tensor.shape:
                    raise CheckpointError(f"weight {name}: checkpoint shape {tuple(tensor.shape)}"
                                          f" != model shape {tuple(param.shape)}")
                param.data.copy_(tensor)
                loaded.add((name, None))
        if unexpected:
            raise CheckpointError(
                f"checkpoint has {len(unexpected)} weight(s) this {self.arch.model_type} model "
                f"does not use, e.g. {', '.join(sorted(unexpected)[:5])}")
        missing = sorted(n if i is None else f"{n}[shard {i}]" for n, i in expected - loaded)
        if missing:
            raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s), e.g. "
                                  f"{', '.join(missing[:5])}")


def build_model(arch: ModelArchConfig, ctx: BuildContext, variant: str) -> LlamaForCausalLM:
    if ctx.attention_backend is None or ctx.device is None or ctx.dtype is None:
        raise ValueError("model factories need ctx.attention_backend, ctx.device and ctx.dtype")
    max_positions = max(arch.max_position_embeddings, ctx.max_model_len or 0)
    # Build on the meta device (no memory, no random init), then allocate on the target device;
    # load_weights() fills every parameter and raises if the checkpoint leaves one unset.
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, ctx.attention_backend, variant, max_positions, ctx.device)
    # Materialize with torch.empty, not to_empty(): empty_like on meta tensors goes through
    # torch._refs, whose first use imports sympy (0.4 s of start-up).
    device, dtype = ctx.device, ctx.dtype
    return model._apply(lambda t: torch.empty(
        t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
