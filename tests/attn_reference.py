"""Attention computed in float64 from a paged cache, position by position with explicit masks:
the reference the attention backends' kernels are tested against."""

from __future__ import annotations

import numpy as np
import torch

from corellm.attention import CommonAttentionMetadata
from corellm.interfaces import AttentionLayerSpec


def reference_attention(layer: AttentionLayerSpec, query, kv_cache, reqs, tables,
                        bs) -> torch.Tensor:
    """Attention of each request's new tokens over its keys, read from the paged cache by
    position, in float64, with explicit causal, window and soft-cap handling."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    start = 0
    for (ctx, n), table in zip(reqs, tables):
        seq = ctx + n
        pos = torch.arange(seq)
        slots = torch.tensor(table)[pos // bs] * bs + pos % bs
        k = kv_cache[0].flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [seq, H, D]
        v = kv_cache[1].flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start:start + n].double(), k) * layer.scale
        if layer.logit_soft_cap is not None:
            scores = layer.logit_soft_cap * torch.tanh(scores / layer.logit_soft_cap)
        q_pos = torch.arange(ctx, seq)[:, None]
        allowed = pos[None, :] <= q_pos
        if layer.sliding_window is not None:
            allowed &= pos[None, :] > q_pos - layer.sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += n
    return out


def common_metadata(reqs, tables, bs, pad_blocks: int = 0) -> CommonAttentionMetadata:
    """The step's common facts for ``reqs`` ((context length, new tokens), decodes first)
    whose blocks are ``tables`` (block ids per request); ``pad_blocks`` extra zero columns."""
    table = np.zeros((len(reqs), max(map(len, tables)) + pad_blocks), dtype=np.int64)
    for i, ids in enumerate(tables):
        table[i, :len(ids)] = ids
    slots = np.array([tables[i][p // bs] * bs + p % bs
                      for i, (c, n) in enumerate(reqs) for p in range(c, c + n)], dtype=np.int64)
    num_decodes = next((i for i, (_, n) in enumerate(reqs) if n != 1), len(reqs))
    seq = np.array([c + n for c, n in reqs])
    return CommonAttentionMetadata(
        num_reqs=len(reqs), num_decodes=num_decodes, num_actual_tokens=int(slots.size),
        query_start_loc=np.cumsum([0] + [n for _, n in reqs]), seq_lens=seq,
        context_lens=np.array([c for c, _ in reqs]), block_table=table, slot_mapping=slots,
        max_seq_len=int(seq.max()), max_query_len=max(n for _, n in reqs), block_size=bs)


def paged_cache(shape, dtype, reqs, bs, gen, fill=float("nan")):
    """A KV cache of ``shape`` ([2, blocks, bs, Hkv, D]) that is ``fill`` except the context
    slots of ``reqs`` ((context length, new tokens)), which hold random K/V, in scattered blocks:
    returns (cache, each request's block ids)."""
    cache = torch.full(shape, fill, dtype=dtype)
    hkv, d = shape[3], shape[4]
    perm = torch.randperm(shape[1], generator=gen).tolist()
    tables, used = [], 0
    for ctx, n in reqs:
        k = -(-(ctx + n) // bs)
        tables.append(perm[used:used + k])
        used += k
    for (ctx, _), table in zip(reqs, tables):
        for p in range(ctx):
            cache[:, table[p // bs], p % bs] = torch.randn(2, hkv, d, generator=gen).to(dtype)
    return cache, tables
