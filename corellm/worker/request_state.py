"""What the model runner keeps of each running request between steps, and the sampler's inputs
built from it each step.

A request's token ids, block ids and progress persist across steps (updated from each plan's
deltas); the sampling metadata is rebuilt per step from the rows that sample, with one Python
iteration per request and the penalty pairs in vectorized numpy.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from corellm.sampling import SamplingMetadata
from corellm.sampling_params import SamplingParams

# Per-request generators are reseeded each step from the request's seed and its output count, so
# a seeded request samples the same tokens whatever it is batched with and after preemption.
_F32_MAX = torch.finfo(torch.float32).max
_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


class CachedRequestState:
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens",
                 "params", "min_tokens_banned", "prompt_token_set", "processors")

    def __init__(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                 block_ids: list[int], num_computed_tokens: int, params: SamplingParams,
                 eos_token_id: int | None) -> None:
        self.req_id = req_id
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.params = params
        # Tokens that would stop the request, banned while fewer than min_tokens are generated.
        banned = list(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            banned.append(eos_token_id)
        self.min_tokens_banned = banned if params.min_tokens > 0 else []
        # The distinct prompt token ids (sorted int64), built on first use by a request with a
        # repetition penalty; the prompt never changes while the state lives.
        self.prompt_token_set: np.ndarray | None = None
        # (index of an enabled logits processor, its state of this request), for each processor
        # that constrains it.
        self.processors: list[tuple[int, object]] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def sampling_metadata(states: list[CachedRequestState], vocab: int, device: torch.device,
                      generator: torch.Generator | None) -> SamplingMetadata:
    """The sampler's inputs for ``states``' rows, one row each, in order."""
    params = [s.params for s in states]
    n = len(params)
    greedy = [p.greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    temperature = top_k = top_p = min_p = None
    generators: dict[int, torch.Generator] = {}
    if not all_greedy:
        # A temperature past float32's range (any finite double is a valid request) would be
        # inf on the device, and a banned or filtered token's -inf / inf is NaN: a NaN row
        # samples token 0 whatever it is. The largest float32 flattens the row all the same.
        temperature = torch.tensor([0.0 if g else min(p.temperature, _F32_MAX)
                                    for g, p in zip(greedy, params)],
                                   dtype=torch.float32, device=device)
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                                 dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32,
                                 device=device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32,
                                 device=device)
        for i, (state, p, g) in enumerate(zip(states, params, greedy)):
            if p.seed is not None and not g:
                gen = torch.Generator(device=device)
                gen.manual_seed((p.seed * _SEED_MIX + state.num_output_tokens) & _U64)
                generators[i] = gen
    banned = {i: s.min_tokens_banned for i, s in enumerate(states)
              if s.min_tokens_banned and s.num_output_tokens < s.params.min_tokens}
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    md = SamplingMetadata(num_rows=n, all_greedy=all_greedy, all_random=all_random,
                          temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          generators=generators, generator=generator,
                          banned_token_ids=banned,
                          max_num_logprobs=max(wanted) if wanted else None)
    penalized = [i for i, p in enumerate(params) if p.has_penalties]
    if penalized:
        add_penalties(md, states, penalized, vocab, device)
    return md


def add_penalties(md: SamplingMetadata, states: list[CachedRequestState], rows: list[int],
                  vocab: int, device: torch.device) -> None:
    """Fill md's penalty fields; ``rows`` are the rows with a penalty (others stay neutral).

    The (row, token) pairs and output counts are rebuilt every step with vectorized numpy,
    O(output tokens + distinct prompt tokens) of the penalized rows; each request's distinct
    prompt tokens are computed once and kept in its state.
    """
    dev = device
    params = [s.params for s in states]

    def column(name: str, neutral: float) -> torch.Tensor | None:
        values = [getattr(p, name) for p in params]
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=torch.float32, device=dev)

    md.presence_penalties = column("presence_penalty", 0.0)
    md.frequency_penalties = column("frequency_penalty", 0.0)
    md.repetition_penalties = column("repetition_penalty", 1.0)

    # Keys row * V + token, so one np.unique both deduplicates and orders the pairs.
    sel = [states[i] for i in rows]
    lens = np.fromiter((s.num_output_tokens for s in sel), dtype=np.int64, count=len(sel))
    out_tokens = np.fromiter(chain.from_iterable(s.token_ids[s.num_prompt_tokens:]
                                                 for s in sel),
                             dtype=np.int64, count=int(lens.sum()))
    keys = [np.repeat(np.asarray(rows, dtype=np.int64) * vocab, lens) + out_tokens]
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        sets = []
        for i in rep_rows:
            s = states[i]
            if s.prompt_token_set is None:
                s.prompt_token_set = np.unique(np.asarray(s.token_ids[:s.num_prompt_tokens],
                                                          dtype=np.int64))
            sets.append(s.prompt_token_set)
        plens = np.fromiter((len(t) for t in sets), dtype=np.int64, count=len(sets))
        keys.append(np.repeat(np.asarray(rep_rows, dtype=np.int64) * vocab, plens)
                    + np.concatenate(sets))
    pairs, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    counts = np.bincount(inverse[:len(out_tokens)], minlength=len(pairs)).astype(np.int32)
    md.penalty_rows = torch.from_numpy(pairs // vocab).to(dev)
    md.penalty_token_ids = torch.from_numpy(pairs % vocab).to(dev)
    md.penalty_output_counts = torch.from_numpy(counts).to(dev)
