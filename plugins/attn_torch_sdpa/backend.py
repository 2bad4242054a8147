from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from corellm.attention import AttentionMetadata
from corellm.interfaces import AttentionBackend, AttentionLayerSpec


@dataclass
class _Prefill:
    start: int                      # offsets into the step's token dimension
    end: int
    context_len: int                # tokens of this request already in the cache
    seq_len: int
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)]; None when context_len == 0
    mask: torch.Tensor | None       # [n, seq_len] bool, True = attend; None: plain causal


@dataclass
class _DecodeGroup:
    start: int                      # rows [start, end) of the decode part
    end: int
    block_ids: torch.Tensor         # [(end - start) * nblk] block ids, row-major
    mask: torch.Tensor              # [end - start, 1, 1, nblk * block_size] bool


@dataclass
class SDPAMetadata:
    common: AttentionMetadata
    decode_groups: list[_DecodeGroup]
    prefills: list[_Prefill]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping


class TorchSDPABackend(AttentionBackend):
    """Decodes: grouped by length (rows arrive sorted), the blocks of each group's requests are
    gathered (``index_select`` into a
    persistent buffer: allocating it afresh each layer cost more than the copy) into
    [nd, Hkv, L, D] and attended in one SDPA call, with each KV head's query group folded into
    the query axis so K/V are read once per KV head rather than once per query head.
    Prefills: one SDPA call each, causal (4-D inputs, which keep the CPU flash kernel)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        # [K|V, block, slot in block, kv head, head dim]: a gathered block run views as
        # [tokens, Hkv, D] without copying, and SDPA takes the head-major transpose as is.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, common: AttentionMetadata) -> SDPAMetadata:
        bs = common.block_size
        groups = []
        for start, end in _decode_groups(common.seq_lens_list[:common.num_decodes], bs):
            nblk = -(-common.seq_lens_list[end - 1] // bs)       # rows sorted by length
            nblk = max(nblk, -(-max(common.seq_lens_list[start:end]) // bs))
            arange = torch.arange(nblk * bs, device=common.seq_lens.device)
            mask = (arange[None, :] < common.seq_lens[start:end, None])[:, None, None, :]
            groups.append(_DecodeGroup(start, end,
                                       common.block_table[start:end, :nblk].reshape(-1), mask))
        prefills = []
        qsl, ctxs, seqs = common.query_start_loc_list, common.context_lens_list, common.seq_lens_list
        for i in range(common.num_decodes, common.num_reqs):
            ctx, seq = ctxs[i], seqs[i]
            blocks = mask = None
            if ctx > 0:
                blocks = common.block_table[i, :-(-seq // bs)]
                dev = common.block_table.device
                q_pos = torch.arange(ctx, seq, device=dev)
                mask = torch.arange(seq, device=dev)[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(qsl[i], qsl[i + 1], ctx, seq, blocks, mask))
        return SDPAMetadata(common, groups, prefills)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """kv_cache [2, nb, bs, Hkv, D], block_ids [n] -> [2, n, bs * Hkv * D] (a reused buffer,
        valid until the next call)."""
        n, row = block_ids.numel(), kv_cache[0, 0].numel()
        buf = self._buffer
        if (buf is None or buf.shape[1] < n or buf.shape[2] != row or buf.dtype != kv_cache.dtype
                or buf.device != kv_cache.device):
            buf = self._buffer = torch.empty((2, max(n, 2 * (buf.shape[1] if buf is not None else 0)),
                                              row), dtype=kv_cache.dtype, device=kv_cache.device)
        out = buf[:, :n]
        nb = kv_cache.shape[1]
        torch.index_select(kv_cache[0].view(nb, row), 0, block_ids, out=out[0])
        torch.index_select(kv_cache[1].view(nb, row), 0, block_ids, out=out[1])
        return out

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata) -> torch.Tensor:
        hkv, d = layer.num_kv_heads, layer.head_size
        key_cache, value_cache = kv_cache[0], kv_cache[1]          # [nb, bs, Hkv, D]
        slots = md.slot_mapping
        key_cache.view(-1, hkv, d).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, hkv, d).index_copy_(0, slots, value.to(value_cache.dtype))
        gqa = layer.num_heads != hkv
        out = torch.empty_like(query)                               # [T, H, D]

        group = layer.num_heads // hkv
        for g in md.decode_groups:
            n = g.end - g.start
            kv = self._gather(kv_cache, g.block_ids)               # [2, n * nblk, bs*Hkv*D]
            k = kv[0].view(n, -1, hkv, d).transpose(1, 2)           # [n, Hkv, L, D]
            v = kv[1].view(n, -1, hkv, d).transpose(1, 2)
            q = query[g.start:g.end].reshape(n, hkv, group, d)      # [n, Hkv, G, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask,
                                               scale=layer.scale)  # [n, Hkv, G, D]
            out[g.start:g.end] = o.reshape(n, layer.num_heads, d)

        for p in md.prefills:
            q = query[p.start:p.end].transpose(0, 1)[None]          # [1, H, n, D]
            if p.block_ids is None:
                k = key[p.start:p.end].transpose(0, 1)[None]        # [1, Hkv, n, D]
                v = value[p.start:p.end].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale,
                                                   enable_gqa=gqa)
            else:
                kv = self._gather(kv_cache, p.block_ids)
                k = kv[0].view(-1, hkv, d)[:p.seq_len].transpose(0, 1)[None]
                v = kv[1].view(-1, hkv, d)[:p.seq_len].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=layer.scale,
                                                   enable_gqa=gqa)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out


# A decode group costs one gather and one SDPA call per layer: splitting pays when it saves more
# padded blocks than this (measured: ~50 us of call overhead ~ 32 blocks of copying + attention).
_GROUP_OVERHEAD_BLOCKS = 32
# Bound on the candidate split points, keeping the quadratic search below a millisecond.
_MAX_CANDIDATES = 48


def _decode_groups(seq_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decode rows (sorted by ascending length) into contiguous groups minimizing padded
    blocks + a per-group overhead, by dynamic programming over split points.

    Only points where the block count changes are candidates (splitting a run of equal widths
    adds a call and saves nothing), so the search is over distinct lengths, not rows; past
    ``_MAX_CANDIDATES`` the candidates are thinned evenly.
    """
    n = len(seq_lens)
    if n == 0:
        return []
    blocks = [-(-s // block_size) for s in seq_lens]
    cuts = [0] + [i for i in range(1, n) if blocks[i] != blocks[i - 1]] + [n]
    if len(cuts) > _MAX_CANDIDATES + 1:
        step = (len(cuts) - 1) / _MAX_CANDIDATES
        cuts = sorted({cuts[round(k * step)] for k in range(_MAX_CANDIDATES + 1)})
    m = len(cuts)
    best = [0] + [1 << 60] * (m - 1)    # best[b]: cost of rows [0, cuts[b])
    prev = [0] * m
    for b in range(1, m):
        end = cuts[b]
        width = blocks[end - 1]         # a group pads to its longest (last) row
        for a in range(b):
            cost = best[a] + (end - cuts[a]) * width + _GROUP_OVERHEAD_BLOCKS
            if cost < best[b]:
                best[b], prev[b] = cost, a
    groups, b = [], m - 1
    while b > 0:
        groups.append((cuts[prev[b]], cuts[b]))
        b = prev[b]
    return groups[::-1]
