"""The step-time profile: the JSON file ``corellm bench calibrate`` writes and ``sim`` reads.

A profile holds one cost model (``cost_model_from_json`` reads either kind back), the model,
dtype and device it was made for (``check_compatible`` refuses it for another), and, when it
was measured, the samples it was fitted to.
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

from .costmodel import STEP_FIELDS, CostModel, FittedCostModel, StepShape
from .model_shape import dtype_key
from .roofline import RooflineCostModel

PROFILE_FORMAT = "corellm-step-profile"
PROFILE_VERSION = 1
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
    raise ValueError(f"type: unknown cost model {kind!r} (known: 'fitted', 'roofline')")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class Profile:
    """A step-time profile: the cost model of one model on one device and dtype, and the
    context it was measured in. ``corellm bench calibrate`` writes it (``kind="measured"``, a
    ``FittedCostModel`` and the samples it was fitted to), or it is made from a ``DeviceSpec``
    (``kind="roofline"``); the ``sim`` executor reads it."""

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

    # ---- JSON
    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version, "kind": self.kind,
                "model": self.model, "dtype": self.dtype, "device": self.device,
                "corellm_version": self.corellm_version, "created": self.created,
                "block_size": self.block_size, "kv_bytes_per_block": self.kv_bytes_per_block,
                "engine": self.engine, "cost_model": self.cost_model.to_json(),
                "notes": list(self.notes), "samples": self.samples}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as indented JSON, one sample per line."""
        d = self.to_json()
        samples = d.pop("samples")
        text = json.dumps(d, indent=2)
        if samples is not None:
            rows = ",\n    ".join(json.dumps(r) for r in samples)
            body = f"[\n    {rows}\n  ]" if samples else "[]"
            text = text[:-2] + f',\n  "samples": {body}\n}}'
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
        if d.get("version") != PROFILE_VERSION:
            raise fail(f"key 'version' is {d.get('version')!r}; this corellm reads version "
                       f"{PROFILE_VERSION}")
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
        cm = need("cost_model", dict, "an object")
        cost_model = None
        if cm is not None:
            try:
                cost_model = cost_model_from_json(cm)
            except ValueError as e:
                key, sep, rest = str(e).partition(": ")
                problems.append(f"key 'cost_model.{key}': {rest}" if sep and " " not in key
                                else f"key 'cost_model': {e}")
        if problems:
            raise ConfigError([(_PROFILE_KEY, f"{source}: {p}") for p in problems])
        return cls(kind=kind, model=model, dtype=dtype, device=device, block_size=block_size,
                   kv_bytes_per_block=kvb, cost_model=cost_model, engine=engine or {},
                   samples=samples, notes=notes or [],
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
