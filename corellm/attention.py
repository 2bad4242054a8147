"""The attention interface's data: what the model runner knows about a step, what a backend's
metadata builder makes of it, and what a backend declares about its KV cache.

Each step the model runner computes the **common facts** of the batch on the host, as numpy
arrays (``CommonAttentionMetadata``): per request its query tokens, context and sequence lengths
and block-table row, per token its cache slot. It orders the batch as the backend's metadata
builder asks (``AttentionMetadataBuilder.batch_order``) and hands the facts to the builder, which
turns them into whatever its kernels read (device tensors in persistent buffers, int32 or int64,
precomputed grids, host lists) once per step; the model passes the result to every attention
layer as a forward argument.

The core's ``CommonMetadataBuilder`` is the default: it puts the common facts on the device as
``AttentionMetadata`` (int64 tensors plus host lists), which suits a backend written in torch
ops. ``DeviceArray`` is the reusable piece for a builder of its own: a persistent device buffer
fed from a pinned host buffer (CUDA) or by a zero-copy view (CPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import numpy as np
import torch

from corellm.platforms.devices import host_visible


class BatchOrder(str, Enum):
    """The order of a step's requests a backend's metadata builder asks for.

    ``DECODES_FIRST``: requests with one query token first (shortest context first), then the
    others (fewest computed tokens first), so the decodes are rows ``[0, num_decodes)`` and
    requests of similar length sit together. ``SCHEDULED``: the scheduler's order, unsorted
    (``num_decodes`` still counts the leading one-token rows).
    """

    DECODES_FIRST = "decodes_first"
    SCHEDULED = "scheduled"


@dataclass
class CommonAttentionMetadata:
    """The facts of one step every backend needs, on the host (numpy), in the builder's order.

    A "decode" is any request with exactly one query token this step: usually a generated
    token, but also a one-token prompt or chunk, or the last prompt token after a prefix-cache
    hit, with any context length. ``block_table`` rows are padded with 0, which is a real block
    id: a backend reads only the first ``ceil(seq_len / block_size)`` entries of row ``i``.
    """

    num_reqs: int
    num_decodes: int                 # the first num_decodes requests have one query token each
    num_actual_tokens: int
    query_start_loc: np.ndarray      # [num_reqs + 1] int64, offsets into the token dimension
    seq_lens: np.ndarray             # [num_reqs] int64, context + new tokens
    context_lens: np.ndarray         # [num_reqs] int64, tokens already in the cache
    block_table: np.ndarray          # [num_reqs, max_blocks] int64, padded with 0
    slot_mapping: np.ndarray         # [num_actual_tokens] int64, where each new K/V is written
    max_seq_len: int
    max_query_len: int
    block_size: int

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


@dataclass(frozen=True)
class AttentionBuildLimits:
    """What a metadata builder may size its persistent buffers by (a step can exceed the
    batch limits only through a scheduler that ignores them: grow, do not fail)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    device: torch.device

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


class AttentionMetadataBuilder(ABC):
    """Turns each step's ``CommonAttentionMetadata`` into the backend's own metadata.

    One builder per worker, made by ``AttentionBackend.make_metadata_builder`` once the limits
    are known; it may keep state across steps (persistent buffers).

    ``cuda_graphs``: True promises what a CUDA graph captured for a decode batch of ``B`` rows
    needs to replay any decode-only step of ``n <= B`` rows within the limits: the metadata
    lives in buffers whose addresses and strides never change, and the rows of a decode-only
    step past its last, up to ``max_num_seqs``, are padding rows (stored nowhere, attending to
    no key). A padding row comes in as one query token with slot -1 and sequence length 0;
    the CUDA platform captures its graphs with metadata built from such rows only, and
    captures none for a builder that says False.
    """

    batch_order: ClassVar[BatchOrder] = BatchOrder.DECODES_FIRST
    cuda_graphs: ClassVar[bool] = False
    #: Plugin API 1.10: True promises what a platform that records a decode-only step and
    #: replays its calls (the CPU platform's ``cpu_graphs``) needs: for decode-only steps of the
    #: same number of rows within the limits, the metadata is at the same addresses with the
    #: same strides (``DeviceArray(fixed=True)``), and the backend's ``forward`` makes the same
    #: calls with the same arguments. May be set per instance (a backend with several paths).
    replayable: bool = False

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """The metadata every attention layer of this step receives (its ``slot_mapping``
        attribute, if any, is the backend's business)."""


