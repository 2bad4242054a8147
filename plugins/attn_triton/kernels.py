"""Triton kernels of the ``triton`` attention backend, and their launchers.

The KV cache of one layer is ``[2, num_blocks, block_size, Hkv, D]`` (K then V; a token's
head vectors contiguous, as FlashAttention's paged layout), read in place through the block
table: no kernel gathers a request's blocks into a contiguous copy.

* ``write_kv``: one program per new token stores its K and V rows at its slot.
* ``paged_attention``: one program per (query tile, KV head). A query tile is up to ``BLOCK_Q``
  consecutive query tokens of one request; its rows are those tokens times the ``G`` query heads
  of the KV head (padded to a power of two), so each K/V tile is loaded once for the whole
  group. The program walks the request's keys from the window's start (0 without one) to the
  tile's last query position in ``BLOCK_N``-token tiles, looking each key's block up in the
  block table, with an online softmax in fp32. The same program serves a decode (one query
  token), a whole prefill, a chunk after cached context (a prefix-cache hit, a chunked prefill,
  recomputation after preemption): the causal limit is each query's absolute position.
* ``paged_attention_split`` + ``combine_splits``: the flash-decoding path for long contexts at
  small batch: each decode's keys are cut into ``num_splits`` ranges attended by separate
  programs (more programs than ``num_decodes x Hkv`` alone would give the GPU), whose partial
  results (unnormalized output, running max, sum) are merged by a second kernel.

Dot products take the cache's fp16/bf16 operands (tensor cores) and accumulate in fp32; an fp32
cache takes IEEE fp32 dots, not TF32; the softmax statistics and the output accumulator are
fp32, and outputs are stored in the query's dtype. Every load
of a key position outside the request, and every query row outside the tile, is masked, so the
pool needs no zero-fill and an unwritten slot is never read.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_c_kv, stride_c_slot, stride_c_head,
                     HKV: tl.constexpr, HKV_PAD: tl.constexpr, D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    h = tl.arange(0, HKV_PAD)[:, None]
    d = tl.arange(0, D)[None, :]
    # slot < 0: a padding token, written nowhere (compared as a tile: the interpreter takes no
    # scalar in a mask)
    mask = (h < HKV) & ((d * 0 + slot) >= 0)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_head + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _operand(x, cache_ptr, UPCAST: tl.constexpr):
    """``x`` as a dot operand: fp32 with ``UPCAST``, else the cache's dtype."""
    if UPCAST:
        x = x.to(tl.float32)
    else:
        x = x.to(cache_ptr.dtype.element_ty)
    return x


