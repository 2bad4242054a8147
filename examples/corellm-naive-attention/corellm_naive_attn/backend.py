"""The ``naive`` backend. Imported by the factory, so torch loads only when it is selected."""

from __future__ import annotations

import torch

from corellm.attention import AttentionMetadata, KVCacheSpec
from corellm.interfaces import AttentionBackend, AttentionLayerSpec


class NaiveAttentionBackend(AttentionBackend):
    """Attends one request at a time over K/V gathered through its block table. The same code
    serves decodes, whole prefills, prefill chunks, prefix-cache hits and recomputation after
    preemption: each is a run of query positions ``context_len .. seq_len - 1`` attending to the
    keys at positions ``0 .. seq_len - 1``."""

    def __init__(self, compute_dtype: str = "float32") -> None:
        if compute_dtype not in ("float32", "model"):
            raise ValueError(f"compute_dtype must be 'float32' or 'model', not {compute_dtype!r}")
        # None: compute in the query's dtype, which is the model's.
        self.compute_dtype = torch.float32 if compute_dtype == "float32" else None

    def kv_cache_spec(self, layer: AttentionLayerSpec, num_blocks: int, block_size: int,
                      dtype: torch.dtype) -> KVCacheSpec:
        # [block, K|V, slot in block, kv head, head dim]: a block's keys and values sit together.
        # Every read is of a written slot, so the pool need not be zero-filled.
        return KVCacheSpec((num_blocks, 2, block_size, layer.num_kv_heads, layer.head_size),
                           dtype, zero_init=False)

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        # 1. Write this step's keys and values first: this step's queries attend to them too.
        bs = metadata.block_size
        blocks, offsets = metadata.slot_mapping // bs, metadata.slot_mapping % bs
        kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)

        dtype = self.compute_dtype or query.dtype
        group = layer.num_heads // layer.num_kv_heads        # query heads per KV head (GQA)
        qsl = metadata.query_start_loc_list
        out = torch.empty_like(query)                         # [T, H, D]
        for i in range(metadata.num_reqs):
            ctx_len, seq_len = metadata.context_lens_list[i], metadata.seq_lens_list[i]
            # 2. Its keys and values, cached and new: the first ceil(seq_len / bs) blocks.
            kv = kv_cache[metadata.block_table[i, :-(-seq_len // bs)]]  # [n, 2, bs, Hkv, D]
            k = kv[:, 0].flatten(0, 1)[:seq_len].to(dtype)        # [seq_len, Hkv, D]
            v = kv[:, 1].flatten(0, 1)[:seq_len].to(dtype)
            # 3. Grouped-query attention: query head h reads KV head h // group.
            k = k.repeat_interleave(group, dim=1)                 # [seq_len, H, D]
            v = v.repeat_interleave(group, dim=1)
            q = query[qsl[i]:qsl[i + 1]].to(dtype)                # [seq_len - ctx_len, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
            # 4. Causal: the query at position p sees the keys at positions 0 .. p.
            q_pos = torch.arange(ctx_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
            probs = scores.softmax(dim=-1)                        # [H, new tokens, seq_len]
            out[qsl[i]:qsl[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        return out
