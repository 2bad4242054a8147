"""The workload spec: the pydantic models of a workload file, reading one, and its errors.

``load_workload_spec`` reads a YAML or JSON file (or a mapping) into a ``WorkloadSpec``; every
model forbids unknown keys, and every problem is reported as a ``WorkloadError`` naming the key
path at fault (``requests.input_len.dist``) with a did-you-mean. The distributions the spec's
lengths, think times and arrivals draw from are in ``distributions``; ``describe_spec`` is the
spec in one line for tables and plot titles.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BeforeValidator, Field, PrivateAttr, ValidationError, ValidationInfo,
                      model_validator)

from corellm.config import did_you_mean
from corellm.errors import ProblemsError

from .distributions import (LEN_DISTS, TIME_DISTS, AllAtOnce, Arrivals, ExponentialTime, FileLen,
                            FixedLen, FixedTime, GammaArrivals, LenDist, MixtureLen, NormalLen,
                            NormalTime, PoissonArrivals, SpecModel, SpecProblem, TimeDist,
                            UniformLen, UniformTime, Weighted, spec_base_dir)


class WorkloadError(ProblemsError):
    """A workload spec is invalid, or cannot be built (``problems``: ``(key_path, message)``
    pairs, e.g. ``("requests.input_len.dist", "unknown dist 'unifrom'; did you mean
    uniform?")``)."""

    what = "workload"


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class _PromptLine:
    ids: list[int] | None
    text: str | None
    output_len: int | None
    lineno: int


def json_objects(lines: Iterable[str], name: str) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, ``name:lineno`` for messages, object) for each non-blank line of a JSONL
    file; ``ValueError`` naming the line when one is not a JSON object."""
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: not a JSON object") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        yield lineno, where, obj


def _read_prompts(path: Path) -> list[_PromptLine]:
    try:
        with path.open() as handle:
            return _prompt_lines(path, handle)
    except OSError as exc:
        raise SpecProblem("path", f"cannot read {path}: {exc.strerror or exc}") from None
    except SpecProblem:
        raise
    except ValueError as exc:           # a line that is not a JSON object
        raise SpecProblem("path", str(exc)) from None


def _prompt_lines(path: Path, handle: Iterable[str]) -> list[_PromptLine]:
    lines = []
    for lineno, where, obj in json_objects(handle, path.name):
        ids, text = obj.get("prompt_token_ids"), obj.get("prompt")
        if (ids is None) == (text is None):
            raise SpecProblem("path", f"{where}: expected exactly one of \"prompt_token_ids\" "
                                   "(a list of ints) and \"prompt\" (text)")
        if ids is not None and (not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)):
            raise SpecProblem("path", f"{where}: \"prompt_token_ids\" must be a non-empty list "
                                   "of token ids >= 0")
        if text is not None and (not isinstance(text, str) or not text):
            raise SpecProblem("path", f"{where}: \"prompt\" must be a non-empty string")
        out = obj.get("output_len", obj.get("max_tokens"))
        if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 1):
            raise SpecProblem("path", f"{where}: \"output_len\" must be an integer >= 1")
        extra = set(obj) - {"prompt_token_ids", "prompt", "output_len", "max_tokens"}
        if extra:
            raise SpecProblem("path", f"{where}: unknown key(s) {', '.join(sorted(extra))}")
        lines.append(_PromptLine(ids, text, out, lineno))
    if not lines:
        raise SpecProblem("path", f"{path}: no prompts")
    return lines


class RandomPrompts(SpecModel):
    source: Literal["random"] = Field(
        description="Random token ids, uniform over the model's vocabulary minus special "
                    "tokens; lengths from `input_len` (first turns) and `sessions.message_len` "
                    "(follow-ups).")


class FilePrompts(SpecModel):
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
        self._lines = _read_prompts(spec_base_dir(info) / Path(self.path).expanduser())
        return self

    @property
    def needs_tokenizer(self) -> bool:
        return any(line.text is not None for line in self._lines)


def _name_is_source(value: Any) -> Any:
    """``prompts: random`` is shorthand for ``prompts: {source: random}``."""
    return {"source": value} if isinstance(value, str) else value


PromptSource = Annotated[Union[RandomPrompts, FilePrompts], Field(discriminator="source"),
                         BeforeValidator(_name_is_source)]


# ----------------------------------------------------------------------------- the workload
class SharedPrefix(SpecModel):
    num_groups: int = Field(ge=1, description="How many distinct prefixes (e.g. system prompts).")
    length: int = Field(ge=1, description="Tokens in each prefix.")


class RequestsSpec(SpecModel):
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
            raise SpecProblem("input_len", "required with random prompts")
        if isinstance(self.prompts, FilePrompts) and self.input_len is not None:
            raise SpecProblem("input_len", "not used with prompts from a file (each has its own "
                                        "length); remove it")
        return self


class SessionsSpec(SpecModel):
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


class Tenant(SpecModel):
    name: str = Field(min_length=1, description="Sent as the request's `user`.")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of the requests (sessions).")


class PriorityShare(SpecModel):
    priority: int = Field(description="The request's priority; lower runs first (vLLM's "
                                      "convention).")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of the requests (sessions).")


class AdapterShare(SpecModel):
    name: str | None = Field(description="The LoRA adapter's name: the request's `model` at a "
                                         "server; null: the base model.")
    path: str | None = Field(default=None, description="Its PEFT directory, which an "
                                                       "in-process engine loads it from.")
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative share of the requests (sessions).")


class WorkloadSpec(SpecModel):
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
    lora_adapters: list[AdapterShare] | None = Field(
        default=None, min_length=1,
        description="LoRA adapters and their shares of the requests (whole sessions), each "
                    "request run with its adapter (the configs need lora.enable); default: "
                    "the base model for all.")
    arrivals: Arrivals = Field(
        default_factory=lambda: AllAtOnce(pattern="all_at_once"),
        description="When first turns arrive: all_at_once, poisson (rate) or gamma (rate, "
                    "burstiness). Follow-up turns come think_time_s after the previous one.")

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadSpec:
        if self.sessions is None and self.num_requests is None:
            raise SpecProblem("num_requests", "required (or give `sessions`)")
        if self.sessions is not None and self.num_requests is not None:
            raise SpecProblem("num_requests", "not allowed with `sessions` (the requests are the "
                                           "sessions' turns); remove it")
        if self.tenants and len({t.name for t in self.tenants}) < len(self.tenants):
            raise SpecProblem("tenants", "names must be unique")
        if self.priorities and (len({p.priority for p in self.priorities})
                                < len(self.priorities)):
            raise SpecProblem("priorities", "each priority may appear once")
        if self.lora_adapters and (len({a.name for a in self.lora_adapters})
                                   < len(self.lora_adapters)):
            raise SpecProblem("lora_adapters", "names must be unique")
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
    models = [FixedLen, UniformLen, NormalLen, FileLen, MixtureLen, Weighted, FixedTime,
              UniformTime, NormalTime, ExponentialTime, RandomPrompts, FilePrompts,
              SharedPrefix, RequestsSpec, SessionsSpec, Tenant, PriorityShare, AdapterShare,
              AllAtOnce, PoissonArrivals, GammaArrivals, WorkloadSpec]
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
        if isinstance(cause, SpecProblem):
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


# ----------------------------------------------------------------------------- in one line
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
    if spec.lora_adapters:
        parts.append("adapters " + _shares([(a.name or "base", a.weight)
                                            for a in spec.lora_adapters]))
    parts.append(f"seed {spec.seed if seed is None else seed}")
    line = ", ".join(parts)
    return f"{spec.name}: {line}" if spec.name else line
