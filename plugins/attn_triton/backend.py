"""The ``triton`` backend: its metadata builder and the per-layer calls into the kernels."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from corellm.attention import (AttentionBuildLimits, AttentionMetadataBuilder, BatchOrder,
                               CommonAttentionMetadata, DeviceArray, KVCacheSpec)
from corellm.interfaces import AttentionBackend, AttentionLayerSpec
from corellm_plugins.attn_triton import TritonAttentionOptions

HEAD_SIZES = (16, 32, 64, 128, 256)     # powers of two: tl.arange and tl.dot need them
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def device_problem(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` (None: they can)."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (f"Triton kernels run on CUDA devices (or, for testing, on the CPU under "
            f"TRITON_INTERPRET=1); got {device.type!r}")


@dataclass
class TritonMetadata:
    """One step's metadata: int32 lengths and block table, int64 slots, in persistent device
    buffers; the query-tile grids, by tile height, built on first use."""

    builder: TritonMetadataBuilder
    num_reqs: int
    num_decodes: int
    num_splits: int                 # > 1: the decodes take the split-KV path
    slot_mapping: torch.Tensor      # [T] int64
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32
    seq_lens: torch.Tensor          # [num_reqs] int32
    block_table: torch.Tensor       # [num_reqs, max_blocks] int32
    query_lens: np.ndarray          # host, for the tile grids
    _tiles: dict = field(default_factory=dict)

    def tiles(self, part: str, first: int, last: int,
              block_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(request of each tile, its first query index, number of tiles) for tiles of
        ``block_q`` query tokens over requests ``first .. last - 1`` (``part``: "decode" or
        "prefill", each grid in buffers of its own)."""
        key = (part, block_q)
        found = self._tiles.get(key)
        if found is None:
            found = self._tiles[key] = self.builder.tile_grid(key, self.query_lens, first, last,
                                                              block_q)
        return found


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Decodes first (the split-KV path takes the leading rows); the step's arrays go into
    persistent int32 device buffers through pinned host memory.

    ``cuda_graphs``: a CUDA graph captured for a decode batch of ``B`` rows replays any
    decode-only step of ``n <= B`` rows within the limits, because (1) every buffer keeps its
    address for steps within the limits; (2) a decode-only step's block table has a fixed row
    stride (the widest a request can need), which the kernels take as an argument; (3) the decode tile
    grid is the same every step (one tile per request), so it is put on the device once; and
    (4) a decode-only step fills its rows past the last, up to ``max_num_seqs``, with padding
    rows that store nothing (slot -1, which ``write_kv`` skips) and attend to no key (sequence
    length 0: the kernels' key loop is empty and the row's output is 0), so the stale values
    of an earlier, larger step never reach a replayed graph. A graph's decodes take the
    single-pass kernel: split-KV is chosen per step from the lengths, which a graph cannot."""

    batch_order = BatchOrder.DECODES_FIRST
    cuda_graphs = True

    def __init__(self, limits: AttentionBuildLimits, options: TritonAttentionOptions) -> None:
        dev, n, t = limits.device, limits.max_num_seqs, limits.max_num_batched_tokens
        self.options = options
        # Slots of a step's tokens, or of the max_num_seqs rows a decode-only step is padded to.
        self._slots = DeviceArray((max(t, n),), torch.int64, dev)
        self._qsl = DeviceArray((n + 1,), torch.int32, dev)
        self._seq = DeviceArray((n,), torch.int32, dev)
        self._table = DeviceArray((n, limits.max_blocks_per_seq), torch.int32, dev)
        self._limits = limits
        # Per prefill grid (tile height): its own persistent buffers, so one grid's copy never
        # overwrites another's view within a step.
        self._grids: dict[tuple[str, int], tuple[DeviceArray, DeviceArray]] = {}
        self._decode_grid: tuple[torch.Tensor, torch.Tensor] | None = None

    def num_splits(self, common: CommonAttentionMetadata) -> int:
        """Split-KV for the decodes when they are few and long: enough ranges that each holds
        about half of ``split_kv_min_len`` keys, at most ``max_kv_splits``."""
        o, nd = self.options, common.num_decodes
        if nd == 0 or nd > o.split_kv_max_batch:
            return 1
        longest = int(common.seq_lens[:nd].max())
        if longest < o.split_kv_min_len:
            return 1
        return max(2, min(o.max_kv_splits, -(-longest // max(1, o.split_kv_min_len // 2))))

    def tile_grid(self, key: tuple[str, int], query_lens: np.ndarray, first: int, last: int,
                  block_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if key[0] == "decode" and first == 0:
            return self.decode_grid(last)
        buffers = self._grids.get(key)
        if buffers is None:
            size, dev = self._limits.max_num_batched_tokens, self._limits.device
            buffers = self._grids[key] = (DeviceArray((size,), torch.int32, dev),
                                          DeviceArray((size,), torch.int32, dev))
        lens = query_lens[first:last]
        per_req = -(-lens // block_q)
        total = int(per_req.sum())
        req = np.repeat(np.arange(first, first + len(lens), dtype=np.int32), per_req)
        starts = np.zeros(len(lens), dtype=np.int64)
        np.cumsum(per_req[:-1], out=starts[1:])
        q = ((np.arange(total) - np.repeat(starts, per_req)) * block_q).astype(np.int32)
        return buffers[0].put(req), buffers[1].put(q), total

    def decode_grid(self, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The tiles of decodes ``0 .. num_decodes - 1``: one each (a single query token fits
        any tile height), request ``i`` from query index 0, whatever the step."""
        grid = self._decode_grid
        if grid is None or grid[0].numel() < num_decodes:
            size = max(num_decodes, self._limits.max_num_seqs)
            dev = self._limits.device
            grid = self._decode_grid = (torch.arange(size, dtype=torch.int32, device=dev),
                                        torch.zeros(size, dtype=torch.int32, device=dev))
        return grid[0][:num_decodes], grid[1][:num_decodes], num_decodes

    def build(self, common: CommonAttentionMetadata) -> TritonMetadata:
        n, t = common.num_reqs, common.num_actual_tokens
        qsl, seq_lens, slots = common.query_start_loc, common.seq_lens, common.slot_mapping
        rows = self._limits.max_num_seqs
        if common.num_decodes == n and n < rows:    # decode-only: padded to max_num_seqs rows
            qsl = np.arange(rows + 1, dtype=np.int32)
            seq_lens = np.concatenate([seq_lens, np.zeros(rows - n, dtype=seq_lens.dtype)])
            slots = np.concatenate([slots, np.full(rows - n, -1, dtype=slots.dtype)])
        table = common.block_table
        width = max(self._limits.max_blocks_per_seq, table.shape[1])
        # Only a decode-only step can replay a graph: the others keep their narrower table
        # (fewer bytes to copy at long max_model_len), as the kernels take the stride.
        if common.num_decodes == n and table.shape[1] != width:
            wide = np.zeros((n, width), dtype=np.int32)
            wide[:, :table.shape[1]] = table
            table = wide
        return TritonMetadata(
            builder=self, num_reqs=n, num_decodes=common.num_decodes,
            num_splits=self.num_splits(common),
            slot_mapping=self._slots.put(slots)[:t],
            query_start_loc=self._qsl.put(qsl)[:n + 1], seq_lens=self._seq.put(seq_lens)[:n],
            block_table=self._table.put(table), query_lens=np.diff(common.query_start_loc))


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton kernels (``kernels.py``): K/V written through the slot mapping,
    attention read in place through the block table for mixed prefill/chunked/decode batches,
    grouped-query heads sharing each K/V load, split-KV for long decodes; sliding windows and
    logit soft-capping."""

    def __init__(self, options: TritonAttentionOptions) -> None:
        from corellm_plugins.attn_triton import kernels   # imports triton
        self.kernels = kernels
        self.options = options

    def supports(self, layer: AttentionLayerSpec, dtype: torch.dtype,
                 device: torch.device) -> str | None:
        if layer.head_size not in HEAD_SIZES:
            return (f"head_size {layer.head_size} is not supported (supported: "
                    f"{', '.join(map(str, HEAD_SIZES))})")
        if dtype not in DTYPES:
            return (f"dtype {str(dtype).replace('torch.', '')} is not supported (supported: "
                    "float16, bfloat16, float32)")
        problem = device_problem(device)
        if problem:
            return problem
        if (device.type == "cuda" and dtype == torch.bfloat16
                and torch.cuda.get_device_capability(device) < (8, 0)):
            return (f"bfloat16 needs compute capability 8.0 or newer; {device} has "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} (use "
                    "model.dtype: float16)")
        return None

    def kv_cache_spec(self, layer: AttentionLayerSpec, num_blocks: int, block_size: int,
                      dtype: torch.dtype) -> KVCacheSpec:
        # Every load is masked to the request's own keys: no zero-fill needed.
        return KVCacheSpec((2, num_blocks, block_size, layer.num_kv_heads, layer.head_size),
                           dtype, zero_init=False)

    def make_metadata_builder(self, limits: AttentionBuildLimits) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(limits, self.options)

    def block_q(self, layer: AttentionLayerSpec, decode: bool) -> int:
        """Query tokens per tile: for prefills, ``block_m`` rows over the padded query-head
        group; for decodes (one token each), the fewest that give a tensor-core dot its 16
        rows."""
        g_pad = 1 << (layer.num_heads // layer.num_kv_heads - 1).bit_length()
        rows = 16 if decode else self.options.block_m
        return max(1, rows // g_pad)

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, md: TritonMetadata) -> torch.Tensor:
        self.kernels.write_kv(key, value, kv_cache, md.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.attend(layer, query, kv_cache, md, out)
        return out

    def attend(self, layer: AttentionLayerSpec, query: torch.Tensor, kv_cache: torch.Tensor,
               md: TritonMetadata, out: torch.Tensor) -> None:
        """Attention of every query row into ``out`` [T, H, D] (K/V already written)."""
        o = self.options
        common = dict(num_kv_heads=layer.num_kv_heads, scale=layer.scale, block_n=o.block_n,
                      sliding_window=layer.sliding_window, logit_soft_cap=layer.logit_soft_cap,
                      num_warps=o.num_warps, num_stages=o.num_stages)
        nd, nr = md.num_decodes, md.num_reqs
        if nd and md.num_splits > 1:
            self.kernels.paged_attention_split(query, kv_cache, out, md.block_table,
                                               md.seq_lens, md.query_start_loc, nd,
                                               md.num_splits, **common)
        for part, first, last in (("decode", 0, nd), ("prefill", nd, nr)):
            if last == first or (part == "decode" and md.num_splits > 1):
                continue
            block_q = self.block_q(layer, part == "decode")
            tile_req, tile_q, num_tiles = md.tiles(part, first, last, block_q)
            self.kernels.paged_attention(query, kv_cache, out, md.block_table, md.seq_lens,
                                         md.query_start_loc, tile_req, tile_q, num_tiles,
                                         block_q=block_q, **common)
