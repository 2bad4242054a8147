"""The step-time profile: the JSON file ``corellm bench calibrate`` writes and ``sim`` reads.

A profile holds one cost model (``cost_model_from_json`` reads either kind back), the model,
dtype and device it was made for (``check_compatible`` refuses it for another), and, when it
was measured, the samples it was fitted to.

Version 2 adds the host/device split of a measured step (``costmodel``'s module docstring):
``host_model`` (a ``HostCostModel`` fitted to each step's measured time less its
``device_phases``), and per sample the engine's phase times (``sample_phases``, columns
``phases``), so the split can be re-fitted another way without measuring again. Version 1 files
still load: a measured one has no host model, so its host part is 0 (overlapped steps are
priced as synchronous ones: re-calibrate); a roofline's host part is its overhead terms
whatever the version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar

from corellm import __version__
from corellm.errors import ConfigError

from .costmodel import (DEVICE_PHASES, PHASES, STEP_FIELDS, CostModel, FittedCostModel,
                        HostCostModel, OverlappedCostModel, StepShape)
from .model_shape import dtype_key
from .roofline import RooflineCostModel

PROFILE_FORMAT = "corellm-step-profile"
PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)            # version 1: no host/device split
_PROFILE_KEY = "executor.profile"     # the config key ConfigErrors about a profile are filed under


def cost_model_from_json(d: Mapping[str, Any]) -> CostModel:
    """Rebuild a cost model from its ``to_json()`` dict, dispatching on ``d["type"]``. Raises
    ``ValueError("<key>: <problem>")`` naming the offending key."""
    if not isinstance(d, Mapping):
        raise ValueError(f"must be an object, got {type(d).__name__}")
    kind = d.get("type")
    if kind == FittedCostModel.type:
        return FittedCostModel.from_json(d)
    if kind == RooflineCostModel.type:
        return RooflineCostModel.from_json(d)
    if kind == HostCostModel.type:
        return HostCostModel.from_json(d)
    if kind == OverlappedCostModel.type:
        step, host = d.get("step"), d.get("host")
        return OverlappedCostModel(cost_model_from_json(step),
                                   None if host is None else cost_model_from_json(host))
    raise ValueError(f"type: unknown cost model {kind!r} (known: 'fitted', 'roofline', "
                     "'host-linear', 'overlapped')")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Profile:
    """A step-time profile: the cost model of one model on one device and dtype, and the
    context it was measured in. ``corellm bench calibrate`` writes it (``kind="measured"``, a
    ``FittedCostModel`` and the samples it was fitted to), or it is made from a ``DeviceSpec``
    (``kind="roofline"``); the ``sim`` executor reads it. ``cost_model`` prices a whole
    synchronous step; ``host_model`` (measured profiles, version 2) its host part, which
    overlapped steps hide (``overlapped_cost_model``)."""

    kind: str                          # "measured" | "roofline"
    model: dict[str, Any]              # name, architecture, fingerprint (ModelShape.fingerprint)
    dtype: str                         # e.g. "float32"
    device: dict[str, Any]             # kind ("cpu", "cuda"), name ("AMD EPYC (2 cores, avx2)")
    block_size: int
    kv_bytes_per_block: int            # the real engine's: the simulated pool gets as many blocks
    cost_model: CostModel
    engine: dict[str, Any] = field(default_factory=dict)   # max_num_batched_tokens, backend...
    samples: list[list[float]] | None = None   # rows: STEP_FIELDS..., seconds
    notes: list[str] = field(default_factory=list)
    host_model: CostModel | None = None    # the host part of a step (None: version 1, roofline)
    device_phases: list[str] = field(default_factory=lambda: list(DEVICE_PHASES))
    phases: list[str] = field(default_factory=lambda: list(PHASES))   # sample_phases' columns
    sample_phases: list[list[float]] | None = None    # per sample: seconds in each phase
    corellm_version: str = __version__
    created: str = field(default_factory=_now)
    format: str = PROFILE_FORMAT
    version: int = PROFILE_VERSION
    source: str | None = field(default=None, compare=False)   # the file it was loaded from

    KINDS: ClassVar[tuple[str, ...]] = ("measured", "roofline")

    # ---- samples
    @staticmethod
    def make_samples(shapes: Sequence[StepShape], seconds: Sequence[float]) -> list[list[float]]:
        return [[*s.to_row(), float(t)] for s, t in zip(shapes, seconds, strict=True)]

    def sample_data(self) -> tuple[list[StepShape], list[float]]:
        """The stored samples as shapes and seconds, e.g. to re-fit with other knots."""
        rows = self.samples or []
        return [StepShape.from_row(r[:-1]) for r in rows], [float(r[-1]) for r in rows]

    @staticmethod
    def make_phase_rows(timings: Sequence[Mapping[str, float]],
                        phases: Sequence[str] = PHASES) -> list[list[float]]:
        """One row per step: its seconds in each of ``phases`` (0 for a phase it lacks)."""
        return [[float(t.get(p, 0.0)) for p in phases] for t in timings]

    @staticmethod
    def host_seconds(seconds: Sequence[float], phase_rows: Sequence[Sequence[float]],
                     phases: Sequence[str] = PHASES,
                     device_phases: Sequence[str] = DEVICE_PHASES) -> list[float]:
        """Each step's host time: its measured time less its device phases (at least 1 ns:
        a timer's rounding never makes it 0 or less)."""
        cols = [list(phases).index(p) for p in device_phases if p in phases]
        return [max(float(t) - sum(row[i] for i in cols), 1e-9)
                for t, row in zip(seconds, phase_rows, strict=True)]

    def host_data(self) -> tuple[list[StepShape], list[float]]:
        """The stored samples as shapes and host seconds (empty without ``sample_phases``),
        e.g. to re-fit the host model with other ``device_phases``."""
        if not self.sample_phases:
            return [], []
        shapes, seconds = self.sample_data()
        return shapes, self.host_seconds(seconds, self.sample_phases, self.phases,
                                         self.device_phases)

    @property
    def has_host_split(self) -> bool:
        """Whether the profile knows a step's host part: a host model (measured, version 2),
        or a step model that prices it itself (a roofline's overhead terms)."""
        return self.host_model is not None or \
            type(self.cost_model).predict_host is not CostModel.predict_host

    def overlapped_cost_model(self) -> OverlappedCostModel:
        """The step model of overlapped steps: ``max(host, device)`` of each step."""
        return OverlappedCostModel(self.cost_model, self.host_model)

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version, "kind": self.kind,
                "model": self.model, "dtype": self.dtype, "device": self.device,
                "corellm_version": self.corellm_version, "created": self.created,
                "block_size": self.block_size, "kv_bytes_per_block": self.kv_bytes_per_block,
                "engine": self.engine, "cost_model": self.cost_model.to_json(),
                "host_model": None if self.host_model is None else self.host_model.to_json(),
                "device_phases": list(self.device_phases), "phases": list(self.phases),
                "notes": list(self.notes), "samples": self.samples,
                "sample_phases": self.sample_phases}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as indented JSON, one sample (and one row of its phases) per
        line."""
        d = self.to_json()
        tables = {k: d.pop(k) for k in ("samples", "sample_phases")}
        text = json.dumps(d, indent=2)
        for key, table in tables.items():
            if table is not None:
                rows = ",\n    ".join(json.dumps(r) for r in table)
                body = f"[\n    {rows}\n  ]" if table else "[]"
                text = text[:-2] + f',\n  "{key}": {body}\n}}'
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")

    @classmethod
    def from_json(cls, d: Any, source: str = "<profile>") -> Profile:
        """Validate and build; every problem raises ``ConfigError`` under ``executor.profile``
        with a message naming ``source`` and the bad key."""
        def fail(msg: str) -> ConfigError:
            return ConfigError([(_PROFILE_KEY, f"{source}: {msg}")])

        if not isinstance(d, dict):
            raise fail(f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") != PROFILE_FORMAT:
            raise fail(f"key 'format' is {d.get('format')!r}, expected {PROFILE_FORMAT!r} "
                       "(not a corellm step profile)")
        version = d.get("version")
        if isinstance(version, bool) or version not in READABLE_VERSIONS:
            raise fail(f"key 'version' is {version!r}; this corellm reads versions "
                       f"{', '.join(map(str, READABLE_VERSIONS))}")
        problems: list[str] = []

        def need(key: str, types: type | tuple[type, ...], what: str,
                 optional: bool = False) -> Any:
            if key not in d:
                if not optional:
                    problems.append(f"missing key {key!r}")
                return None
            v = d[key]
            if (optional and v is None) or (isinstance(v, types) and not isinstance(v, bool)):
                return v
            problems.append(f"key {key!r} must be {what}, got {v!r}")
            return None

        kind = need("kind", str, "a string")
        if kind is not None and kind not in cls.KINDS:
            problems.append(f"key 'kind' must be one of {', '.join(cls.KINDS)}, got {kind!r}")
        model = need("model", dict, "an object")
        if model is not None:
            if not isinstance(model.get("name"), str):
                problems.append(f"key 'model.name' must be a string, got {model.get('name')!r}")
            if not isinstance(model.get("fingerprint"), dict):
                problems.append("key 'model.fingerprint' must be an object, got "
                                f"{model.get('fingerprint')!r}")
        dtype = need("dtype", str, "a string")
        device = need("device", dict, "an object")
        if device is not None and not isinstance(device.get("kind"), str):
            problems.append(f"key 'device.kind' must be a string, got {device.get('kind')!r}")
        block_size = need("block_size", int, "a positive integer")
        kvb = need("kv_bytes_per_block", int, "a positive integer")
        for key, v in (("block_size", block_size), ("kv_bytes_per_block", kvb)):
            if v is not None and v <= 0:
                problems.append(f"key {key!r} must be a positive integer, got {v!r}")
        engine = need("engine", dict, "an object", optional=True)
        notes = need("notes", list, "a list of strings", optional=True)
        if notes is not None and not all(isinstance(n, str) for n in notes):
            problems.append(f"key 'notes' must be a list of strings, got {notes!r}")
        version_s = need("corellm_version", str, "a string", optional=True)
        created = need("created", str, "a string", optional=True)
        samples = need("samples", list, "a list of rows", optional=True)
        if samples is not None:
            width = len(STEP_FIELDS) + 1
            for i, r in enumerate(samples):
                if not (isinstance(r, list) and len(r) == width and all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)):
                    problems.append(f"key 'samples[{i}]' must be {width} numbers "
                                    f"({', '.join(STEP_FIELDS)}, seconds), got {r!r}")
                    break
        def names(key: str, default: tuple[str, ...]) -> list[str]:
            v = need(key, list, "a list of strings", optional=True)
            if v is not None and not all(isinstance(n, str) for n in v):
                problems.append(f"key {key!r} must be a list of strings, got {v!r}")
                v = None
            return list(default) if v is None else v

        device_phases = names("device_phases", DEVICE_PHASES)
        phases = names("phases", PHASES)
        sample_phases = need("sample_phases", list, "a list of rows", optional=True)
        if sample_phases is not None:
            for i, r in enumerate(sample_phases):
                if not (isinstance(r, list) and len(r) == len(phases) and all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)):
                    problems.append(f"key 'sample_phases[{i}]' must be {len(phases)} numbers "
                                    f"({', '.join(phases)}), got {r!r}")
                    break
            if samples is not None and len(sample_phases) != len(samples):
                problems.append(f"key 'sample_phases' has {len(sample_phases)} rows but "
                                f"'samples' {len(samples)}")

        def model_at(key: str, optional: bool = False) -> CostModel | None:
            cm = need(key, dict, "an object", optional=optional)
            if cm is None:
                return None
            try:
                return cost_model_from_json(cm)
            except ValueError as e:
                k, sep, rest = str(e).partition(": ")
                problems.append(f"key '{key}.{k}': {rest}" if sep and " " not in k
                                else f"key '{key}': {e}")
                return None

        cost_model = model_at("cost_model")
        host_model = model_at("host_model", optional=True)
        if problems:
            raise ConfigError([(_PROFILE_KEY, f"{source}: {p}") for p in problems])
        return cls(kind=kind, model=model, dtype=dtype, device=device, block_size=block_size,
                   kv_bytes_per_block=kvb, cost_model=cost_model, engine=engine or {},
                   samples=samples, notes=notes or [], host_model=host_model,
                   device_phases=device_phases, phases=phases, sample_phases=sample_phases,
                   corellm_version=version_s or "unknown", created=created or "unknown",
                   source=source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read and validate a profile file; a missing or malformed file raises ``ConfigError``
        under ``executor.profile`` naming the file (and the bad key)."""
        p = os.fspath(path)
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError([(_PROFILE_KEY, f"{p}: no such file")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([(_PROFILE_KEY, f"{p}: cannot read: {e}")]) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError([(_PROFILE_KEY, f"{p}: not valid JSON: {e.msg} at line "
                                f"{e.lineno} column {e.colno}")]) from None
        return cls.from_json(d, source=p)

    # ---- compatibility
    def check_compatible(self, model_name: str, fingerprint: Mapping[str, Any] | None,
                         dtype: str | None, device_kind: str | None) -> None:
        """Refuse (``ConfigError`` under ``executor.profile``, one problem per mismatch) a
        profile made for another model (its fingerprint differs: names both models and the
        first differing field), another dtype, or another device kind. ``None`` skips a check;
        ``device_kind`` "auto" accepts any device, and "cuda:1" is compared as "cuda"."""
        where = f"{self.source}: " if self.source else ""
        theirs = self.model.get("name", "?")
        problems: list[str] = []
        if fingerprint is not None:
            fp = self.model.get("fingerprint", {})
            for k in [*fp, *(k for k in fingerprint if k not in fp)]:
                a, b = fp.get(k, "<absent>"), fingerprint.get(k, "<absent>")
                if a != b:
                    problems.append(f"{where}profile is for model {theirs} but the engine runs "
                                    f"{model_name}: {k} is {a} in the profile, {b} in the model")
                    break
        if dtype is not None and dtype_key(self.dtype) != dtype_key(dtype):
            problems.append(f"{where}profile is for dtype {self.dtype} but model.dtype is "
                            f"{dtype}")
        if device_kind not in (None, "auto"):
            want = str(device_kind).split(":")[0]
            have = str(self.device.get("kind", "?"))
            if have != want:
                problems.append(f"{where}profile is for {have} ({self.device.get('name', '?')}"
                                f", {self.kind}) but the engine runs on {device_kind}")
        if problems:
            raise ConfigError([(_PROFILE_KEY, p) for p in problems])