class DeviceArray:
    """A persistent buffer on ``device`` that each step's numpy array (1-D or 2-D) is copied
    into, returned as a contiguous view of the buffer's start.

    On a device outside the host's memory (a GPU) the values go through a pinned host buffer
    with a non-blocking copy; before the host buffer is written again, the previous copy out of
    it is waited for (an event of the device's stream), so a step prepared while the last one
    still runs never races its copy. On the host (``corellm.platforms.host_visible``) ``put``
    returns a zero-copy view of the array itself (converted when its dtype differs). The buffer
    grows (doubling) when a step exceeds it, which moves it: ``cuda_graphs`` address stability
    holds only for steps within the limits. Give each array its own ``DeviceArray``: a second
    ``put`` overwrites the view the first returned.

    ``fixed`` (on the host): the values are copied into a persistent buffer of ``shape`` and
    returned as its leading corner (a 2-D array keeps the buffer's row stride), so that values
    within ``shape`` always land at the same addresses with the same strides, which a
    ``replayable`` builder promises; values beyond ``shape`` come back as a view of their own.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 fixed: bool = False) -> None:
        self.dtype, self.device = dtype, device
        self._np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        self._event: Any = None
        self.capacity = 0
        self.on_host = host_visible(device)
        self.fixed: torch.Tensor | None = None
        if not self.on_host:
            self._alloc(int(np.prod(shape)))
        elif fixed:
            self.fixed = torch.zeros(shape, dtype=dtype)
            self._fixed_np = self.fixed.numpy()

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.zeros(capacity, dtype=self.dtype, pin_memory=True)
        self.host_np = self.host.numpy()
        self.gpu = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        self._event = None

    def put(self, values: np.ndarray) -> torch.Tensor:
        """The values on the device: a contiguous view of the buffer's first ``values.size``
        elements, in ``values``' shape."""
        if self.on_host:
            fixed = self.fixed
            if (fixed is not None and values.ndim == fixed.dim()
                    and all(v <= f for v, f in zip(values.shape, fixed.shape))):
                corner = tuple(slice(0, v) for v in values.shape)
                self._fixed_np[corner] = values
                return fixed[corner]
            if values.dtype != self._np_dtype:
                values = values.astype(self._np_dtype)
            return torch.from_numpy(np.ascontiguousarray(values))
        n = values.size
        if n > self.capacity:
            self._alloc(max(n, 2 * self.capacity))
        if self._event is not None:
            self._event.synchronize()           # the last copy out of the host buffer is done
        self.host_np[:n] = values.reshape(-1)
        out = self.gpu[:n]
        out.copy_(self.host[:n], non_blocking=True)
        self._event = torch.Event(device=self.device)
        self._event.record()
        return out.view(values.shape)


@dataclass
class AttentionMetadata:
    """The default builder's metadata: the common facts as device tensors, plus host lists for
    backends that loop over the (few) prefills of a step."""

    num_reqs: int
    num_decodes: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor    # [num_reqs + 1] int64
    seq_lens: torch.Tensor           # [num_reqs] int64
    context_lens: torch.Tensor       # [num_reqs] int64
    block_table: torch.Tensor        # [num_reqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor       # [num_actual_tokens] int64
    max_seq_len: int
    max_query_len: int
    block_size: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    context_lens_list: list[int]

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes


class CommonMetadataBuilder(AttentionMetadataBuilder):
    """The default: ``AttentionMetadata`` in persistent int64 device buffers."""

    def __init__(self, limits: AttentionBuildLimits) -> None:
        dev, n, t = limits.device, limits.max_num_seqs, limits.max_num_batched_tokens
        self._qsl = DeviceArray((n + 1,), torch.int64, dev)
        self._seq = DeviceArray((n,), torch.int64, dev)
        self._ctx = DeviceArray((n,), torch.int64, dev)
        self._table = DeviceArray((n, limits.max_blocks_per_seq), torch.int64, dev)
        self._slots = DeviceArray((t,), torch.int64, dev)

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        c = common
        return AttentionMetadata(
            num_reqs=c.num_reqs, num_decodes=c.num_decodes, num_actual_tokens=c.num_actual_tokens,
            query_start_loc=self._qsl.put(c.query_start_loc), seq_lens=self._seq.put(c.seq_lens),
            context_lens=self._ctx.put(c.context_lens), block_table=self._table.put(c.block_table),
            slot_mapping=self._slots.put(c.slot_mapping), max_seq_len=c.max_seq_len,
            max_query_len=c.max_query_len, block_size=c.block_size,
            query_start_loc_list=c.query_start_loc.tolist(), seq_lens_list=c.seq_lens.tolist(),
            context_lens_list=c.context_lens.tolist())


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV-cache tensor as a backend wants it allocated.

    ``shape``: the whole tensor for the number of blocks asked (K and V together, in the
    backend's layout; its size proportional to the number of blocks). ``dtype``: may differ from
    the model's (an fp8 cache, say: the backend converts on write and read). ``zero_init``:
    whether the backend reads slots it never wrote (padded gathers multiply them by zero, and
    0 * NaN would poison the output); a backend whose kernels mask every load says False and
    the runner skips the fill.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    zero_init: bool = True

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()
