"""Input processing: validate and tokenize a prompt into an EngineCoreRequest, and turn
EngineCoreOutputs back into RequestOutputs (detokenized text, logprobs)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Union

from corellm.errors import InvalidRequestError
from corellm.interfaces import ModelInfo
from corellm.outputs import (CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics,
                             RequestOutput)
from corellm.request import EngineCoreRequest
from corellm.sampling_params import SamplingParams

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = Union[str, Mapping[str, Any]]


class Processor:
    def __init__(self, tokenizer: Any, model_info: ModelInfo, extra_eos_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.extra_eos_ids = [e for e in extra_eos_ids if e != self.eos_token_id]

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, Mapping):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise InvalidRequestError(f"prompt.{sorted(unknown)[0]}", "unknown key (expected "
                                          "'prompt' or 'prompt_token_ids')")
            text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if (text is None) == (ids is None):
                raise InvalidRequestError("prompt", "give exactly one of 'prompt' and "
                                          "'prompt_token_ids'")
        else:
            raise InvalidRequestError("prompt", f"expected a string or a dict, got "
                                      f"{type(prompt).__name__}")
        if ids is None:
            if not isinstance(text, str):
                raise InvalidRequestError("prompt", f"expected a string, got {type(text).__name__}")
            if text == "":
                raise InvalidRequestError("prompt", "is empty")
            ids = self.tokenizer.encode(text)
        else:
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
            ids = list(ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids" if text is None else "prompt",
                                      "is empty")
        vocab = self.model_info.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt_token_ids[{i}]",
                                          f"token id {t} is outside the vocabulary [0, {vocab})")
        max_len = self.model_info.max_model_len
        if len(ids) > max_len:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens exceeds model.max_model_len="
                                      f"{max_len}")
        return text, ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"expected SamplingParams, got "
                                      f"{type(params).__name__}")
        text, ids = self.tokenize(prompt)
        vocab = self.model_info.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidRequestError("sampling_params.stop_token_ids",
                                          f"token id {t} is outside the vocabulary [0, {vocab})")
        if self.extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(
                params, stop_token_ids=[*params.stop_token_ids, *self.extra_eos_ids])
        return text, EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                       sampling_params=params, eos_token_id=self.eos_token_id,
                                       arrival_time=time.time(), priority=priority)


class RequestCollector:
    """Accumulates one request's outputs (``n`` samples) into a RequestOutput."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Any, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.metrics = RequestMetrics(time.time() if arrival_time is None else arrival_time)
        self.num_cached_tokens = 0
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.completions = [CompletionOutput(index=i, text="", token_ids=[],
                                             cumulative_logprob=None if params.logprobs is None else 0.0,
                                             logprobs=None if params.logprobs is None else [])
                            for i in range(params.n)]
        self.num_unfinished = params.n

    def add(self, index: int, out: EngineCoreOutput) -> bool:
        """Record a delta for sample ``index``; return True once every sample has finished."""
        c = self.completions[index]
        if out.new_token_ids and self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        c.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and c.logprobs is not None:
            lp = out.new_logprobs
            for ids, lps, rank in zip(lp.token_ids, lp.logprobs, lp.sampled_ranks):
                entry = {ids[0]: Logprob(lps[0], rank, self.tokenizer.decode([ids[0]]))}
                for r, (t, v) in enumerate(zip(ids[1:], lps[1:]), start=1):
                    entry.setdefault(t, Logprob(v, r, self.tokenizer.decode([t])))
                c.logprobs.append(entry)
                c.cumulative_logprob += lps[0]
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason
            c.stop_reason = out.stop_reason
            c.text = self.tokenizer.decode(c.token_ids,
                                           skip_special_tokens=self.params.skip_special_tokens)
            self.num_unfinished -= 1
            if self.num_unfinished == 0:
                self.metrics.finished_time = time.time()
        return self.num_unfinished == 0

    def result(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             self.completions, finished=self.num_unfinished == 0,
                             num_cached_tokens=self.num_cached_tokens, metrics=self.metrics)
