"""Typed inputs and outputs of a sampler plugin (built by the model runner once per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor       # [N, 1 + k] int64: the sampled token, then the top-k
    logprobs: torch.Tensor        # [N, 1 + k] float32
    sampled_ranks: torch.Tensor   # [N] int64, 1-based


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor           # [N] int64
    logprobs: LogprobsTensors | None = None
