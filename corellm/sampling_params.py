"""What the caller wants from one generation request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from corellm.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_I64 = 1 << 63
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text, vLLM's ``StructuredOutputsParams``: exactly one of
    ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, GBNF-style). Served by
    the enabled logits processor that implements them (``corellm[structured]``: xgrammar).

    ``start_after``: token ids that open the constrained part: the output is free until they
    are generated (consecutively), then constrained. A reasoning model's end-of-thinking marker
    (Qwen3's ``</think>``), so that the schema applies to the answer only."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    start_after: list[int] | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"structured_outputs.{name}" if name else
                                       "structured_outputs", msg)

        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise bad("", "give exactly one of " + ", ".join(self.KINDS)
                      + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad("json", f"must be a JSON schema (an object or its text), got "
                              f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(name, f"must be a non-empty string, got {value!r}")
        if self.choice is not None and (
                not isinstance(self.choice, (list, tuple)) or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)):
            raise bad("choice", f"must be a non-empty list of non-empty strings, got "
                                f"{self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise bad("json_object", f"must be a boolean, got {self.json_object!r}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if self.start_after is not None:
            if not isinstance(self.start_after, (list, tuple)) or not self.start_after or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    for t in self.start_after):
                raise bad("start_after", f"must be a non-empty list of token ids, got "
                                         f"{self.start_after!r}")
            self.start_after = list(self.start_after)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """Sampling parameters, in vLLM's shape.

    ``temperature == 0`` means greedy decoding. ``top_k == 0`` (or -1), ``top_p == 1`` and
    ``min_p == 0`` switch the respective filter off. ``seed`` makes one request reproducible on its
    own, independently of what else is in the batch and of preemption. ``logprobs=N`` returns the
    log-probabilities (of the model's unmodified distribution) of the sampled token and the top N.
    ``cache_salt`` isolates the request in the prefix cache: it shares cached KV blocks only with
    requests that carry the same salt (e.g. one salt per tenant).

    Penalties follow vLLM (and OpenAI for the first two): ``presence_penalty`` is subtracted from
    the logit of every token already generated, ``frequency_penalty`` times its count;
    ``repetition_penalty`` (the CTRL / Hugging Face rule) divides positive logits and multiplies
    negative ones of every token in the prompt or the output. ``stop`` strings end generation
    when they appear in the detokenized text; they are matched by the engine client (which sees
    the text) and, unless ``include_stop_str_in_output``, cut from the returned text.

    ``structured_outputs`` constrains the text to a JSON schema, a regex, a choice or a grammar
    (``StructuredOutputsParams``); ``extra_args`` carries the parameters of third-party logits
    processors, each reading its own keys (vLLM's ``extra_args``). With either, ``logprobs``
    are those of the distribution the processors leave.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"sampling_params.{name}", msg)

        for name in ("n", "max_tokens", "min_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(name, f"must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        for name in ("n", "max_tokens", "min_tokens", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None and not -_I64 <= value < _I64:
                raise bad(name, f"must fit in 64 bits, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str) or not self.cache_salt:
                raise bad("cache_salt", f"must be a non-empty string or None, got "
                                        f"{self.cache_salt!r}")
            try:
                self.cache_salt.encode()
            except UnicodeEncodeError:
                raise bad("cache_salt", "must be valid Unicode text (it contains a lone "
                                        "surrogate)") from None
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty <= 10:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) and s for s in self.stop):
            raise bad("stop", f"must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise bad("structured_outputs", str(exc)) from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of "
                                            f"its fields), got {self.structured_outputs!r}")
        if self.extra_args is not None and not (
                isinstance(self.extra_args, dict)
                and all(isinstance(k, str) for k in self.extra_args)):
            raise bad("extra_args", f"must be a dict with string keys, got {self.extra_args!r}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
