"""Typed inputs and outputs of a sampler plugin (built by the model runner once per step), and
the pieces a sampler is made of.

The default sampler is these pieces in order: ``apply_penalties``, ``apply_banned_tokens``, then
``greedy`` for greedy rows, or temperature, ``apply_top_k_top_p``, softmax, ``apply_min_p`` and
``random_sample`` for the others, and ``gather_logprobs``. A sampler that changes one step
composes the others. ``find_banned`` is the check the model runner makes on every sampler's
output. docs/plugins.md, "A sampler", has the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from corellm.ops import REFERENCE_OPS, DeviceOps


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
    # Every sampler must apply them (apply_banned_tokens); the model runner checks its output
    # (find_banned) and fails the step when a banned token was sampled.
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


def apply_banned_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """``logits`` [N, V] with every token of ``md.banned_token_ids[row]`` set to -inf in its
    row, so that neither the greedy argmax nor a random draw can pick it. Returns a new tensor,
    or ``logits`` itself when nothing is banned; ``logits`` is never modified. A sampler calls
    it after ``apply_penalties`` and before choosing: a banned token stays banned whatever the
    temperature and filters."""
    banned = md.banned_token_ids
    if not banned:
        return logits
    rows = [r for r, ids in banned.items() for _ in ids]
    cols = [t for ids in banned.values() for t in ids]
    if not rows:                         # rows listed with no token: nothing to mask
        return logits
    dev = logits.device
    return logits.index_put((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                            torch.tensor(float("-inf"), device=dev))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [N, V] with everything outside each row's top-k and nucleus set to -inf, with
    one sort of the rows. ``top_k`` [N] int64 keeps each row's ``top_k`` largest logits (V where
    disabled); ``top_p`` [N] float keeps the smallest set of largest logits whose probability
    reaches ``top_p`` (1.0 where disabled), and always the largest. Both apply when both are
    given: top-p on what top-k keeps. Ties at the top-k cut-off are all kept. Pass the
    temperature-scaled logits: the nucleus depends on the temperature. Returns a new tensor."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)     # ascending
    vocab = logits.shape[-1]
    if top_k is not None:
        # keep the last k of the ascending order
        cutoff = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False                                          # always keep the best token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """``probs`` [N, V] (a distribution per row, after temperature and the other filters) with
    every probability below ``min_p[row]`` times the row's largest set to 0. ``min_p`` [N]
    float, 0.0 where disabled; None returns ``probs`` itself. The result is not renormalized
    (``random_sample`` does not need it). Returns a new tensor; ``probs`` is never modified."""
    if min_p is None:
        return probs
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def random_sample(probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One token per row [N] int64, drawn from ``probs`` [N, V] (non-negative, rows need not
    sum to 1). Rows with a generator in ``md.generators`` draw from it, the others from
    ``md.generator`` (torch's default generator when None), so a seeded request gets the same
    token whatever else is in the batch. ``probs`` is never modified.

    The draw is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per token picks token
    ``i`` with probability ``p_i / sum(p)`` (Gumbel-max in another form), without normalizing or
    a per-row multinomial call. A token of probability 0 is never picked unless the whole row
    is 0."""
    noise = torch.empty_like(probs).exponential_(generator=md.generator)
    for row, gen in md.generators.items():
        noise[row].exponential_(generator=gen)
    # An exponential draw can be exactly 0, and 0 / 0 is NaN, which max() would pick: a token
    # of probability 0 (banned, filtered) must never win, so no noise is below the smallest
    # normal number. Draws are otherwise unchanged.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    # In place in the noise buffer: one [N, V] allocation for the whole draw.
    return torch.div(probs, noise, out=noise).max(dim=-1).indices


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_logprobs: int) -> LogprobsTensors:
    """The ``LogprobsTensors`` of the sampled tokens, from ``logprobs`` [N, V] float32 (the
    ``log_softmax`` of the distribution to report; the default sampler reports the model's,
    before penalties, bans, temperature and filters), ``sampled`` [N] int64 and
    ``num_logprobs``, ``SamplingMetadata.max_num_logprobs``: for each row, the sampled token and
    its log-probability, then the ``num_logprobs`` most likely tokens (0 is allowed), and the
    sampled token's 1-based rank (1 + the number of tokens strictly more likely)."""
    sampled_lp = logprobs.gather(1, sampled[:, None])                 # [N, 1]
    top_lp, top_ids = logprobs.topk(num_logprobs, dim=-1)             # [N, k]
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    return LogprobsTensors(token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
                           logprobs=torch.cat([sampled_lp, top_lp], dim=1),
                           sampled_ranks=ranks)


def find_banned(sampled: torch.Tensor | Sequence[int],
                md: SamplingMetadata) -> tuple[int, int] | None:
    """The first (row, token), in row order, where ``sampled[row]`` is one of
    ``md.banned_token_ids[row]``, or None when no row sampled a banned token.

    The model runner calls it on every sampler's output and fails the step when it finds one
    (the sampler did not apply the bans; see ``apply_banned_tokens``). ``sampled`` is the
    sampler's [N] tensor or the same ids as a host sequence. Nothing is banned in most steps:
    then it returns at once, with no tensor work. Otherwise a tensor costs one transfer of the
    banned rows' ids to the host; a sequence costs none."""
    banned = md.banned_token_ids
    if not banned:
        return None
    rows = sorted(r for r, ids in banned.items() if ids)
    if not rows:
        return None
    if isinstance(sampled, torch.Tensor):
        index = torch.tensor(rows, dtype=torch.int64, device=sampled.device)
        picked = sampled.index_select(0, index).tolist()
    else:
        picked = [sampled[r] for r in rows]
    for row, token in zip(rows, picked):
        if token in banned[row]:
            return row, int(token)
    return None


__all__ = ["LogprobsTensors", "SamplerOutput", "SamplingMetadata", "apply_banned_tokens",
           "apply_min_p", "apply_penalties", "apply_top_k_top_p", "find_banned",
           "gather_logprobs", "greedy", "random_sample"]
