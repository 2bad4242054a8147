"""The host-side logic of CUDA graphs for decode steps, tested on any machine: which batch sizes
are captured, which captured graph a step replays, what the padding rows of a replayed batch
are, and when graphs are not used at all.

A captured graph replays the kernels it recorded, with the arguments they had: the addresses of
the inputs, the attention metadata's buffers and the KV cache, the grid sizes, the strides. A
step can replay the graph of batch size ``B`` when it is decode-only (one token per request)
with ``n <= B`` requests, its inputs are written at the addresses the capture read, and the
``B - n`` rows past its last are padding: token 0 at position 0 in the model's inputs (the
stepper writes them), and in the attention metadata rows that store no K/V (slot -1) and attend
to no key (sequence length 0), which an attention metadata builder declaring ``cuda_graphs``
writes for every decode-only step up to ``max_num_seqs``. What the padded rows compute is
discarded: only the step's ``logits_indices`` rows are read out of the graph's output.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from corellm.attention import AttentionBuildLimits, CommonAttentionMetadata
from corellm.platforms import StepInputs, steps_refused

logger = logging.getLogger(__name__)

DEFAULT_SMALL_SIZES = (1, 2, 4)
DEFAULT_STRIDE = 8


def capture_sizes(requested: Sequence[int] | None, max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[int]:
    """The decode batch sizes to capture, increasing. ``requested`` (the option, already
    validated as increasing and positive) or by default 1, 2, 4, 8, then multiples of 8; in
    both cases only sizes a decode step can have (at most ``max_num_seqs`` requests and
    ``max_num_batched_tokens`` tokens), and by default that largest size itself, so that every
    decode batch has a graph."""
    limit = max(1, min(max_num_seqs, max_num_batched_tokens))
    if requested is not None:
        return [s for s in requested if s <= limit]
    sizes = [s for s in DEFAULT_SMALL_SIZES if s <= limit]
    sizes += list(range(DEFAULT_STRIDE, limit + 1, DEFAULT_STRIDE))
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def padded_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (increasing) that holds ``num_rows`` rows, or None."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def padding_metadata(num_rows: int, block_size: int) -> CommonAttentionMetadata:
    """The common attention facts of a decode batch made only of padding rows: one query token
    each, stored nowhere (slot -1), attending to no key (sequence length 0). The batch a graph
    is captured with: its kernels write and read nothing of the KV cache."""
    n = num_rows
    return CommonAttentionMetadata(
        num_reqs=n, num_decodes=n, num_actual_tokens=n,
        query_start_loc=np.arange(n + 1, dtype=np.int64),
        seq_lens=np.zeros(n, dtype=np.int64), context_lens=np.zeros(n, dtype=np.int64),
        block_table=np.zeros((n, 1), dtype=np.int64),
        slot_mapping=np.full(n, -1, dtype=np.int64),
        max_seq_len=0, max_query_len=1, block_size=block_size)


def graphs_refused(enabled: bool, builder: Any, tp_size: int) -> str | None:
    """Why no graph is captured (None: they are): the option, an attention metadata builder
    that does not declare ``cuda_graphs`` (its metadata is not at fixed addresses, or has no
    padding rows), tensor parallelism (collectives inside graphs are not verified here)."""
    return steps_refused("platform.cuda_graphs", enabled, builder, "cuda_graphs", tp_size)


class DecodeGraphs:
    """Which captured graph, if any, a step replays: a decode-only step within the scheduler's
    limits, padded to the smallest captured size that holds it. A step beyond the limits has
    made the persistent buffers grow, which moves them from the addresses the graphs read:
    from then on every step runs eagerly."""

    def __init__(self, limits: AttentionBuildLimits) -> None:
        self.limits = limits
        self.sizes: list[int] = []
        self.off: str | None = None

    def enable(self, sizes: Sequence[int]) -> None:
        self.sizes = sorted(sizes)
        self.off = None

    def size_for(self, inputs: StepInputs) -> int | None:
        """The captured batch size ``inputs`` replays, or None (eager)."""
        if not self.sizes:
            return None
        lim = self.limits
        if inputs.num_tokens > lim.max_num_batched_tokens or inputs.num_reqs > lim.max_num_seqs:
            self.sizes = []
            self.off = (f"a step of {inputs.num_reqs} requests and {inputs.num_tokens} tokens "
                        f"exceeded the scheduler's limits ({lim.max_num_seqs}, "
                        f"{lim.max_num_batched_tokens}), moving the buffers the graphs read")
            logger.warning("CUDA graphs: no longer replayed: %s", self.off)
            return None
        if not inputs.decode_only:
            return None
        return padded_size(inputs.num_tokens, self.sizes)
