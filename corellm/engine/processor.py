"""Input processing: validate and tokenize a prompt into an EngineCoreRequest (the way back,
detokenization and stop strings, is ``corellm.engine.output_processor``)."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Union

from corellm.errors import InvalidRequestError
from corellm.interfaces import ModelInfo
from corellm.config.logits_processors import RequestChecker
from corellm.lora.request import LoRAError, LoRARequest
from corellm.request import EngineCoreRequest
from corellm.sampling_params import SamplingParams

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = Union[str, Mapping[str, Any]]


_INT = frozenset([int])


def _all_ints(ids: list[int] | tuple[int, ...]) -> bool:
    """Every element an integer, and no bool. Checked by type in one C pass first (a prompt
    of thousands of ids is checked per request); an int subclass the slow way."""
    return set(map(type, ids)) <= _INT or all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids)


class Processor:
    def __init__(self, tokenizer: Any, model_info: ModelInfo, extra_eos_ids: list[int],
                 checker: RequestChecker | None = None, max_lora_rank: int = 0) -> None:
        # tokenizer None (LLM(skip_tokenizer_init=True)): token-id prompts only, and the end of
        # a sequence is the checkpoint's end-of-sequence ids (extra_eos_ids, the first as EOS).
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.eos_token_id: int | None = (tokenizer.eos_token_id if tokenizer is not None
                                         else extra_eos_ids[0] if extra_eos_ids else None)
        self.extra_eos_ids = [e for e in extra_eos_ids if e != self.eos_token_id]
        # The enabled logits processors' checks (None: no processor is enabled, and structured
        # outputs are refused as the checker would refuse them).
        self.checker = checker if checker is not None else RequestChecker([])
        # LoRA adapters checked against the model (model_info.lora_targets), most recent last.
        self.max_lora_rank = max_lora_rank
        self._loras_checked: OrderedDict[LoRARequest, None] = OrderedDict()
        self._lora_ids: dict[int, LoRARequest] = {}   # each id names one adapter

    def check_lora(self, lora: Any) -> None:
        """An ``InvalidRequestError`` (field ``lora_request``) unless ``lora`` is a
        ``LoRARequest`` whose adapter fits this model: its files, rank, modules, shapes and
        weights are read and checked once (``corellm.lora.adapter.load_adapter``: what a
        worker will load, non-finite weights included), then remembered."""
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError("lora_request", f"expected a corellm.LoRARequest, got "
                                      f"{type(lora).__name__}")
        targets = self.model_info.lora_targets
        if targets is None:
            raise InvalidRequestError("lora_request", "this engine serves no LoRA adapters "
                                      "(set lora.enable, or LLM(..., enable_lora=True))")
        if lora in self._loras_checked:
            self._loras_checked.move_to_end(lora)
            return
        other = self._lora_ids.get(lora.lora_int_id)
        if other is not None and other != lora:
            raise InvalidRequestError("lora_request", f"lora_int_id {lora.lora_int_id} is "
                                      f"already adapter {other.lora_name!r} ({other.lora_path});"
                                      " each adapter needs an id of its own")
        from corellm.lora.adapter import load_adapter
        try:
            load_adapter(lora, targets, self.max_lora_rank)
        except LoRAError as exc:
            raise InvalidRequestError("lora_request", str(exc)) from None
        self._loras_checked[lora] = None
        self._lora_ids[lora.lora_int_id] = lora
        if len(self._loras_checked) > 1024:
            self._loras_checked.popitem(last=False)

    def check_params(self, params: SamplingParams) -> None:
        """The enabled logits processors' checks of ``params`` (a structured-output schema
        that does not compile, say): an ``InvalidRequestError`` naming the field. The server
        runs the checker in its check processes instead (parsing a schema may take a while:
        there a deadline can stop it), then ``process`` with ``params_checked``."""
        if params.structured_outputs is not None or self.checker.entries \
                or (params.extra_args and self.checker.idle_keys):
            try:
                self.checker.check(params)
            except InvalidRequestError as exc:
                if not exc.field.startswith("sampling_params."):
                    exc = InvalidRequestError(f"sampling_params.{exc.field}", exc.message)
                raise exc from None

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
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "a text prompt needs the tokenizer, which "
                                          "this engine skipped (skip_tokenizer_init): give "
                                          "prompt_token_ids")
            ids = self.tokenizer.encode(text)
        else:
            if not isinstance(ids, (list, tuple)) or not _all_ints(ids):
                raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
            ids = list(ids)
        if not ids:
            raise InvalidRequestError("prompt_token_ids" if text is None else "prompt",
                                      "is empty")
        vocab = self.model_info.vocab_size
        if not (0 <= min(ids) and max(ids) < vocab):       # then find the first bad one
            for i, t in enumerate(ids):
                if not 0 <= t < vocab:
                    raise InvalidRequestError(f"prompt_token_ids[{i}]", f"token id {t} is "
                                              f"outside the vocabulary [0, {vocab})")
        max_len = self.model_info.max_model_len
        if len(ids) > max_len:
            raise InvalidRequestError("prompt", f"{len(ids)} tokens exceeds model.max_model_len="
                                      f"{max_len}")
        return text, ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0, *, user: str | None = None, session_id: str | None = None,
                group_id: str | None = None, arrival_time: float | None = None,
                params_checked: bool = False, lora_request: LoRARequest | None = None,
                ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize one request. ``priority`` (lower runs first), ``user`` (tenant),
        ``session_id`` and ``group_id`` (the client call it belongs to) are scheduling
        attributes: policies read them, the model never does. ``lora_request``: the LoRA
        adapter the request runs (``check_lora``).
        ``arrival_time`` defaults to now (``time.time()``); a caller driving an engine on a
        virtual clock passes that clock's ``time()``. ``params_checked``: ``check_params``
        has run on ``params`` already (a server runs it in processes a deadline can kill)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", f"expected SamplingParams, got "
                                      f"{type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int) \
                or not -(1 << 63) <= priority < (1 << 63):
            raise InvalidRequestError("priority", f"must be a 64-bit integer, got {priority!r}")
        for name, value in (("user", user), ("session_id", session_id)):
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 256):
                raise InvalidRequestError(name, f"must be a string of 1 to 256 characters or "
                                          f"None, got {value!r:.80}")
        if group_id is not None and (not isinstance(group_id, str) or not group_id):
            raise InvalidRequestError("group_id", f"must be a non-empty string or None, got "
                                      f"{group_id!r:.80}")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("sampling_params.stop", "stop strings are matched in the "
                                      "text, which an engine without its tokenizer "
                                      "(skip_tokenizer_init) does not make; use stop_token_ids")
        if not params_checked:
            self.check_params(params)
        if lora_request is not None:
            self.check_lora(lora_request)
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
                                       arrival_time=time.time() if arrival_time is None
                                       else arrival_time, priority=priority,
                                       user=user, session_id=session_id, group_id=group_id,
                                       lora_request=lora_request)
