"""The distributions a workload spec draws from: token lengths, durations and arrivals.

Each distribution is a pydantic model of the workload file (``{dist: uniform, low: 64, high:
256}``) with ``sample(rng, n)``, which draws ``n`` values from a seeded numpy generator, and
``short()``, its few words in a workload's one-line description. Lengths (``LenDist``: fixed,
uniform, normal, file, mixture) are integers of tokens; durations (``TimeDist``: fixed, uniform,
normal, exponential) are seconds, e.g. think time; arrival patterns (``Arrivals``: all at once,
Poisson, gamma) become send times through ``arrival_times``.

Also here, because every model of the spec builds on them: ``SpecModel`` (the base that forbids
unknown keys) and ``SpecProblem`` (what a validator raises to name the key at fault); the rest
of the spec is in ``workload_spec``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationInfo,
                      model_validator)


# ----------------------------------------------------------------------------- spec models
class SpecProblem(ValueError):
    """Raised inside validators: a message for a key below the model being validated (``key``
    relative to it, "" for the model itself). ``workload_spec``'s error formatter joins it to
    the model's path."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


def spec_base_dir(info: ValidationInfo) -> Path:
    ctx = info.context or {}
    return Path(ctx.get("base_dir") or ".")


class SpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _no_bool(value: Any) -> Any:
    # YAML reads `yes`/`no` as booleans, and bool is an int subclass: refuse them as numbers.
    if isinstance(value, bool):
        raise SpecProblem("", f"expected a number, got {value!r}")
    return value


# ----------------------------------------------------------------------------- token lengths
class FixedLen(SpecModel):
    dist: Literal["fixed"] = Field(description="Every draw is `value`.")
    value: int = Field(ge=1, description="The length, in tokens.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)

    def short(self) -> str:
        return str(self.value)


class UniformLen(SpecModel):
    dist: Literal["uniform"] = Field(description="Integers uniform in [low, high], inclusive.")
    low: int = Field(ge=1, description="Smallest length, in tokens.")
    high: int = Field(ge=1, description="Largest length, in tokens (inclusive).")

    @model_validator(mode="after")
    def _ordered(self) -> UniformLen:
        if self.low > self.high:
            raise SpecProblem("high", f"must be >= low ({self.low}), got {self.high}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)

    def short(self) -> str:
        return f"{self.low}-{self.high}"


class NormalLen(SpecModel):
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
            raise SpecProblem("max", f"must be >= min ({self.min}), got {self.max}")
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
            raise SpecProblem("path", f"{path}: not valid JSON: {exc}") from None
    else:
        values = []
        for lineno, line in enumerate(text.splitlines(), 1):
            for token in line.split("#", 1)[0].replace(",", " ").split():
                try:
                    values.append(int(token))
                except ValueError:
                    raise SpecProblem("path", f"{path}:{lineno}: expected integer lengths, got "
                                           f"{token!r}") from None
    if not isinstance(values, list) or not values:
        raise SpecProblem("path", f"{path}: expected a non-empty list of lengths")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise SpecProblem("path", f"{path}: lengths must be integers >= 1, got {bad[0]!r}")
    return values


class FileLen(SpecModel):
    dist: Literal["file"] = Field(
        description="Draws (with replacement, uniformly) from the lengths listed in a file: a "
                    "JSON array of integers, or integers separated by whitespace/commas.")
    path: str = Field(description="The file; a relative path is relative to the workload file.")
    _values: list[int] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> FileLen:
        path = spec_base_dir(info) / Path(self.path).expanduser()
        try:
            self._values = _read_lengths(path)
        except OSError as exc:
            raise SpecProblem("path", f"cannot read {path}: {exc.strerror or exc}") from None
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self._values, dtype=np.int64), size=n)

    def short(self) -> str:
        return f"from {Path(self.path).name}"


class Weighted(SpecModel):
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False,
                          description="Relative weight of this component (normalized).")


class FixedComponent(FixedLen, Weighted):
    pass


class UniformComponent(UniformLen, Weighted):
    pass


class NormalComponent(NormalLen, Weighted):
    pass


class FileComponent(FileLen, Weighted):
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


def assign_classes(weights: Sequence[float], n: int, rng: np.random.Generator) -> np.ndarray:
    """Which of ``len(weights)`` classes each of ``n`` items gets: exactly the apportioned
    counts, in a seeded random order. Exact rather than i.i.d. so that a 20% class of 40
    requests is 8 requests under every seed; with i.i.d. draws the class sizes themselves would
    vary between repeats and blur an A/B comparison of small workloads."""
    labels = np.repeat(np.arange(len(weights)), _apportion(weights, n))
    return rng.permutation(labels)


class MixtureLen(SpecModel):
    dist: Literal["mixture"] = Field(
        description="A weighted mix of the other distributions (e.g. bimodal short/long): each "
                    "component gets its share of the draws exactly, in a seeded random order.")
    components: list[Component] = Field(
        min_length=1, description="The components: each a distribution with a `weight`.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        which = assign_classes([c.weight for c in self.components], n, rng)
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
class FixedTime(SpecModel):
    dist: Literal["fixed"] = Field(description="Every draw is `value`.")
    value: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.float64)

    def short(self) -> str:
        return f"{self.value:g}s"


class UniformTime(SpecModel):
    dist: Literal["uniform"] = Field(description="Uniform in [low, high] seconds.")
    low: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    high: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")

    @model_validator(mode="after")
    def _ordered(self) -> UniformTime:
        if self.low > self.high:
            raise SpecProblem("high", f"must be >= low ({self.low:g}), got {self.high:g}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.low, self.high, size=n)

    def short(self) -> str:
        return f"{self.low:g}-{self.high:g}s"


class NormalTime(SpecModel):
    dist: Literal["normal"] = Field(description="Normal(mean, std) seconds, clipped to [min, max].")
    mean: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    std: float = Field(ge=0, allow_inf_nan=False, description="Seconds.")
    min: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="Lower clip, seconds.")
    max: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                              description="Upper clip, seconds (default: none).")

    @model_validator(mode="after")
    def _ordered(self) -> NormalTime:
        if self.max is not None and self.max < self.min:
            raise SpecProblem("max", f"must be >= min ({self.min:g}), got {self.max:g}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.normal(self.mean, self.std, size=n), self.min, self.max)

    def short(self) -> str:
        return f"normal({self.mean:g}s, {self.std:g}s)"


class ExponentialTime(SpecModel):
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


# ----------------------------------------------------------------------------- arrivals
class AllAtOnce(SpecModel):
    pattern: Literal["all_at_once"] = Field(
        description="Every first turn is due at t=0: a backlog (vLLM's --request-rate inf).")

    def short(self) -> str:
        return "all at once"


class PoissonArrivals(SpecModel):
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


class GammaArrivals(SpecModel):
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


def vllm_arrivals(request_rate: float, burstiness: float) -> dict[str, Any]:
    """The arrivals of ``vllm bench serve``'s ``--request-rate`` and ``--burstiness``, as a
    spec's ``arrivals`` section: all at once for an infinite rate, Poisson for burstiness 1,
    else gamma inter-arrival times."""
    if math.isinf(request_rate):
        return {"pattern": "all_at_once"}
    if burstiness == 1.0:
        return {"pattern": "poisson", "rate": request_rate}
    return {"pattern": "gamma", "rate": request_rate, "burstiness": burstiness}


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
