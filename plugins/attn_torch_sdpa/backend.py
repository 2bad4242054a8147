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
class SDPAMetadata:
    common: AttentionMetadata
    num_decodes: int
    decode_block_table: torch.Tensor | None   # [num_decodes, nblk]
    decode_mask: torch.Tensor | None          # [num_decodes, 1, 1, nblk * block_size] bool
    prefills: list[_Prefill]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.common.slot_mapping


class TorchSDPABackend(AttentionBackend):
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        # [K|V, block, slot in block, kv head, head dim]: a gathered block run views as
        # [tokens, Hkv, D] without copying, and SDPA takes the head-major transpose as is.
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, common: AttentionMetadata) -> SDPAMetadata:
        bs = common.block_size
        nd = common.num_decodes
        dec_bt = dec_mask = None
        if nd:
            max_len = max(common.seq_lens_list[:nd])
            nblk = -(-max_len // bs)
            dec_bt = common.block_table[:nd, :nblk]
            arange = torch.arange(nblk * bs, device=common.seq_lens.device)
            dec_mask = (arange[None, :] < common.seq_lens[:nd, None])[:, None, None, :]
        prefills = []
        qsl, ctxs, seqs = common.query_start_loc_list, common.context_lens_list, common.seq_lens_list
        for i in range(nd, common.num_reqs):
            ctx, seq = ctxs[i], seqs[i]
            blocks = mask = None
            if ctx > 0:
                blocks = common.block_table[i, :-(-seq // bs)]
                dev = common.block_table.device
                q_pos = torch.arange(ctx, seq, device=dev)
                mask = torch.arange(seq, device=dev)[None, :] <= q_pos[:, None]
            prefills.append(_Prefill(qsl[i], qsl[i + 1], ctx, seq, blocks, mask))
        return SDPAMetadata(common, nd, dec_bt, dec_mask, prefills)

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata) -> torch.Tensor:
        hkv, d = layer.num_kv_heads, layer.head_size
        key_cache, value_cache = kv_cache[0], kv_cache[1]          # [nb, bs, Hkv, D]
        slots = md.slot_mapping
        key_cache.view(-1, hkv, d).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, hkv, d).index_copy_(0, slots, value.to(value_cache.dtype))
        gqa = layer.num_heads != hkv
        out = torch.empty_like(query)                               # [T, H, D]

        nd = md.num_decodes
        if nd:
            # Gather whole blocks (index_select copies rows; several times faster on CPU than
            # advanced indexing): [nd * nblk, bs*Hkv*D] -> [nd, L, Hkv, D] -> [nd, Hkv, L, D].
            flat = md.decode_block_table.reshape(-1)
            k = _gather(key_cache, flat).view(nd, -1, hkv, d).transpose(1, 2)
            v = _gather(value_cache, flat).view(nd, -1, hkv, d).transpose(1, 2)
            q = query[:nd].unsqueeze(2)                             # [nd, H, 1, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=md.decode_mask,
                                               scale=layer.scale, enable_gqa=gqa)
            out[:nd] = o.squeeze(2)

        for p in md.prefills:
            q = query[p.start:p.end].transpose(0, 1)                # [H, n, D]
            if p.block_ids is None:
                k = key[p.start:p.end].transpose(0, 1)              # [Hkv, n, D]
                v = value[p.start:p.end].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale,
                                                   enable_gqa=gqa)
            else:
                k = _gather(key_cache, p.block_ids).view(-1, hkv, d)[:p.seq_len].transpose(0, 1)
                v = _gather(value_cache, p.block_ids).view(-1, hkv, d)[:p.seq_len].transpose(0, 1)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, scale=layer.scale,
                                                   enable_gqa=gqa)
            out[p.start:p.end] = o.transpose(0, 1)
        return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [nb, bs, Hkv, D], block_ids [n] -> [n, bs * Hkv * D]."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids)
