"""Seeded workloads: what requests a benchmark sends, and when.

CONTRACT (shared by the workload generator and the runner; keep these two dataclasses stable):

* ``BenchRequest`` is one request of a workload, fully determined by the workload spec and its
  seed, so two runs against two configs see the same requests at the same times.
* A first turn (``follows is None``) is sent ``delay_s`` seconds after the run starts, with
  ``prompt_token_ids`` as its whole prompt.
* A follow-up turn of a multi-turn session (``follows = i``) is sent ``delay_s`` seconds (think
  time) after request ``i`` finished; its prompt is request ``i``'s whole prompt + request ``i``'s
  output token ids + this request's ``prompt_token_ids`` (the new user message).

Below the contract: the workload spec (``WorkloadSpec``, read from YAML by
``load_workload_spec``; every field is described in the models, and ``corellm bench workload``
writes commented examples), ``build_workload`` (spec + seed -> ``Workload``),
``spec_from_vllm_args`` (the workload of ``vllm bench serve --dataset-name random``) and
``workload_stats`` (what ``--describe`` prints). A spec in brief::

    name: chat                    # optional
    seed: 0
    num_requests: 64              # without sessions
    requests:
      input_len: {dist: uniform, low: 64, high: 256}    # or 128, normal, file, mixture
      output_len: 32
      prompts: random             # or {source: file, path: prompts.jsonl}
      shared_prefix: {num_groups: 4, length: 128}
    sessions: {num_sessions: 8, turns: 4, message_len: 32,
               think_time_s: {dist: exponential, mean: 2}}
    tenants: [{name: a, weight: 3}, {name: b, weight: 1}]
    priorities: [{priority: 0, weight: 1}, {priority: 1, weight: 4}]
    arrivals: {pattern: gamma, rate: 4, burstiness: 0.5}   # or poisson, all_at_once
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr,
                      ValidationError, ValidationInfo, model_validator)

from corellm.config import did_you_mean
from corellm.errors import ProblemsError


@dataclass(frozen=True)
class BenchRequest:
    index: int                          # position in the workload; stable across runs
    prompt_token_ids: list[int]         # whole prompt (first turn) or the new message (follow-up)
    output_len: int                     # max_tokens; sent with ignore_eos so exactly this many
    delay_s: float = 0.0                # arrival offset from the run start, or think time
    follows: int | None = None          # index of the previous turn of the same session
    priority: int = 0                   # lower runs first (vLLM's convention)
    user: str | None = None             # tenant (OpenAI's `user` field)
    session_id: str | None = None       # multi-turn session
    shared_prefix_group: int | None = None   # which shared-prefix group the prompt starts with


@dataclass
class Workload:
    requests: list[BenchRequest]
    description: str                     # one line for tables and plot titles
    spec: dict[str, Any] = field(default_factory=dict)   # the spec it was built from (for JSON)


# ============================================================================ the spec
# A workload file is validated by the pydantic models below (every model forbids unknown keys),
# then ``build_workload`` draws the requests. Everything random is drawn from numpy generators
# seeded by (seed, stream): each aspect (lengths, tokens, arrivals, tenants, ...) has its own
# stream, so changing one part of a spec (say the tenant mix) leaves the others' draws unchanged
# and two workloads that differ in one knob are comparable request by request.

class WorkloadError(ProblemsError):
    """A workload spec is invalid, or cannot be built (``problems``: ``(key_path, message)``
    pairs, e.g. ``("requests.input_len.dist", "unknown dist 'unifrom'; did you mean
    uniform?")``)."""

    what = "workload"


class _Problem(ValueError):
    """Raised inside validators: a message for a key below the model being validated (``key``
    relative to it, "" for the model itself). The formatter joins it to the model's path."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


def _base_dir(info: ValidationInfo) -> Path:
    ctx = info.context or {}
    return Path(ctx.get("base_dir") or ".")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _no_bool(value: Any) -> Any:
    # YAML reads `yes`/`no` as booleans, and bool is an int subclass: refuse them as numbers.
    if isinstance(value, bool):
        raise _Problem("", f"expected a number, got {value!r}")
    return value


# ----------------------------------------------------------------------------- token lengths
class FixedLen(_Spec):
    dist: Literal["fixed"] = Field(description="Every draw is `value`.")
    value: int = Field(ge=1, description="The length, in tokens.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    def short(self) -> str:
        return str(self.value)


class UniformLen(_Spec):
    dist: Literal["uniform"] = Field(description="Integers uniform in [low, high], inclusive.")
    low: int = Field(ge=1, description="Smallest length, in tokens.")
    high: int = Field(ge=1, description="Largest length, in tokens (inclusive).")

    @model_validator(mode="after")
    def _ordered(self) -> UniformLen:
        if self.low > self.high:
            raise _Problem("high", f"must be >= low ({self.low}), got {self.high}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)

    def short(self) -> str:
        return f"{self.low}-{self.high}"


class NormalLen(_Spec):
    dist: Literal["normal"] = Field(
        description="Normal(mean, std), rounded to the nearest integer and clipped to "
                    "[min, max].")
    mean: float = Field(gt=0, allow_inf_nan=False, description="Mean, in tokens.")
    std: float = Field(ge=0, allow_inf_nan=False, description="Standard deviation, in tokens.")
    min: int = Field(default=1, ge=1, description="Draws below this become this.")
    max: int | None = Field(default=None, ge=1,
                            description="Draws above this become this (default: no upper clip).")

    @model_validator(mode="after")
    def _ordered(self) -> NormalLen:
        if self.max is not None and self.max < self.min:
            raise _Problem("max", f"must be >= min ({self.min}), got {self.max}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        draws = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.clip(draws, self.min, self.max).astype(np.int64)

    def short(self) -> str:
        hi = "" if self.max is None else f"..{self.max}"
        return f"normal({self.mean:g}, {self.std:g}) in [{self.min}{hi or '..'}]"


def _read_lengths(path: Path) -> list[int]:
    """Lengths from a JSON array of integers, or from text: integers separated by whitespace,
    commas or newlines (``#`` starts a comment)."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _Problem("path", f"{path}: not valid JSON: {exc}") from None
    else:
        values = []
        for lineno, line in enumerate(text.splitlines(), 1):
            for token in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    values.append(int(token))
                except ValueError:
                    raise _Problem("path", f"{path}:{lineno}: expected integer lengths, got "
                                           f"{token!r}") from None
    if not isinstance(values, list) or not values:
        raise _Problem("path", f"{path}: expected a non-empty list of lengths")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise _Problem("path", f"{path}: lengths must be integers >= 1, got {bad[0]!r}")
    return values


class FileLen(_Spec):
    dist: Literal["file"] = Field(
        description="Draws (with replacement, uniformly) from the lengths listed in a file: a "
                    "JSON array of integers, or integers separated by whitespace/commas.")
    path: str = Field(description="The file; a relative path is relative to the workload file.")
    _values: list[int] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> FileLen:
        path = _base_dir(info) / Path(self.path).expanduser()
        try:
            self._values = _read_lengths(path)
        except OSError as exc:
            raise _Problem("path", f"cannot read {path}: {exc.strerror or exc}") from None
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self._values, dtype=np.int64), size=n)

    def short(self) -> str:
        return f"from {Path(self.path).name}"


class _Weighted(_Spec):
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative weight of this component (normalized).")


class FixedComponent(FixedLen, _Weighted):
    pass


class UniformComponent(UniformLen, _Weighted):
    pass


class NormalComponent(NormalLen, _Weighted):
    pass


class FileComponent(FileLen, _Weighted):
    pass


Component = Annotated[Union[FixedComponent, UniformComponent, NormalComponent, FileComponent],
                      Field(discriminator="dist")]


def _apportion(weights: Sequence[float], n: int) -> np.ndarray:
    """Integer counts summing to ``n`` as close as possible to the weights' proportions
    (largest remainder: floor every quota, then give the leftover units to the largest
    fractional parts, earlier entries first on ties)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = w / w.sum() * n
    counts = np.floor(quotas).astype(np.int64)
    leftover = n - int(counts.sum())
    # argsort of the negated remainders, stable, so ties go to the earlier entry.
    order = np.argsort(-(quotas - counts), kind="stable")
    counts[order[:leftover]] += 1
    return counts


def _assign(weights: Sequence[float], n: int, rng: np.random.Generator) -> np.ndarray:
    """Which of ``len(weights)`` classes each of ``n`` items gets: exactly the apportioned
    counts, in a seeded random order. Exact rather than i.i.d. so that a 20% class of 40
    requests is 8 requests under every seed; with i.i.d. draws the class sizes themselves would
    vary between repeats and blur an A/B comparison of small workloads."""
    labels = np.repeat(np.arange(len(weights)), _apportion(weights, n))
    return rng.permutation(labels)


class MixtureLen(_Spec):
    dist: Literal["mixture"] = Field(
        description="A weighted mix of the other distributions (e.g. bimodal short/long): each "
                    "component gets its share of the draws exactly, in a seeded random order.")
    components: list[Component] = Field(
        min_length=1, description="The components: each a distribution with a `weight`.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        which = _assign([c.weight for c in self.components], n, rng)
        out = np.zeros(n, dtype=np.int64)
        for j, comp in enumerate(self.components):
            mask = which == j
            out[mask] = comp.sample(rng, int(mask.sum()))
        return out

    def short(self) -> str:
        total = sum(c.weight for c in self.components)
        return "mix(" + ", ".join(f"{c.weight / total:.0%} {c.short()}"
                                  for c in self.components) + ")"


def _int_is_fixed(value: Any) -> Any:
    """A plain integer is shorthand for ``{dist: fixed, value: N}``."""
    _no_bool(value)
    if isinstance(value, int):
        return {"dist": "fixed", "value": value}
    return value


LenDist = Annotated[Union[FixedLen, UniformLen, NormalLen, FileLen, MixtureLen],
                    Field(discriminator="dist"), BeforeValidator(_int_is_fixed)]
LEN_DISTS = ("fixed", "uniform", "normal", "file", "mixture")


# ----------------------------------------------------------------------------- durations
class FixedTime(_Spec):
    dist: Literal["fixed"] = Field(description="Every draw is `value`.")
    value: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.float64)

    def short(self) -> str:
        return f"{self.value:g}s"


class UniformTime(_Spec):
    dist: Literal["uniform"] = Field(description="Uniform in [low, high] seconds.")
    low: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    high: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")

    @model_validator(mode="after")
    def _ordered(self) -> UniformTime:
        if self.low > self.high:
            raise _Problem("high", f"must be >= low ({self.low:g}), got {self.high:g}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.low, self.high, size=n)

    def short(self) -> str:
        return f"{self.low:g}-{self.high:g}s"


class NormalTime(_Spec):
    dist: Literal["normal"] = Field(description="Normal(mean, std) seconds, clipped to [min, max].")
    mean: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    std: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    min: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="Lower clip, seconds.")
    max: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                              description="Upper clip, seconds (default: none).")

    @model_validator(mode="after")
    def _ordered(self) -> NormalTime:
        if self.max is not None and self.max < self.min:
            raise _Problem("max", f"must be >= min ({self.min:g}), got {self.max:g}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.normal(self.mean, self.std, size=n), self.min, self.max)

    def short(self) -> str:
        return f"normal({self.mean:g}s, {self.std:g}s)"


class ExponentialTime(_Spec):
    dist: Literal["exponential"] = Field(
        description="Exponential with the given mean: memoryless, many short pauses and a few "
                    "long ones, like people reading a reply.")
    mean: float = Field(gt=0, allow_inf_nan=False, description="Mean, seconds.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean, size=n)

    def short(self) -> str:
        return f"exp(mean {self.mean:g}s)"


def _number_is_fixed(value: Any) -> Any:
    """A plain number is shorthand for ``{dist: fixed, value: X}``."""
    _no_bool(value)
    if isinstance(value, (int, float)):
        return {"dist": "fixed", "value": value}
    return value


TimeDist = Annotated[Union[FixedTime, UniformTime, NormalTime, ExponentialTime],
                     Field(discriminator="dist"), BeforeValidator(_number_is_fixed)]
TIME_DISTS = ("fixed", "uniform", "normal", "exponential")


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class _PromptLine:
    ids: list[int] | None
    text: str | None
    output_len: int | None
    lineno: int


def _read_prompts(path: Path) -> list[_PromptLine]:
    lines = []
    try:
        handle = path.open()
    except OSError as exc:
        raise _Problem("path", f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        for lineno, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            where = f"{path.name}:{lineno}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError:
                raise _Problem("path", f"{where}: not a JSON object") from None
            if not isinstance(obj, dict):
                raise _Problem("path", f"{where}: expected a JSON object")
            ids, text = obj.get("prompt_token_ids"), obj.get("prompt")
            if (ids is None) == (text is None):
                raise _Problem("path", f"{where}: expected exactly one of \"prompt_token_ids\" "
                                       "(a list of ints) and \"prompt\" (text)")
            if ids is not None and (not isinstance(ids, list) or not ids or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
                raise _Problem("path", f"{where}: \"prompt_token_ids\" must be a non-empty list "
                                       "of token ids >= 0")
            if text is not None and (not isinstance(text, str) or not text):
                raise _Problem("path", f"{where}: \"prompt\" must be a non-empty string")
            out = obj.get("output_len", obj.get("max_tokens"))
            if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 1):
                raise _Problem("path", f"{where}: \"output_len\" must be an integer >= 1")
            extra = set(obj) - {"prompt_token_ids", "prompt", "output_len", "max_tokens"}
            if extra:
                raise _Problem("path", f"{where}: unknown key(s) {', '.join(sorted(extra))}")
            lines.append(_PromptLine(ids, text, out, lineno))
    if not lines:
        raise _Problem("path", f"{path}: no prompts")
    return lines


class RandomPrompts(_Spec):
    source: Literal["random"] = Field(
        description="Random token ids, uniform over the model's vocabulary minus special "
                    "tokens; lengths from `input_len` (first turns) and `sessions.message_len` "
                    "(follow-ups).")


class FilePrompts(_Spec):
    source: Literal["file"] = Field(
        description="Prompts from a JSONL file, one `{\"prompt_token_ids\": [...]}` or "
                    "`{\"prompt\": \"text\"}` per line (text needs the model's tokenizer); "
                    "an optional `\"output_len\"` (or `\"max_tokens\"`) overrides `output_len`. "
                    "Follow-up turns take the next lines.")
    path: str = Field(description="The JSONL file; relative to the workload file.")
    order: Literal["shuffle", "sequential", "sample"] = Field(
        default="shuffle",
        description="shuffle: a seeded permutation of the lines (cycled when more are needed); "
                    "sequential: file order (cycled; the same prompts under every seed); "
                    "sample: seeded draws with replacement.")
    _lines: list[_PromptLine] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> FilePrompts:
        self._lines = _read_prompts(_base_dir(info) / Path(self.path).expanduser())
        return self

    @property
    def needs_tokenizer(self) -> bool:
        return any(line.text is not None for line in self._lines)


def _name_is_source(value: Any) -> Any:
    """``prompts: random`` is shorthand for ``prompts: {source: random}``."""
    return {"source": value} if isinstance(value, str) else value


PromptSource = Annotated[Union[RandomPrompts, FilePrompts], Field(discriminator="source"),
                         BeforeValidator(_name_is_source)]


class SharedPrefix(_Spec):
    num_groups: int = Field(ge=1, description="How many distinct prefixes (e.g. system prompts).")
    length: int = Field(ge=1, description="Tokens in each prefix.")


class RequestsSpec(_Spec):
    input_len: LenDist | None = Field(
        default=None,
        description="Prompt tokens of a first turn (after the shared prefix, if any); an "
                    "integer means fixed. Required with random prompts; not allowed with prompts "
                    "from a file (they have their own lengths).")
    output_len: LenDist = Field(
        description="Output tokens per request (sent with ignore_eos, so exactly this many); "
                    "an integer means fixed.")
    prompts: PromptSource = Field(
        default_factory=lambda: RandomPrompts(source="random"),
        description="Where prompts come from: `random` (default) or `{source: file, path: ...}`.")
    shared_prefix: SharedPrefix | None = Field(
        default=None,
        description="Requests (sessions) are split evenly into groups; each prompt starts with "
                    "its group's random prefix, so the prefix cache can reuse it.")

    @model_validator(mode="after")
    def _lengths_match_source(self) -> RequestsSpec:
        if isinstance(self.prompts, RandomPrompts) and self.input_len is None:
            raise _Problem("input_len", "required with random prompts")
        if isinstance(self.prompts, FilePrompts) and self.input_len is not None:
            raise _Problem("input_len", "not used with prompts from a file (each has its own "
                                        "length); remove it")
        return self


class SessionsSpec(_Spec):
    num_sessions: int = Field(ge=1, description="Conversations; each arrives as one unit.")
    turns: LenDist = Field(
        description="Requests (turns) per session; an integer means fixed. Every turn after "
                    "the first resends the whole history plus a new user message.")
    message_len: LenDist | None = Field(
        default=None,
        description="Tokens of the new user message of a follow-up turn (default: "
                    "`requests.input_len`).")
    think_time_s: TimeDist = Field(
        default_factory=lambda: FixedTime(dist="fixed", value=0.0),
        description="Seconds between a turn's end and the next turn of the session being sent; "
                    "a number means fixed, or {dist: exponential, mean: S}, uniform, normal.")


class Tenant(_Spec):
    name: str = Field(min_length=1, description="Sent as the request's `user`.")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of the requests (sessions).")


class PriorityShare(_Spec):
    priority: int = Field(description="The request's priority; lower runs first (vLLM's "
                                      "convention).")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of the requests (sessions).")


class AllAtOnce(_Spec):
    pattern: Literal["all_at_once"] = Field(
        description="Every first turn is due at t=0: a backlog (vLLM's --request-rate inf).")

    def short(self) -> str:
        return "all at once"


class PoissonArrivals(_Spec):
    pattern: Literal["poisson"] = Field(
        description="Exponential inter-arrival times at `rate` per second.")
    rate: float = Field(gt=0, allow_inf_nan=False, description="First turns per second.")
    rescale: bool = Field(
        default=True,
        description="Stretch the arrival times so the last one lands at N/rate, as `vllm bench "
                    "serve` does: the offered load is then exactly `rate` under every seed.")

    @property
    def burstiness(self) -> float:
        return 1.0

    def short(self) -> str:
        return f"Poisson {self.rate:g}/s"


class GammaArrivals(_Spec):
    pattern: Literal["gamma"] = Field(
        description="Gamma inter-arrival times as `vllm bench serve --burstiness`: shape = "
                    "burstiness, scale = 1/(rate*burstiness), so the mean gap is 1/rate.")
    rate: float = Field(gt=0, allow_inf_nan=False, description="First turns per second.")
    burstiness: float = Field(
        gt=0, description="Gamma shape: 1 is Poisson, < 1 burstier (clumps and lulls), > 1 "
                          "more even; .inf sends at exactly 1/rate intervals.")
    rescale: bool = Field(default=True, description=PoissonArrivals.model_fields["rescale"]
                          .description)

    def short(self) -> str:
        return f"gamma {self.rate:g}/s burstiness {self.burstiness:g}"


def _name_is_pattern(value: Any) -> Any:
    """``arrivals: all_at_once`` is shorthand for ``arrivals: {pattern: all_at_once}``."""
    return {"pattern": value} if isinstance(value, str) else value


Arrivals = Annotated[Union[AllAtOnce, PoissonArrivals, GammaArrivals],
                     Field(discriminator="pattern"), BeforeValidator(_name_is_pattern)]


class WorkloadSpec(_Spec):
    """A benchmark workload: which requests, with what lengths, for whom, arriving when."""

    name: str | None = Field(default=None, description="A short name for tables and plots.")
    seed: int = Field(default=0, description="Seed of every random draw; `corellm bench "
                                             "--seed/--repeats` override it.")
    num_requests: int | None = Field(
        default=None, ge=1,
        description="Requests in the workload. Without sessions, required; with sessions, "
                    "leave it out (it is the sum of the sessions' turns).")
    requests: RequestsSpec = Field(description="Prompt and output lengths, prompt source, "
                                               "shared prefixes.")
    sessions: SessionsSpec | None = Field(
        default=None, description="Multi-turn chat sessions (default: single-turn requests).")
    tenants: list[Tenant] | None = Field(
        default=None, min_length=1,
        description="Tenants and their shares of the requests (whole sessions); default: none.")
    priorities: list[PriorityShare] | None = Field(
        default=None, min_length=1,
        description="Priority classes and their shares of the requests (whole sessions); "
                    "default: all priority 0.")
    arrivals: Arrivals = Field(
        default_factory=lambda: AllAtOnce(pattern="all_at_once"),
        description="When first turns arrive: all_at_once, poisson (rate) or gamma (rate, "
                    "burstiness). Follow-up turns come think_time_s after the previous one.")

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadSpec:
        if self.sessions is None and self.num_requests is None:
            raise _Problem("num_requests", "required (or give `sessions`)")
        if self.sessions is not None and self.num_requests is not None:
            raise _Problem("num_requests", "not allowed with `sessions` (the requests are the "
                                           "sessions' turns); remove it")
        if self.tenants and len({t.name for t in self.tenants}) < len(self.tenants):
            raise _Problem("tenants", "names must be unique")
        if self.priorities and (len({p.priority for p in self.priorities})
                                < len(self.priorities)):
            raise _Problem("priorities", "each priority may appear once")
        return self

    @property
    def needs_tokenizer(self) -> bool:
        """True when prompts come from a file with text prompts."""
        prompts = self.requests.prompts
        return isinstance(prompts, FilePrompts) and prompts.needs_tokenizer


# ----------------------------------------------------------------------------- errors
_DISCRIMINATORS = {"dist": LEN_DISTS + TIME_DISTS, "source": ("random", "file"),
                   "pattern": ("all_at_once", "poisson", "gamma")}


def _all_keys() -> set[str]:
    models = [FixedLen, UniformLen, NormalLen, FileLen, MixtureLen, _Weighted, FixedTime,
              UniformTime, NormalTime, ExponentialTime, RandomPrompts, FilePrompts,
              SharedPrefix, RequestsSpec, SessionsSpec, Tenant, PriorityShare, AllAtOnce,
              PoissonArrivals, GammaArrivals, WorkloadSpec]
    return {name for m in models for name in m.model_fields}


def _key_path(loc: Sequence[Any], data: Any) -> str:
    """The user's key path of a pydantic error location. Pydantic puts the tags of tagged
    unions (``uniform``) and validator names into ``loc``; they are not keys of the file, so the
    location is walked along the input and only the steps found there are kept, plus a last
    step that is a missing key."""
    tags = {t for choices in _DISCRIMINATORS.values() for t in choices}
    parts: list[str] = []
    current = data
    for i, step in enumerate(loc):
        if isinstance(current, Mapping) and step in current:
            parts.append(str(step))
            current = current[step]
        elif isinstance(current, list) and isinstance(step, int) and 0 <= step < len(current):
            parts.append(str(step))
            current = current[step]
        elif (i == len(loc) - 1 and isinstance(current, Mapping) and isinstance(step, str)
              and step not in tags and "[" not in step):
            parts.append(step)          # a required key the input lacks
    return ".".join(parts)


def _problems(exc: ValidationError, data: Any) -> list[tuple[str, str]]:
    keys = sorted(_all_keys())
    out = []
    for err in exc.errors():
        path = _key_path(err["loc"], data)
        kind = err["type"]
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _Problem):
            path = ".".join(p for p in (path, cause.key) if p)
            msg = cause.message
        elif kind == "extra_forbidden":
            msg = "unknown key" + did_you_mean(str(err["loc"][-1]), keys)
        elif kind == "missing":
            msg = "required"
        elif kind == "too_short" and ctx.get("min_length") == 1:
            msg = "must not be empty"
        elif kind == "model_attributes_type":
            msg = f"expected a mapping of keys, got {err.get('input')!r}"
        elif kind == "union_tag_not_found":
            disc = ctx.get("discriminator", "").strip("'")
            choices = _DISCRIMINATORS.get(disc, ())
            if disc == "dist":      # which family: durations are only under think_time_s
                choices = TIME_DISTS if "think_time_s" in path else LEN_DISTS
            msg = f"missing `{disc}`" + (f" (one of {', '.join(choices)})" if choices else "")
            path = ".".join(p for p in (path, disc) if p)
        elif kind == "union_tag_invalid":
            disc = ctx.get("discriminator", "").strip("'")
            tag = str(ctx.get("tag", ""))
            expected = str(ctx.get("expected_tags", "")).replace("'", "")
            msg = (f"unknown {disc} {tag!r}"
                   + did_you_mean(tag, [t.strip() for t in expected.split(",")])
                   + f" (expected one of: {expected})")
            path = ".".join(p for p in (path, disc) if p)
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], (Mapping, list)):
                msg += f" (got {err['input']!r})"
        out.append((path, msg))
    return out


def load_workload_spec(source: str | Path | Mapping[str, Any] | WorkloadSpec, *,
                       base_dir: str | Path | None = None) -> WorkloadSpec:
    """Read and validate a workload spec (a YAML or JSON file, or a mapping).

    Files the spec names (prompt and length files) are read now, relative to the spec file's
    directory (or ``base_dir``; for a mapping, default the current directory), so a bad path is
    reported with its key before any benchmark starts. Raises ``WorkloadError`` naming the key
    path of every problem.
    """
    if isinstance(source, WorkloadSpec):
        return source
    origin = None
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        origin = str(source)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise WorkloadError([("", f"cannot read {path}: {exc.strerror or exc}")]) from None
        except yaml.YAMLError as exc:
            raise WorkloadError([("", f"not valid YAML: {exc}")], source=origin) from None
        if base_dir is None:
            base_dir = path.parent
    else:
        data = source
    if not isinstance(data, Mapping):
        raise WorkloadError([("", f"expected a mapping of keys, got {type(data).__name__}")],
                            source=origin)
    data = dict(data)
    try:
        return WorkloadSpec.model_validate(data, context={"base_dir": base_dir or "."})
    except ValidationError as exc:
        raise WorkloadError(_problems(exc, data), source=origin) from None


# ============================================================================ vLLM's random dataset
def spec_from_vllm_args(*, input_len: int, output_len: int, range_ratio: float,
                        num_prompts: int, request_rate: float, burstiness: float,
                        seed: int) -> WorkloadSpec:
    """The workload ``vllm bench serve --dataset-name random`` sends with these flags.

    vLLM draws each request's input and output length as integers uniform in
    [floor(len * (1 - r)), ceil(len * (1 + r))] (r = ``--random-range-ratio``, in [0, 1); the
    output range is raised to at least 1), random token ids for the prompt, and gamma
    inter-arrival times (shape ``burstiness``, mean 1/rate; ``request_rate = inf`` sends
    everything at once). Two deliberate differences: vLLM first subtracts the tokens its
    tokenizer would add (a BOS) from the input length because it sends text; corellm sends the
    token ids themselves, so the prompt is exactly the drawn length. And the bounds are computed
    free of float noise (vLLM's ``ceil(100 * 1.1)`` is 111).
    """
    problems = []
    if not 0.0 <= range_ratio < 1.0:
        problems.append(("random_range_ratio", f"must be in [0, 1), got {range_ratio:g}"))
    if input_len < 1:
        problems.append(("random_input_len", f"must be >= 1, got {input_len}"))
    if output_len < 1:
        problems.append(("random_output_len", f"must be >= 1, got {output_len}"))
    if num_prompts < 1:
        problems.append(("num_prompts", f"must be >= 1, got {num_prompts}"))
    if not request_rate > 0:
        problems.append(("request_rate", f"must be > 0 (or inf), got {request_rate:g}"))
    if not burstiness > 0:
        problems.append(("burstiness", f"must be > 0, got {burstiness:g}"))
    if problems:
        raise WorkloadError(problems)

    def bounds(length: int) -> tuple[int, int]:
        # Round away float noise (1e-9 of a token) before floor/ceil: 100 * (1 + 0.1) is
        # 110.00000000000001 in binary floating point, which must stay 110.
        low = math.floor(round(length * (1.0 - range_ratio), 9))
        high = math.ceil(round(length * (1.0 + range_ratio), 9))
        return low, high

    def dist(low: int, high: int) -> dict[str, Any]:
        return ({"dist": "fixed", "value": low} if low == high
                else {"dist": "uniform", "low": low, "high": high})

    in_lo, in_hi = bounds(input_len)
    if in_lo < 1:
        raise WorkloadError([("random_range_ratio", f"with --random-input-len {input_len} the "
                                                    f"shortest prompt would be {in_lo} tokens; "
                                                    "lower the ratio or raise the length")])
    out_lo, out_hi = bounds(output_len)
    out_lo, out_hi = max(out_lo, 1), max(out_hi, 1)
    if math.isinf(request_rate):
        arrivals: dict[str, Any] = {"pattern": "all_at_once"}
    elif burstiness == 1.0:
        arrivals = {"pattern": "poisson", "rate": request_rate}
    else:
        arrivals = {"pattern": "gamma", "rate": request_rate, "burstiness": burstiness}
    return load_workload_spec({
        "name": "random", "seed": seed, "num_requests": num_prompts,
        "requests": {"input_len": dist(in_lo, in_hi), "output_len": dist(out_lo, out_hi)},
        "arrivals": arrivals})


# ============================================================================ building
# Stream ids of the seeded generators (see the top of this section). Never renumber them: a
# renumbering changes every workload drawn from an existing spec and seed.
_STREAM = {"turns": 1, "arrivals": 2, "tenants": 3, "priorities": 4, "groups": 5,
           "prefixes": 6, "input_len": 7, "message_len": 8, "output_len": 9, "think": 10,
           "tokens": 11, "prompt_order": 12}


def _rng(seed: int, stream: str) -> np.random.Generator:
    return np.random.default_rng([seed, _STREAM[stream]])


def arrival_times(arrivals: AllAtOnce | PoissonArrivals | GammaArrivals, n: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Send times (seconds from the run start, non-decreasing) of ``n`` arrivals.

    As ``vllm bench serve``: the gaps are gamma(shape=b, scale=1/(rate*b)), whose mean is
    shape*scale = 1/rate whatever b, and whose coefficient of variation is 1/sqrt(b) (b = 1 is
    the exponential: Poisson arrivals). The first arrival comes after one gap, and with
    ``rescale`` the times are stretched by one common factor so the last is exactly n/rate;
    that keeps the offered load equal across seeds without changing the gaps' relative shape.
    """
    if isinstance(arrivals, AllAtOnce) or n == 0:
        return np.zeros(n)
    rate = arrivals.rate
    shape = arrivals.burstiness
    if math.isinf(shape):
        gaps = np.full(n, 1.0 / rate)     # the gamma's limit as its shape grows: no variance
    else:
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    times = np.cumsum(gaps)
    if arrivals.rescale and times[-1] > 0:
        times *= (n / rate) / times[-1]
    return times


def allowed_token_ids(vocab_size: int, exclude_ids: Iterable[int] = frozenset()) -> np.ndarray:
    """Ids random prompts are drawn from: [0, vocab_size) minus ``exclude_ids``."""
    excluded = np.fromiter((int(i) for i in exclude_ids), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), excluded)
    if allowed.size == 0:
        raise WorkloadError([("", f"no token ids to draw prompts from (vocab_size "
                                  f"{vocab_size}, {excluded.size} excluded)")])
    return allowed


class _FileFeed:
    """Hands out the prompts of a JSONL file in the spec's order, tokenizing text."""

    def __init__(self, prompts: FilePrompts, rng: np.random.Generator, tokenizer: Any,
                 vocab_size: int) -> None:
        self.lines = prompts._lines
        self.order = prompts.order
        self.rng = rng
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.path = prompts.path
        self.queue: list[int] = []

    def _next_index(self) -> int:
        n = len(self.lines)
        if self.order == "sample":
            return int(self.rng.integers(n))
        if not self.queue:
            self.queue = (list(range(n)) if self.order == "sequential"
                          else self.rng.permutation(n).tolist())
        return self.queue.pop(0)

    def next(self, first_turn: bool) -> tuple[list[int], int | None]:
        line = self.lines[self._next_index()]
        if line.text is not None:
            # A first turn is tokenized as a server tokenizes a text prompt (with the
            # tokenizer's special tokens, e.g. BOS); a follow-up message continues a
            # conversation, so it gets none.
            ids = list(self.tokenizer.encode(line.text, add_special_tokens=first_turn))
            if not ids:
                raise WorkloadError([("requests.prompts.path", f"{self.path}:{line.lineno}: "
                                                               "the prompt tokenizes to nothing")])
        else:
            ids = list(line.ids or [])
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise WorkloadError([("requests.prompts.path",
                                  f"{self.path}:{line.lineno}: token id {bad[0]} is outside the "
                                  f"vocabulary (size {self.vocab_size})")])
        return ids, line.output_len


def build_workload(spec: WorkloadSpec | Mapping[str, Any] | str | Path, *, vocab_size: int,
                   exclude_ids: Iterable[int] = frozenset(), seed: int | None = None,
                   tokenizer: Any = None, max_model_len: int | None = None) -> Workload:
    """Draw the requests of a workload: the same spec and seed give the same requests.

    ``vocab_size`` and ``exclude_ids`` say which token ids random prompts use (the runner passes
    what both the model and its tokenizer know, minus special tokens). ``seed`` overrides the
    spec's (``--repeats`` runs seed, seed+1, ...). ``tokenizer`` (anything with
    ``encode(text, add_special_tokens=...)``) is needed only for text prompts from a file.
    ``max_model_len``, when given, rejects a workload in which some request's context (its
    whole prompt, history included, plus its output) would not fit the model: sessions resend
    their history and outputs have exact lengths, so this is known before anything runs.

    Requests come session by session (single-turn requests are one-turn sessions), in arrival
    order; a session's turns are consecutive.
    """
    spec = load_workload_spec(spec)
    seed = spec.seed if seed is None else int(seed)
    req = spec.requests
    prompts = req.prompts
    if isinstance(prompts, FilePrompts) and prompts.needs_tokenizer and tokenizer is None:
        raise WorkloadError([("requests.prompts.path",
                              f"{prompts.path} has text prompts (\"prompt\"), which need the "
                              "model's tokenizer: pass tokenizer= (corellm bench does)")])

    # --- the conversations (single-turn requests are one-turn conversations)
    if spec.sessions is not None:
        n_conv = spec.sessions.num_sessions
        turns = spec.sessions.turns.sample(_rng(seed, "turns"), n_conv)
    else:
        n_conv = int(spec.num_requests or 0)
        turns = np.ones(n_conv, dtype=np.int64)
    n_follow = int(turns.sum()) - n_conv
    starts = arrival_times(spec.arrivals, n_conv, _rng(seed, "arrivals"))

    def labels(items: list[Any] | None, stream: str) -> list[Any]:
        if not items:
            return [None] * n_conv
        which = _assign([it.weight for it in items], n_conv, _rng(seed, stream))
        return [items[int(k)] for k in which]

    tenants = [t.name if t else None for t in labels(spec.tenants, "tenants")]
    priorities = [p.priority if p else 0 for p in labels(spec.priorities, "priorities")]

    allowed = allowed_token_ids(vocab_size, exclude_ids) if isinstance(
        prompts, RandomPrompts) or req.shared_prefix else None
    groups: list[int | None] = [None] * n_conv
    prefixes: list[list[int]] = []
    if req.shared_prefix is not None:
        sp = req.shared_prefix
        groups = [int(g) for g in _assign([1.0] * sp.num_groups, n_conv, _rng(seed, "groups"))]
        prefix_rng = _rng(seed, "prefixes")
        prefixes = [prefix_rng.choice(allowed, size=sp.length).tolist()
                    for _ in range(sp.num_groups)]

    # --- lengths and tokens, conversation by conversation
    outputs = req.output_len.sample(_rng(seed, "output_len"), n_conv + n_follow)
    think = (spec.sessions.think_time_s.sample(_rng(seed, "think"), n_follow)
             if spec.sessions is not None else np.zeros(0))
    token_rng = _rng(seed, "tokens")
    if isinstance(prompts, RandomPrompts):
        assert req.input_len is not None and allowed is not None
        first_lens = req.input_len.sample(_rng(seed, "input_len"), n_conv)
        msg_dist = (spec.sessions.message_len if spec.sessions is not None
                    and spec.sessions.message_len is not None else req.input_len)
        msg_lens = msg_dist.sample(_rng(seed, "message_len"), n_follow)
        feed = None
    else:
        feed = _FileFeed(prompts, _rng(seed, "prompt_order"), tokenizer, vocab_size)

    requests: list[BenchRequest] = []
    k_follow = 0
    for c in range(n_conv):
        session_id = f"session-{c}" if spec.sessions is not None else None
        prev: int | None = None
        for t in range(int(turns[c])):
            index = len(requests)
            if feed is not None:
                ids, line_out = feed.next(first_turn=t == 0)
            else:
                n_tokens = int(first_lens[c]) if t == 0 else int(msg_lens[k_follow])
                ids, line_out = token_rng.choice(allowed, size=n_tokens).tolist(), None
            if t == 0 and groups[c] is not None:
                ids = prefixes[groups[c]] + ids
            out_len = line_out if line_out is not None else int(outputs[index])
            delay = float(starts[c]) if t == 0 else float(think[k_follow])
            if t > 0:
                k_follow += 1
            requests.append(BenchRequest(
                index=index, prompt_token_ids=ids, output_len=out_len, delay_s=delay,
                follows=prev, priority=priorities[c], user=tenants[c], session_id=session_id,
                shared_prefix_group=groups[c]))
            prev = index

    if max_model_len is not None:
        ctx = context_lengths(requests)
        over = [(i, n) for i, n in enumerate(ctx) if n > max_model_len]
        if over:
            worst = max(over, key=lambda x: x[1])
            raise WorkloadError([("", f"{len(over)} request(s) need more context than "
                                      f"max_model_len {max_model_len} (request {worst[0]}: "
                                      f"{worst[1]} tokens of prompt, history and output)")])

    spec_dict = _jsonable(spec.model_dump(mode="python", exclude_none=True))
    spec_dict["seed"] = seed
    return Workload(requests, describe_spec(spec, seed=seed), spec_dict)


def _jsonable(value: Any) -> Any:
    """The spec as plain JSON: infinities become the string "inf" (which the spec accepts)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, Mapping):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def context_lengths(requests: Sequence[BenchRequest]) -> list[int]:
    """Per request, the tokens it occupies at its end: its whole prompt (a follow-up's includes
    the session's history, each earlier output counted at its exact ``output_len``) plus its own
    output."""
    by_index = {r.index: r for r in requests}
    full_prompt: dict[int, int] = {}

    def prompt_len(r: BenchRequest) -> int:
        if r.index not in full_prompt:
            if r.follows is None:
                full_prompt[r.index] = len(r.prompt_token_ids)
            else:
                prev = by_index[r.follows]
                full_prompt[r.index] = (prompt_len(prev) + prev.output_len
                                        + len(r.prompt_token_ids))
        return full_prompt[r.index]

    # Walk in index order: the workloads built here list a turn after the one it follows, so
    # the recursion above stays one level deep.
    return [prompt_len(r) + r.output_len for r in requests]


def _shares(items: Sequence[tuple[Any, float]]) -> str:
    total = sum(w for _, w in items)
    return "/".join(f"{k}:{w / total:.0%}" for k, w in items)


def describe_spec(spec: WorkloadSpec, *, seed: int | None = None) -> str:
    """One line for tables and plot titles, e.g. ``backlog: 64 requests, input 64-256, output
    32, all at once, priorities 0:20%/1:80%, seed 0``."""
    req = spec.requests
    parts = []
    if spec.sessions is not None:
        s = spec.sessions
        parts.append(f"{s.num_sessions} sessions x {s.turns.short()} turns")
        if s.message_len is not None:
            parts.append(f"message {s.message_len.short()}")
        parts.append(f"think {s.think_time_s.short()}")
    else:
        parts.append(f"{spec.num_requests} requests")
    if isinstance(req.prompts, FilePrompts):
        parts.append(f"prompts from {Path(req.prompts.path).name}")
    elif req.input_len is not None:
        parts.append(f"input {req.input_len.short()}")
    parts.append(f"output {req.output_len.short()}")
    if req.shared_prefix is not None:
        parts.append(f"{req.shared_prefix.num_groups} shared prefixes of "
                     f"{req.shared_prefix.length}")
    parts.append(spec.arrivals.short())
    if spec.tenants:
        parts.append("tenants " + _shares([(t.name, t.weight) for t in spec.tenants]))
    if spec.priorities:
        parts.append("priorities " + _shares([(p.priority, p.weight) for p in spec.priorities]))
    parts.append(f"seed {spec.seed if seed is None else seed}")
    line = ", ".join(parts)
    return f"{spec.name}: {line}" if spec.name else line


# ============================================================================ statistics
def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not len(values):
        return None
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "min": float(a.min()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max()), "sum": float(a.sum())}


def workload_stats(workload: Workload) -> dict[str, Any]:
    """Counts, length statistics, arrival span and class shares of a built workload (what
    ``corellm bench workload --describe`` prints)."""
    reqs = workload.requests
    firsts = [r for r in reqs if r.follows is None]
    follows = [r for r in reqs if r.follows is not None]
    starts = sorted(r.delay_s for r in firsts)
    gaps = np.diff(starts) if len(starts) > 1 else np.zeros(0)
    ctx = context_lengths(reqs)
    sent_prompt = [c - r.output_len for c, r in zip(ctx, reqs)]
    return {
        "requests": len(reqs),
        "first_turns": len(firsts),
        "follow_ups": len(follows),
        "sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "new_prompt_tokens": _stats([len(r.prompt_token_ids) for r in reqs]),
        "first_turn_prompt_tokens": _stats([len(r.prompt_token_ids) for r in firsts]),
        "sent_prompt_tokens": _stats(sent_prompt),
        "output_tokens": _stats([r.output_len for r in reqs]),
        "max_context_tokens": max(ctx) if ctx else 0,
        "arrival_span_s": float(starts[-1] - starts[0]) if starts else 0.0,
        "mean_interarrival_s": float(gaps.mean()) if gaps.size else None,
        "interarrival_cv": (float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0
                            else None),
        "think_time_s": _stats([r.delay_s for r in follows]),
        "shared_prefix_groups": dict(sorted(Counter(
            r.shared_prefix_group for r in reqs if r.shared_prefix_group is not None).items())),
        "tenants": dict(sorted(Counter(r.user for r in reqs if r.user is not None).items())),
        "priorities": dict(sorted(Counter(r.priority for r in reqs).items())),
    }
