"""Attention metadata the model runner builds once per step and passes down as an argument.

The batch is ordered decodes first (one query token each, by ascending sequence length), then
prefills (whole prompts, chunks of prompts, or recomputation after preemption; by ascending
computed tokens), so backends can treat the two parts separately and batch decodes of similar
length together. A "decode" is any request with exactly one query token this step: usually a
generated token, but also a one-token prompt, a one-token chunk, or the last prompt token after a
prefix-cache hit, with any context length.

``block_table`` rows are padded with 0, which is a real block id: a backend reads only the first
``ceil(seq_len / block_size)`` entries of row ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int                 # the first num_decodes requests have exactly one query token
    num_actual_tokens: int
    query_start_loc: torch.Tensor    # [num_reqs + 1] int64, offsets into the token dimension
    seq_lens: torch.Tensor           # [num_reqs] int64, context + new tokens
    context_lens: torch.Tensor       # [num_reqs] int64, tokens already in the cache
    block_table: torch.Tensor        # [num_reqs, max_blocks] int64, padded with 0
    slot_mapping: torch.Tensor       # [num_actual_tokens] int64, where each new K/V is written
    max_seq_len: int
    max_query_len: int
    block_size: int
    # Host-side copies, for backends that loop over the (few) prefills of a step.
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    context_lens_list: list[int]

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes
