from __future__ import annotations

import torch

from corellm.interfaces import Sampler
from corellm.layers.ops import DeviceOps
from corellm.sampling import (LogprobsTensors, SamplerOutput, SamplingMetadata, apply_penalties,
                              greedy)


class DefaultSampler(Sampler):
    """``ops``: the platform's (``BuildContext.platform.ops``), whose ``argmax`` picks greedy
    tokens; the reference's when None."""

    def __init__(self, ops: DeviceOps | None = None) -> None:
        self.ops = ops

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()                                    # [N, V]
        logprobs = None
        if md.max_num_logprobs is not None:
            # Log-probabilities of the model's own distribution, before temperature/filters.
            raw = torch.log_softmax(logits, dim=-1)
        # Penalties change what is chosen (greedy included), not the logprobs reported.
        logits = apply_penalties(logits, md)
        if md.banned_token_ids:
            rows = [r for r, ids in md.banned_token_ids.items() for _ in ids]
            cols = [t for ids in md.banned_token_ids.values() for t in ids]
            logits = logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                                      torch.tensor(float("-inf")))

        if md.all_greedy:
            sampled = greedy(logits, self.ops)                     # first max, like argmax
        else:
            sampled = self._sample(logits, md)

        if md.max_num_logprobs is not None:
            k = md.max_num_logprobs
            sampled_lp = raw.gather(1, sampled[:, None])           # [N, 1]
            top_lp, top_ids = raw.topk(k, dim=-1)                  # k may be 0
            ranks = (raw > sampled_lp).sum(dim=-1) + 1
            logprobs = LogprobsTensors(token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
                                       logprobs=torch.cat([sampled_lp, top_lp], dim=1),
                                       sampled_ranks=ranks)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        temperature = md.temperature
        assert temperature is not None
        greedy_rows = temperature == 0
        greedy_ids = None if md.all_random else greedy(logits, self.ops)
        logits = logits / torch.where(greedy_rows, 1.0, temperature)[:, None]

        if md.top_k is not None or md.top_p is not None:
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        if md.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * md.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)

        # Exponential race (Gumbel-max in another guise): argmax(p / E), E ~ Exp(1), samples
        # from p without a normalizing pass or a per-row multinomial call.
        noise = torch.empty_like(probs).exponential_(generator=md.generator)
        for row, gen in md.generators.items():
            noise[row].exponential_(generator=gen)
        sampled = probs.div_(noise).max(dim=-1).indices
        if greedy_ids is not None:
            sampled = torch.where(greedy_rows, greedy_ids, sampled)
        return sampled


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (top-p) to -inf, with one sort."""
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
