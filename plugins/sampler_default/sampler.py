from __future__ import annotations

import torch

from corellm.interfaces import Sampler
from corellm.ops import DeviceOps
from corellm.sampling import (SamplerOutput, SamplingMetadata, apply_banned_tokens, apply_min_p,
                              apply_penalties, apply_top_k_top_p, gather_logprobs, greedy,
                              random_sample)


class DefaultSampler(Sampler):
    """``ops``: the platform's (``BuildContext.platform.ops``), whose ``argmax`` picks greedy
    tokens; the reference's when None."""

    def __init__(self, ops: DeviceOps | None = None) -> None:
        self.ops = ops

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()                                    # [N, V]
        k = md.max_num_logprobs
        # Log-probabilities of the model's own distribution, before temperature/filters.
        raw = torch.log_softmax(logits, dim=-1) if k is not None else None
        # Penalties and bans change what is chosen (greedy included), not the logprobs reported.
        logits = apply_banned_tokens(apply_penalties(logits, md), md)

        if md.all_greedy:
            sampled = greedy(logits, self.ops)                     # first max, like argmax
        else:
            sampled = self._sample(logits, md)

        logprobs = gather_logprobs(raw, sampled, k) if raw is not None and k is not None else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        temperature = md.temperature
        assert temperature is not None
        greedy_rows = temperature == 0
        greedy_ids = None if md.all_random else greedy(logits, self.ops)
        logits = logits / torch.where(greedy_rows, 1.0, temperature)[:, None]
        # Valid parameters can overflow float32 (a repetition penalty of 1e-300 divides a
        # positive logit by 0): +inf would make the softmax NaN, and a NaN row draws token 0
        # whatever is banned. The largest float keeps the token the likeliest.
        logits = logits.clamp(max=torch.finfo(logits.dtype).max)

        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = apply_min_p(logits.softmax(dim=-1), md.min_p)
        sampled = random_sample(probs, md)
        if greedy_ids is not None:
            sampled = torch.where(greedy_rows, greedy_ids, sampled)
        return sampled
