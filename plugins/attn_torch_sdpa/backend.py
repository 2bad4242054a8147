from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from corellm.attention import (AttentionBuildLimits, AttentionMetadataBuilder, BatchOrder,
                               CommonAttentionMetadata, DeviceArray, KVCacheSpec)
from corellm.errors import ConfigError
from corellm.interfaces import AttentionBackend, AttentionLayerSpec
from corellm.platforms import NativeUnavailable, Platform, host_visible

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("paged_cpu.c")
_NATIVE_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass
class _Prefill:
    start: int                      # offsets into the step's token dimension
    end: int
    context_len: int                # tokens of this request already in the cache
    seq_len: int
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)]; None when context_len == 0


@dataclass
class _DecodeGroup:
    start: int                      # rows [start, end) of the decode part
    end: int
    nblk: int                       # blocks gathered per row (the longest row's)
    block_ids: torch.Tensor         # [(end - start) * nblk] block ids, row-major


@dataclass
class SDPAMetadata:
    slot_mapping: torch.Tensor      # [T] int64
    seq_lens: torch.Tensor          # [num_reqs] int64, on the device
    block_size: int
    decode_groups: list[_DecodeGroup]   # empty on the native decode path
    prefills: list[_Prefill]
    num_decodes: int = 0
    block_table: torch.Tensor | None = None   # [num_reqs, max blocks] (native decode path)
    # Native path: [num prefills, 3] int64, each prefill's first row, context and sequence
    # lengths (its block-table row is num_decodes + its index)
    prefill_meta: torch.Tensor | None = None
    # Masks by sliding window (None: full attention), built on first use by a layer with that
    # window and shared by the step's other such layers: decode groups' [n, 1, 1, L] and
    # prefills' [n, seq_len] (None: plain causal, SDPA's is_causal).
    _masks: dict = field(default_factory=dict)

    def masks(self, window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        found = self._masks.get(window)
        if found is None:
            found = self._masks[window] = self._build_masks(window)
        return found

    def _build_masks(self, window: int | None):
        dev, bs = self.seq_lens.device, self.block_size
        decode = []
        for g in self.decode_groups:
            k_pos = torch.arange(g.nblk * bs, device=dev)[None, :]
            seq = self.seq_lens[g.start:g.end, None]
            mask = k_pos < seq
            if window is not None:
                mask &= k_pos >= seq - window           # the query sits at seq - 1
            decode.append(mask[:, None, None, :])
        prefill = []
        for p in self.prefills if self.prefill_meta is None else ():   # native: no masks
            if p.context_len == 0 and (window is None or p.seq_len <= window):
                prefill.append(None)
                continue
            q_pos = torch.arange(p.context_len, p.seq_len, device=dev)[:, None]
            k_pos = torch.arange(p.seq_len, device=dev)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            prefill.append(mask)
        return decode, prefill


class SDPAMetadataBuilder(AttentionMetadataBuilder):
    """Decodes first, by ascending length (the decode groups are contiguous runs of similar
    length); persistent int64 buffers for the slots, lengths and block table."""

    batch_order = BatchOrder.DECODES_FIRST

    def __init__(self, limits: AttentionBuildLimits, native_decode: bool = False,
                 native_prefill: bool = False) -> None:
        dev, n = limits.device, limits.max_num_seqs
        self.native_decode = native_decode
        self.native_prefill = native_prefill
        # The native decode path: one kernel call per layer reading these buffers, the same
        # call for every decode-only step of a row count, so a step may be recorded and
        # replayed (the CPU platform's cpu_graphs) when they stay where they are.
        self.replayable = fixed = native_decode and host_visible(dev)
        self._slots = DeviceArray((limits.max_num_batched_tokens,), torch.int64, dev, fixed)
        self._seq = DeviceArray((n,), torch.int64, dev, fixed)
        self._table = DeviceArray((n, limits.max_blocks_per_seq), torch.int64, dev, fixed)

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        bs = common.block_size
        seqs = common.seq_lens.tolist()
        table = self._table.put(common.block_table)
        groups = []
        if not self.native_decode:
            for start, end in _decode_groups(seqs[:common.num_decodes], bs):
                nblk = -(-max(seqs[start:end]) // bs)
                groups.append(_DecodeGroup(start, end, nblk,
                                           table[start:end, :nblk].reshape(-1)))
        prefills = []
        qsl, ctxs = common.query_start_loc.tolist(), common.context_lens.tolist()
        for i in range(common.num_decodes, common.num_reqs):
            ctx, seq = ctxs[i], seqs[i]
            blocks = table[i, :-(-seq // bs)] if ctx > 0 else None
            prefills.append(_Prefill(qsl[i], qsl[i + 1], ctx, seq, blocks))
        meta = None
        if self.native_prefill and prefills:
            meta = torch.tensor([(p.start, p.context_len, p.seq_len) for p in prefills],
                                dtype=torch.int64)
        return SDPAMetadata(self._slots.put(common.slot_mapping),
                            self._seq.put(common.seq_lens), bs, groups, prefills,
                            common.num_decodes, table, meta)


class TorchSDPABackend(AttentionBackend):
    """Decodes, native path (CPU, float32/bfloat16): one call of a C kernel (``paged_cpu.c``)
    for all of a step's decodes, reading each K/V row in place through the block table, with
    the new K/V written to their slots by the same library; windows are a key range.
    Prefills, native path (the same conditions): one call for all of a step's prefills, over
    their K/V in the cache (cached context included), on the core's GEMM micro-kernel.
    Decodes, gather path (elsewhere): grouped by length (rows arrive sorted), the blocks of
    each group's requests are gathered (``index_select`` into a persistent buffer: allocating
    it afresh each layer cost more than the copy) into [nd, Hkv, L, D] and attended in one SDPA
    call, with each KV head's query group folded into the query axis so K/V are read once per
    KV head rather than once per query head; windows are masks.
    Prefills, SDPA path (elsewhere): one SDPA call each, causal (4-D inputs, which keep the CPU
    flash kernel).
    Logit soft-capping is refused (SDPA has no hook between the scores and the softmax)."""

    def __init__(self, decode: str = "auto", device: torch.device | None = None,
                 dtype: torch.dtype | None = None, prefill: str = "auto",
                 platform: Platform | None = None) -> None:
        self._buffer: torch.Tensor | None = None
        self._native = _native_kernels(decode, prefill, device, dtype, platform)
        self.decode_path = "native" if self._native and decode != "gather" else "gather"
        self.prefill_path = "native" if self._native and prefill != "sdpa" else "sdpa"

    def supports(self, layer: AttentionLayerSpec, dtype: torch.dtype,
                 device: torch.device) -> str | None:
        if layer.logit_soft_cap is not None:
            return (f"logit_soft_cap={layer.logit_soft_cap:g} is not supported (SDPA applies "
                    "the softmax itself; the triton backend supports soft-capping)")
        return None

    def kv_cache_spec(self, layer: AttentionLayerSpec, num_blocks: int, block_size: int,
                      dtype: torch.dtype) -> KVCacheSpec:
        # [K|V, block, slot in block, kv head, head dim]: a gathered block run views as
        # [tokens, Hkv, D] without copying, and SDPA takes the head-major transpose as is.
        # Zeroed for the gather path: a gathered group pads short rows with unwritten slots
        # (masked out, but 0 * NaN would still poison the output). The native path reads
        # written slots only.
        return KVCacheSpec((2, num_blocks, block_size, layer.num_kv_heads, layer.head_size),
                           dtype, zero_init=self.decode_path == "gather")

    def make_metadata_builder(self, limits: AttentionBuildLimits) -> SDPAMetadataBuilder:
        return SDPAMetadataBuilder(limits, native_decode=self.decode_path == "native",
                                   native_prefill=self.prefill_path == "native")

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """kv_cache [2, nb, bs, Hkv, D], block_ids [n] -> [2, n, bs * Hkv * D] (a reused buffer,
        valid until the next call)."""
        n, row = block_ids.numel(), kv_cache[0, 0].numel()
        buf = self._buffer
        if (buf is None or buf.shape[1] < n or buf.shape[2] != row or buf.dtype != kv_cache.dtype
                or buf.device != kv_cache.device):
            grow = max(n, 2 * (buf.shape[1] if buf is not None else 0))
            buf = self._buffer = torch.empty((2, grow, row), dtype=kv_cache.dtype,
                                             device=kv_cache.device)
        out = buf[:, :n]
        nb = kv_cache.shape[1]
        torch.index_select(kv_cache[0].view(nb, row), 0, block_ids, out=out[0])
        torch.index_select(kv_cache[1].view(nb, row), 0, block_ids, out=out[1])
        return out

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, md: SDPAMetadata) -> torch.Tensor:
        hkv, d = layer.num_kv_heads, layer.head_size
        slots = md.slot_mapping
        native = self._native
        # The native decode kernel writes its rows' K/V itself (each just before reading that
        # sequence's cache); the other rows are written here, before any kernel reads them.
        nd = md.num_decodes
        fused = (self.decode_path == "native" and nd > 0
                 and native.takes_kv(key, value, kv_cache, slots))
        if not fused:
            nd = 0
        if nd < key.shape[0]:
            k, v, s = (key[nd:], value[nd:], slots[nd:]) if nd else (key, value, slots)
            if native is None or not native.write_kv(k, v, kv_cache, s):
                cache = kv_cache.view(2, -1, hkv, d)                 # [K|V, slot, Hkv, D]
                cache[0].index_copy_(0, s, k.to(kv_cache.dtype))
                cache[1].index_copy_(0, s, v.to(kv_cache.dtype))
        gqa = layer.num_heads != hkv
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
        if self.decode_path == "native" and md.num_decodes:
            native.decode(layer, query, kv_cache, md, out,
                          (key, value, slots) if fused else None)
        if md.prefill_meta is not None:                     # the native prefill path
            native.prefill(layer, query, kv_cache, md, out)
            if not md.decode_groups:
                return out
        decode_masks, prefill_masks = md.masks(layer.sliding_window)

        group = layer.num_heads // hkv
        for g, mask in zip(md.decode_groups, decode_masks):
            n = g.end - g.start
            kv = self._gather(kv_cache, g.block_ids)               # [2, n * nblk, bs*Hkv*D]
            k = kv[0].view(n, -1, hkv, d).transpose(1, 2)           # [n, Hkv, L, D]
            v = kv[1].view(n, -1, hkv, d).transpose(1, 2)
            q = query[g.start:g.end].reshape(n, hkv, group, d)      # [n, Hkv, G, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                               scale=layer.scale)  # [n, Hkv, G, D]
            out[g.start:g.end] = o.reshape(n, layer.num_heads, d)

        for p, mask in zip(md.prefills, prefill_masks):       # none on the native path
            q = query[p.start:p.end].transpose(0, 1)[None]          # [1, H, n, D]
            if p.block_ids is None:
                k = key[p.start:p.end].transpose(0, 1)[None]        # [1, Hkv, n, D]
                v = value[p.start:p.end].transpose(0, 1)[None]
            else:
                kv = self._gather(kv_cache, p.block_ids)
                k = kv[0].view(-1, hkv, d)[:p.seq_len].transpose(0, 1)[None]
                v = kv[1].view(-1, hkv, d)[:p.seq_len].transpose(0, 1)[None]
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale,
                                                   enable_gqa=gqa)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale,
                                                   enable_gqa=gqa)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out


def _num_slots(kv_cache: torch.Tensor) -> int:
    return kv_cache.shape[1] * kv_cache.shape[2]           # blocks x tokens per block


def _slot_error(slots: torch.Tensor, kv_cache: torch.Tensor) -> IndexError:
    """The error for a slot mapping that points past the cache (a KV manager's bug): the C
    kernels check it and write nothing."""
    n = _num_slots(kv_cache)
    bad = [(i, s) for i, s in enumerate(slots.tolist()) if s >= n]
    return IndexError(f"torch_sdpa: slot {bad[0][1] if bad else '?'} of token "
                      f"{bad[0][0] if bad else '?'} is outside the KV cache's {n} slots")


def _kv_ptrs(kv_cache: torch.Tensor) -> tuple[int, int]:
    """The addresses of a layer's K and V caches (``kv_cache[0]``, ``kv_cache[1]``) without
    making the two views."""
    k = kv_cache.data_ptr()
    return k, k + kv_cache.stride(0) * kv_cache.element_size()


class _NativeKernels:
    """ctypes bindings of ``paged_cpu.c`` for one dtype."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._decode = getattr(lib, f"corellm_paged_decode_{_NATIVE_DTYPES[dtype]}")
        self._decode.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                                 ctypes.c_float, i64, ptr, i64, ptr, i64, ptr, i64]
        self._decode.restype = ctypes.c_int
        self._prefill = getattr(lib, f"corellm_paged_prefill_{_NATIVE_DTYPES[dtype]}")
        self._prefill.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64,
                                  i64, ctypes.c_float, i64]
        self._prefill.restype = ctypes.c_int
        self._write = lib.corellm_write_kv
        self._write.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        self._write.restype = ctypes.c_int
        self.dtype = dtype

    @staticmethod
    def takes_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """Whether the kernels write these K/V rows [T, Hkv, D] to their slots themselves: the
        cache's dtype, heads contiguous within a token, int64 slots, one per token."""
        d = key.shape[2]
        for x in (key, value):
            if (x.dtype != kv_cache.dtype or x.stride(2) != 1 or x.stride(1) != d
                    or not host_visible(x.device)):
                return False
        return (slots.dtype == torch.int64 and slots.is_contiguous()
                and slots.numel() == key.shape[0])

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slots: torch.Tensor) -> bool:
        """Copy each token's K/V row to its slot; False (nothing done) for inputs it does not
        take (:meth:`takes_kv`)."""
        if not self.takes_kv(key, value, kv_cache, slots):
            return False
        t, hkv, d = key.shape
        row = hkv * d * kv_cache.element_size()
        if self._write(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                       *_kv_ptrs(kv_cache), slots.data_ptr(), _num_slots(kv_cache), t, row,
                       kv_cache.element_size()):
            raise _slot_error(slots, kv_cache)
        return True

    def decode(self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor,
               md: SDPAMetadata, out: torch.Tensor,
               new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Attention of the step's decode rows (the first ``md.num_decodes``) into ``out``.
        ``new_kv``: the step's K, V and slots (the decode rows' K/V, which the kernel writes
        to their slots, each before its sequence is read: one pass and no separate call;
        :meth:`takes_kv` must hold for them), or None when they are already in the cache.
        The writes run while other sequences are read, so no decode's slot may lie in a block
        another sequence of the step reads: the KV managers never share a block that is still
        being written (a prefix-cache hit never includes the block of a sequence's last
        token)."""
        nd = md.num_decodes
        q = query[:nd]
        if q.stride(2) != 1 or q.stride(1) != layer.head_size:
            q = q.contiguous()
        table, seq = md.block_table, md.seq_lens
        if new_kv is None:
            kn = kv = slots = None
            kn_stride = kv_stride = 0
        else:
            k, v, new_slots = new_kv
            kn, kv, slots = k.data_ptr(), v.data_ptr(), new_slots.data_ptr()
            kn_stride, kv_stride = k.stride(0), v.stride(0)
        rc = self._decode(q.data_ptr(), q.stride(0), *_kv_ptrs(kv_cache),
                          table.data_ptr(), table.stride(0),
                          seq.data_ptr(), out.data_ptr(), nd, layer.num_heads,
                          layer.num_kv_heads, layer.head_size, md.block_size, layer.scale,
                          layer.sliding_window or 0, kn, kn_stride, kv, kv_stride, slots,
                          _num_slots(kv_cache))
        if rc == -2:
            raise _slot_error(new_kv[2][:nd], kv_cache)
        if rc != 0:
            raise MemoryError("paged decode attention: out of memory for its score buffers")


    def prefill(self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor,
                md: SDPAMetadata, out: torch.Tensor) -> None:
        """Attention of the step's prefill rows (after its decodes) into ``out``, over their
        K/V already written to the cache."""
        q = query
        if q.stride(2) != 1 or q.stride(1) != layer.head_size:
            q = q.contiguous()
        table = md.block_table[md.num_decodes:]
        rc = self._prefill(q.data_ptr(), q.stride(0), *_kv_ptrs(kv_cache),
                           table.data_ptr(), table.stride(0),
                           md.prefill_meta.data_ptr(), md.prefill_meta.shape[0], out.data_ptr(),
                           layer.num_heads, layer.num_kv_heads, layer.head_size, md.block_size,
                           layer.scale, layer.sliding_window or 0)
        if rc != 0:
            raise MemoryError("paged prefill attention: out of memory for its scratch buffers")


def _native_kernels(decode: str, prefill: str, device: torch.device | None,
                    dtype: torch.dtype | None,
                    platform: Platform | None) -> _NativeKernels | None:
    """The native kernels when ``decode`` or ``prefill`` asks for them and they can run here
    (the K/V in host memory, and a platform that builds C kernels: the CPU platform), else None
    (``auto``: with the reason logged). ``native`` that cannot run is a ConfigError naming its
    key."""
    if decode == "gather" and prefill == "sdpa":
        return None
    reason = None
    if device is None or not host_visible(torch.device(device)):
        reason = f"runs on the CPU only (device: {device})"
    elif dtype not in _NATIVE_DTYPES:
        reason = f"takes float32 or bfloat16 (dtype: {dtype})"
    elif platform is None:
        reason = "needs a platform to build it (none given)"
    lib = None
    if reason is None:
        try:
            lib = platform.native_library("corellm_paged_cpu", _SOURCE, ("-ffast-math",))
        except NativeUnavailable as exc:
            reason = str(exc)
    if reason is not None:
        if decode == "native":
            raise ConfigError([("attention.decode", f"native: the in-place decode kernel {reason}; "
                                                    "use decode: auto or gather")])
        if prefill == "native":
            raise ConfigError([("attention.prefill", f"native: the prefill kernel {reason}; use "
                                                     "prefill: auto or sdpa")])
        logger.info("torch_sdpa: decodes gather KV blocks and prefills call SDPA (the native "
                    "kernels %s)", reason)
        return None
    logger.info("torch_sdpa: native kernels (%s): decodes %s, prefills %s", dtype,
                "read KV blocks in place" if decode != "gather" else "gather KV blocks",
                "on GEMM tiles" if prefill != "sdpa" else "call SDPA")
    return _NativeKernels(lib, dtype)


# A decode group costs one gather and one SDPA call per layer: splitting pays when it saves more
# padded blocks than this, a call's fixed overhead counted in the blocks of copying and attention
# that cost as much (estimated from a decode-step profile).
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
