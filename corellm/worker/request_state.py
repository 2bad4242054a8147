"""What the model runner keeps of each running request between steps, and the sampler's inputs
built from it.

A request's token ids, block ids and progress live in its row of the runner's persistent batch
(``corellm.worker.input_batch.InputBatch``), updated from each plan's deltas and from the tokens
the worker samples; ``CachedRequestState`` is the request's handle on that row plus what is not
an array (its ``SamplingParams``, its logits processors' states, its seeded generator).

``sampling_metadata`` is the per-request construction of a step's ``SamplingMetadata``, one
Python iteration per row: the reference that the persistent batch's vectorized, reused metadata
(``InputBatch.sampling_metadata``) must equal, kept for tests and for anyone who builds metadata
for a handful of states. ``penalty_pairs`` is the penalty rule both share.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import numpy as np
import torch

from corellm.sampling import SamplingMetadata
from corellm.sampling_params import SamplingParams

# Per-request generators are reseeded each step from the request's seed and its output count, so
# a seeded request samples the same tokens whatever it is batched with and after preemption.
_F32_MAX = torch.finfo(torch.float32).max
_SEED_MIX = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1


def generator_seed(seed: int, num_output_tokens: int) -> int:
    """The seed of a seeded request's generator for its next token (must never change: seeded
    outputs are reproducible across versions)."""
    return (seed * _SEED_MIX + num_output_tokens) & _U64


class CachedRequestState:
    """A running request's handle on its row of the persistent batch (``row``, from
    ``InputBatch.add`` until its finish or preemption; ``serial`` is unique to that stay, so a
    row reused by another request, or by the same request back after preemption, is told
    apart). Built from the plan's lists, which ``InputBatch.add`` copies into the row and
    drops; then token ids, block ids and progress are read from the batch's arrays
    (``token_ids`` and ``block_ids`` build lists, for the rare readers: a logits processor's
    ``new_request``, tests). A state not in a batch keeps its lists (the per-request reference,
    tests)."""

    __slots__ = ("req_id", "num_prompt_tokens", "params", "min_tokens_banned",
                 "prompt_token_set", "processors", "generator", "batch", "row", "serial",
                 "_token_ids", "_block_ids", "_num_computed", "lora_slot")

    def __init__(self, req_id: str, token_ids: list[int], num_prompt_tokens: int,
                 block_ids: list[int], num_computed_tokens: int, params: SamplingParams,
                 eos_token_id: int | None, lora_slot: int = -1) -> None:
        self.req_id = req_id
        self.lora_slot = lora_slot          # its LoRA adapter's device slot (-1: none)
        self.num_prompt_tokens = num_prompt_tokens
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
        # A seeded request's generator, reseeded before each of its samples.
        self.generator: torch.Generator | None = None
        # The InputBatch holding the row, set by its add (not imported: it imports this).
        self.batch: Any = None
        self.row = -1
        self.serial = -1
        self._token_ids: list[int] | None = token_ids
        self._block_ids: list[int] | None = block_ids
        self._num_computed = num_computed_tokens

    @property
    def num_tokens(self) -> int:
        if self.batch is None:
            return len(self._token_ids)
        return int(self.batch.num_tokens[self.row])

    @property
    def num_computed_tokens(self) -> int:
        if self.batch is None:
            return self._num_computed
        return int(self.batch.num_computed[self.row])

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output so far (in a batch: a new list)."""
        if self.batch is None:
            return self._token_ids
        return self.batch.token_ids[self.row, :self.num_tokens].tolist()

    @property
    def block_ids(self) -> list[int]:
        """The request's KV blocks (in a batch: a new list)."""
        if self.batch is None:
            return self._block_ids
        return self.batch.block_table[self.row, :int(self.batch.num_blocks[self.row])].tolist()

    def prompt_set(self) -> np.ndarray:
        """The distinct prompt token ids, sorted int64 (computed once)."""
        if self.prompt_token_set is None:
            if self.batch is None:
                prompt = np.asarray(self._token_ids[:self.num_prompt_tokens], dtype=np.int64)
            else:
                prompt = self.batch.token_ids[self.row, :self.num_prompt_tokens]
            self.prompt_token_set = np.unique(prompt.astype(np.int64))
        return self.prompt_token_set


def penalty_pairs(rows: np.ndarray, lens: np.ndarray, out_tokens: np.ndarray,
                  rep_rows: np.ndarray, prompt_sets: list[np.ndarray], vocab: int,
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (row, token) pairs the penalties touch, as keys ``row * vocab + token``
    (sorted), and each one's count in the output: ``rows`` [k] the penalized rows, ``lens`` [k]
    their output lengths, ``out_tokens`` their output tokens concatenated; ``rep_rows`` the
    rows with a repetition penalty and ``prompt_sets`` their distinct prompt tokens."""
    keys = [np.repeat(rows.astype(np.int64) * vocab, lens) + out_tokens]
    if len(rep_rows):
        plens = np.fromiter((len(t) for t in prompt_sets), dtype=np.int64,
                            count=len(prompt_sets))
        keys.append(np.repeat(rep_rows.astype(np.int64) * vocab, plens)
                    + np.concatenate(prompt_sets))
    pairs, inverse = np.unique(np.concatenate(keys), return_inverse=True)
    counts = np.bincount(inverse[:len(out_tokens)], minlength=len(pairs)).astype(np.int32)
    return pairs, counts


def sampling_metadata(states: list[CachedRequestState], vocab: int, device: torch.device,
                      generator: torch.Generator | None) -> SamplingMetadata:
    """The sampler's inputs for ``states``' rows, one row each, in order, built per request
    (the reference of ``InputBatch.sampling_metadata``; fresh generators)."""
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
                gen.manual_seed(generator_seed(p.seed, state.num_output_tokens))
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
    """Fill md's penalty fields; ``rows`` are the rows with a penalty (others stay neutral),
    per request (the reference of the persistent batch's vectorized gather)."""
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

    sel = [states[i] for i in rows]
    lens = np.fromiter((s.num_output_tokens for s in sel), dtype=np.int64, count=len(sel))
    out_tokens = np.fromiter(chain.from_iterable(s.token_ids[s.num_prompt_tokens:]
                                                 for s in sel),
                             dtype=np.int64, count=int(lens.sum()))
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    sets: list[Any] = [states[i].prompt_set() for i in rep_rows]
    pairs, counts = penalty_pairs(np.asarray(rows, dtype=np.int64), lens, out_tokens,
                                  np.asarray(rep_rows, dtype=np.int64), sets, vocab)
    md.penalty_rows = torch.from_numpy(pairs // vocab).to(dev)
    md.penalty_token_ids = torch.from_numpy(pairs % vocab).to(dev)
    md.penalty_output_counts = torch.from_numpy(counts).to(dev)