@triton.jit
def _attend(q, q_pos, cache_ptr, table_row_ptr, kvh, lo, hi, scale, soft_cap, window,
            stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
            IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Attention of the query rows ``q`` [M, D] at absolute positions ``q_pos`` [M] over keys
    [lo, hi) of one request and KV head: (unnormalized output, running max, sum), by an online
    softmax in fp32 (the dot products take fp32 operands with ``UPCAST``, else the cache's
    16-bit ones with fp32 accumulation)."""
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < hi
        block = tl.load(table_row_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
        off = (block.to(tl.int64) * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
               + kvh * stride_c_head)
        k = _operand(tl.load(cache_ptr + off[None, :] + d[:, None], mask=k_valid[None, :],
                             other=0.0), cache_ptr, UPCAST)                     # [D, N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale                                                           # [M, N]
        if USE_SOFT_CAP:
            # cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both limits
            s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0))
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _operand(tl.load(cache_ptr + stride_c_kv + off[:, None] + d[None, :],
                             mask=k_valid[:, None], other=0.0), cache_ptr, UPCAST)  # [N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
        q_ptr, o_ptr, cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr, tile_req_ptr,
        tile_q_ptr, scale, soft_cap, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
        stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
        G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, BLOCK_SIZE: tl.constexpr, USE_WINDOW: tl.constexpr,
        USE_SOFT_CAP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q_ptr + tile)                 # first query index of the tile
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // G_PAD
    g = rows % G_PAD
    row_valid = (qi < q_len) & (g < G)
    head = kvh * G + g
    d = tl.arange(0, D)
    q = _operand(tl.load(q_ptr + (q_begin + qi)[:, None].to(tl.int64) * stride_qt
                         + head[:, None] * stride_qh + d[None, :],
                         mask=row_valid[:, None], other=0.0), cache_ptr, UPCAST)
    q_pos = ctx_len + qi

    hi = tl.minimum(seq_len, ctx_len + q0 + BLOCK_Q)      # past the tile's last query
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx_len + q0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    acc, m_i, l_i = _attend(q, q_pos, cache_ptr, table_ptr + req.to(tl.int64) * stride_table,
                            kvh, lo, hi, scale, soft_cap, window, stride_c_kv, stride_c_block,
                            stride_c_slot, stride_c_head, BLOCK_M, BLOCK_N, D, BLOCK_SIZE,
                            USE_WINDOW, USE_SOFT_CAP, IEEE, UPCAST)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + (q_begin + qi)[:, None].to(tl.int64) * stride_ot
             + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _paged_attention_split_kernel(
        q_ptr, part_o_ptr, part_m_ptr, part_l_ptr, cache_ptr, table_ptr, seq_lens_ptr,
        query_start_ptr, scale, soft_cap, window,
        stride_qt, stride_qh, stride_table,
        stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
        H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Decode row ``req`` (one query token), KV head ``kvh``, key range ``split`` of
    ``NUM_SPLITS``: partial output [G, D], max and sum into the fp32 scratch buffers
    ``[num_decodes, H, NUM_SPLITS, (D)]``."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    g = tl.arange(0, BLOCK_M)
    row_valid = g < G
    head = kvh * G + g
    d = tl.arange(0, D)
    q = _operand(tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh
                         + d[None, :], mask=row_valid[:, None], other=0.0), cache_ptr, UPCAST)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)

    first = 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    acc, m_i, l_i = _attend(q, q_pos, cache_ptr, table_ptr + req.to(tl.int64) * stride_table,
                            kvh, lo, hi, scale, soft_cap, window, stride_c_kv, stride_c_block,
                            stride_c_slot, stride_c_head, BLOCK_M, BLOCK_N, D, BLOCK_SIZE,
                            USE_WINDOW, USE_SOFT_CAP, IEEE, UPCAST)
    part = (req * H + head) * NUM_SPLITS + split                               # [M]
    tl.store(part_m_ptr + part, m_i, mask=row_valid)
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_o_ptr + part[:, None].to(tl.int64) * D + d[None, :], acc,
             mask=row_valid[:, None])


@triton.jit
def _combine_splits_kernel(part_o_ptr, part_m_ptr, part_l_ptr, o_ptr, query_start_ptr,
                           stride_ot, stride_oh,
                           H: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           SPLITS_PAD: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    valid = s < NUM_SPLITS
    base = (req * H + head) * NUM_SPLITS
    m = tl.load(part_m_ptr + base + s, mask=valid, other=float("-inf"))
    l_part = tl.load(part_l_ptr + base + s, mask=valid, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))        # empty splits weigh 0
    denom = tl.sum(l_part * w, 0)
    d = tl.arange(0, D)
    o = tl.load(part_o_ptr + (base + s)[:, None].to(tl.int64) * D + d[None, :],
                mask=valid[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    q_row = tl.load(query_start_ptr + req)
    tl.store(o_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(o_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- launchers
def _upcast(cache_dtype: torch.dtype) -> bool:
    """fp32 dot operands for an fp32 cache, and for bf16 under the interpreter (whose numpy
    has no bf16 arithmetic); otherwise the 16-bit operands tensor cores take, accumulated in
    fp32 (fp16 under the interpreter exercises that path on the CPU)."""
    if cache_dtype == torch.float32:
        return True
    return cache_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] (last dim contiguous) -> kv_cache [2, nb, bs, Hkv, D] at the
    slots (a negative slot writes nothing)."""
    t, hkv, d = key.shape
    if t == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_kernel[(t,)](key, value, kv_cache, slot_mapping,
                           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                           kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
                           HKV=hkv, HKV_PAD=triton.next_power_of_2(hkv), D=d)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, tile_req: torch.Tensor,
                    tile_q: torch.Tensor, num_tiles: int, *, num_kv_heads: int, scale: float,
                    block_q: int, block_n: int, sliding_window: int | None,
                    logit_soft_cap: float | None, num_warps: int, num_stages: int) -> None:
    """Attention of the query tiles (``tile_req[i]``'s queries from ``tile_q[i]``, ``block_q``
    at most) into ``out`` [T, H, D]; rows of ``out`` no tile covers are left untouched."""
    if num_tiles == 0:
        return
    assert query.stride(-1) == 1 and out.stride(-1) == 1, "head dims must be contiguous"
    _, h, d = query.shape
    g = h // num_kv_heads
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        query, out, kv_cache, block_table, seq_lens, query_start_loc, tile_req, tile_q,
        scale, logit_soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        G=g, G_PAD=triton.next_power_of_2(g), BLOCK_Q=block_q, BLOCK_N=block_n, D=d,
        BLOCK_SIZE=kv_cache.shape[2], USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logit_soft_cap is not None, IEEE=kv_cache.dtype == torch.float32,
        UPCAST=_upcast(kv_cache.dtype), num_warps=num_warps, num_stages=num_stages)


def paged_attention_split(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, num_decodes: int, num_splits: int, *,
                          num_kv_heads: int, scale: float, block_n: int,
                          sliding_window: int | None, logit_soft_cap: float | None,
                          num_warps: int, num_stages: int) -> None:
    """Split-KV attention of the first ``num_decodes`` requests (one query token each) into
    ``out``."""
    if num_decodes == 0:
        return
    _, h, d = query.shape
    g = h // num_kv_heads
    dev = query.device
    part_o = torch.empty((num_decodes, h, num_splits, d), dtype=torch.float32, device=dev)
    part_m = torch.empty((num_decodes, h, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty((num_decodes, h, num_splits), dtype=torch.float32, device=dev)
    g_pad = triton.next_power_of_2(g)
    _paged_attention_split_kernel[(num_decodes, num_kv_heads, num_splits)](
        query, part_o, part_m, part_l, kv_cache, block_table, seq_lens, query_start_loc,
        scale, logit_soft_cap or 0.0, sliding_window or 0,
        query.stride(0), query.stride(1), block_table.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        H=h, G=g, G_PAD=g_pad, BLOCK_M=max(16, g_pad), BLOCK_N=block_n, D=d,
        BLOCK_SIZE=kv_cache.shape[2], NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None, USE_SOFT_CAP=logit_soft_cap is not None,
        IEEE=kv_cache.dtype == torch.float32, UPCAST=_upcast(kv_cache.dtype),
        num_warps=num_warps, num_stages=num_stages)
    _combine_splits_kernel[(num_decodes, h)](
        part_o, part_m, part_l, out, query_start_loc, out.stride(0), out.stride(1),
        H=h, D=d, NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits))
