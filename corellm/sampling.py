"""Typed inputs and outputs of a sampler plugin (built by the model runner once per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corellm.layers.ops import REFERENCE_OPS, DeviceOps


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters as tensors; a filter nobody uses this step is None.

    Rows are the requests that sample this step, in the order of the logits rows.
    """

    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None          # [N] float32; 0 rows are greedy
    top_k: torch.Tensor | None                # [N] int64; vocab size where disabled
    top_p: torch.Tensor | None                # [N] float32; 1.0 where disabled
    min_p: torch.Tensor | None                # [N] float32; 0.0 where disabled
    # row -> generator for rows with a per-request seed. Each is seeded from (seed, number of
    # tokens generated so far), so a seeded request reproduces regardless of batch composition
    # or preemption.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None       # None: no row asked for logprobs
    # The random stream of rows without a seed (seeded once from model.seed).
    generator: torch.Generator | None = None
    # row -> token ids that must not be sampled yet (stop tokens before min_tokens is reached).
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Penalties (see apply_penalties). Each penalty tensor is None when no row uses that penalty
    # this step, else holds every row, with the neutral value in rows that do not use it.
    presence_penalties: torch.Tensor | None = None     # [N] float32; 0.0 where disabled
    frequency_penalties: torch.Tensor | None = None    # [N] float32; 0.0 where disabled
    repetition_penalties: torch.Tensor | None = None   # [N] float32; 1.0 where disabled
    # The logits the penalties touch, as a sparse [N, V] matrix of M distinct (row, token) pairs:
    # every token in the output so far of a row with any penalty, and every token in the prompt
    # of a row with a repetition penalty. None when no row has a penalty this step.
    penalty_rows: torch.Tensor | None = None           # [M] int64: logits row
    penalty_token_ids: torch.Tensor | None = None      # [M] int64: token id (logits column)
    penalty_output_counts: torch.Tensor | None = None  # [M] int32: occurrences of the token in
    #                                                    the row's output so far (0: prompt only)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``logits`` [N, V] with the presence, frequency and repetition penalties of ``md`` applied.

    vLLM's semantics, in this order: the repetition penalty ``p`` (CTRL / Hugging Face rule)
    turns the logit ``x`` of every token in the prompt or the output into ``x / p`` if ``x > 0``
    else ``x * p``; then ``frequency_penalty * count`` and ``presence_penalty * (count > 0)`` are
    subtracted, ``count`` being the token's occurrences in the output. Only the M logits listed
    in ``md.penalty_*`` are computed (O(M) plus one copy of ``logits``, not several passes over
    [N, V]). Returns a new tensor, or ``logits`` itself when nothing is penalized; ``logits`` is
    never modified. A sampler calls it before temperature, filters and the greedy argmax.
    """
    rows, tokens, counts = md.penalty_rows, md.penalty_token_ids, md.penalty_output_counts
    if rows is None or tokens is None or counts is None or rows.numel() == 0:
        return logits
    index = rows * logits.shape[-1] + tokens                      # [M] into the flat logits
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    x = flat.index_select(0, index)                               # [M]
    if md.repetition_penalties is not None:
        p = md.repetition_penalties.to(x.dtype)[rows]
        x = torch.where(x > 0, x / p, x * p)
    if md.frequency_penalties is not None:
        x = x - md.frequency_penalties.to(x.dtype)[rows] * counts
    if md.presence_penalties is not None:
        x = x - md.presence_penalties.to(x.dtype)[rows] * (counts > 0)
    return flat.index_copy_(0, index, x).view_as(logits)


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor       # [N, 1 + k] int64: the sampled token, then the top-k
    logprobs: torch.Tensor        # [N, 1 + k] float32
    sampled_ranks: torch.Tensor   # [N] int64, 1-based


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor           # [N] int64
    logprobs: LogprobsTensors | None = None


def greedy(logits: torch.Tensor, ops: DeviceOps | None = None) -> torch.Tensor:
    """Each row's greedy token: the index of its first maximum (NaN counting as the maximum),
    as ``logits.max(dim=-1).indices``, by the platform's ``ops.argmax`` (the CPU platform: one
    native pass over the rows in parallel; the reference: torch's reduction). A sampler gets
    the ops from ``BuildContext.platform``."""
    return (ops or REFERENCE_OPS).argmax(logits)
