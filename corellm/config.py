"""One pydantic configuration, composed from the core's sections and the selected plugins' options.

Every section but ``model`` and ``plugins`` is ``{name: <plugin>, ...that plugin's options}``,
flat; the options are validated by the selected plugin's options model (``extra="forbid"``), so
``config.scheduler`` *is* the plugin's typed options object. Errors name the key path and, for a
misspelling, the likely intended key.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import tomllib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from corellm.components import (SECTION_SPECS, AttentionOptions, ComponentOptions, DType,
                                ExecutorOptions, FrontendOptions, KVCacheOptions, PlatformOptions,
                                SamplerOptions, SchedulerOptions, delegate_fields)
from corellm.errors import ConfigDeprecationWarning, ConfigError, PluginError

if TYPE_CHECKING:
    from corellm.plugins import Registry

logger = logging.getLogger(__name__)

# Keys of the model section that moved to the platform section: old key -> new option (None:
# the platform's name). They keep working for one release, with a ConfigDeprecationWarning.
DEPRECATED_MODEL_KEYS: dict[str, str | None] = {
    "device": None, "cpu_weight_packing": "weight_packing", "cpu_fused_ops": "fused_ops"}


class ModelConfig(BaseModel):
    """The ``model`` section (owned by the core: the model plugin is chosen by the checkpoint)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = Field(
        None, description="Hugging Face checkpoint directory (config.json + safetensors). "
                          "Absent: the built-in demo model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: model.path.")
    dtype: DType = Field("auto", description="Weights and activations dtype; auto = the "
                                             "checkpoint's, float32 for float16 on CPU.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + output; default: the checkpoint's "
                                "max_position_embeddings.")
    seed: int = Field(0, description="Seed of the random stream of unseeded sampling.")
    implementation: str | None = Field(
        None, description="The model implementation to run: a model (ModelSpec) name from "
                          "`corellm plugins`, qualified as distribution:name when two share "
                          "it. Absent: the one implementing the checkpoint's architecture (an "
                          "installed plugin over a built-in one).")

    @field_validator("path", "tokenizer")
    @classmethod
    def _expand_user(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)


class ParallelConfig(BaseModel):
    """The ``parallel`` section (owned by the core: the executor, the model factory and the
    sharded layers all read it, through the workers' ``corellm.distributed.ParallelContext``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the model is sharded across (attention heads, MLP, "
                             "vocabulary); needs an executor that runs that many workers.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend; auto = nccl on CUDA, gloo on CPU.")
    init_method: str = Field(
        "tcp://127.0.0.1:0",
        description="Rendezvous of the ranks: tcp://HOST:PORT (port 0 = a free one) for the "
                    "workers an executor spawns on this machine, or env:// for processes "
                    "started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), on one "
                    "machine or many.")
    timeout_s: float = Field(
        60.0, gt=0, description="A collective (or the rendezvous) waiting longer than this "
                                "fails the step instead of hanging.")

    @field_validator("init_method")
    @classmethod
    def _check_init_method(cls, value: str) -> str:
        if value != "env://" and not re.fullmatch(r"tcp://[^:/]+:\d+", value):
            raise ValueError("expected tcp://HOST:PORT or env://")
        return value

    @property
    def external_launcher(self) -> bool:
        """The ranks are processes some launcher (torchrun) started, not the executor."""
        return self.init_method == "env://"


class PluginsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    disable: list[str] = Field(default_factory=list,
                               description="Plugins not to load: entry-point names, or "
                                           "distribution:entry_point for one distribution's.")


class EngineConfig(BaseModel):
    """The whole engine configuration. Build it with ``load_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    # Resolved when the config is loaded: ``auto`` never survives load_config.
    platform: SerializeAsAny[PlatformOptions] = Field(default_factory=PlatformOptions)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scheduler: SerializeAsAny[SchedulerOptions] = Field(default_factory=SchedulerOptions)
    kv_cache: SerializeAsAny[KVCacheOptions] = Field(default_factory=KVCacheOptions)
    attention: SerializeAsAny[AttentionOptions] = Field(default_factory=AttentionOptions)
    executor: SerializeAsAny[ExecutorOptions] = Field(default_factory=ExecutorOptions)
    sampler: SerializeAsAny[SamplerOptions] = Field(default_factory=SamplerOptions)
    frontend: SerializeAsAny[FrontendOptions] | None = None
    plugins: PluginsConfig = Field(default_factory=PluginsConfig)

    def to_dict(self) -> dict[str, Any]:
        # serialize_as_any: a wrapper's delegate is declared as the section's base options but
        # holds the delegate's own options object, whose fields belong in the dump.
        return self.model_dump(mode="json", exclude_none=True, serialize_as_any=True)


PLUGIN_SECTIONS: dict[str, type[ComponentOptions]] = {
    "platform": PlatformOptions,
    "scheduler": SchedulerOptions, "kv_cache": KVCacheOptions, "attention": AttentionOptions,
    "executor": ExecutorOptions, "sampler": SamplerOptions, "frontend": FrontendOptions,
}
SECTIONS = ["model", "platform", "parallel", *(s for s in PLUGIN_SECTIONS if s != "platform"),
            "plugins"]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file into a dict, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError([("", f"config file {str(path)!r} does not exist")])
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError([("", f"cannot parse: {exc}")], source=str(path)) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([("", f"top level must be a mapping, got {type(data).__name__}")],
                          source=str(path))
    return data


def load_config(source: EngineConfig | Mapping[str, Any] | str | Path | None = None,
                registry: Registry | None = None) -> EngineConfig:
    """Validate a config given as an ``EngineConfig``, a mapping, or a YAML/TOML/JSON file path.

    Without a ``registry`` one is built from the installed plugins (honouring
    ``plugins.disable``). All problems are reported together in one ``ConfigError``.
    """
    if isinstance(source, EngineConfig):
        return source
    origin = None
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, (str, Path)):
        origin = str(source)
        data = read_config_file(source)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        raise TypeError(f"config must be an EngineConfig, a mapping or a path, not {type(source)}")

    problems: list[tuple[str, str]] = []
    for key in data:
        if key not in SECTIONS:
            problems.append((str(key), "unknown section" + did_you_mean(str(key), SECTIONS)))

    data = _move_deprecated_model_keys(data, problems)
    values: dict[str, Any] = {}
    values["model"] = _validate_model(ModelConfig, data.get("model"), "model", problems)
    values["plugins"] = _validate_model(PluginsConfig, data.get("plugins"), "plugins", problems)
    data = _move_tp_shorthand(data, problems)
    values["parallel"] = _validate_model(ParallelConfig, data.get("parallel"), "parallel",
                                         problems)
    if values["plugins"] is None:
        raise ConfigError(problems, source=origin)
    if registry is None:
        from corellm.plugins import load_registry
        registry = load_registry(disable=values["plugins"].disable)

    for section, base in PLUGIN_SECTIONS.items():
        raw = data.get(section)
        if raw is None and section == "frontend":
            continue
        values[section] = _validate_section(section, section, raw, registry, values, problems)
    if problems:
        raise ConfigError(problems, source=origin)
    return EngineConfig(**{k: v for k, v in values.items() if v is not None})


def _validate_section(section: str, path: str, raw: Any, registry: Registry,
                      values: dict[str, Any], problems: list[tuple[str, str]],
                      shared: Mapping[str, Any] | None = None,
                      default: str | None = None) -> Any:
    """Validate one plugin section (or a wrapper's ``delegate`` sub-section at ``path``): the
    component its ``name`` selects validates the rest with its own options model. A delegate
    sub-section is validated the same way, first, and inherits the section's ``shared`` keys
    (those of the section's base options) from the wrapper."""
    base = PLUGIN_SECTIONS[section]
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        problems.append((path, f"expected a mapping, got {type(raw).__name__}"))
        return None
    raw = dict(raw)
    parallel = values.get("parallel")
    if default is None:
        default = base.model_fields["name"].default
        if (section == "executor" and parallel is not None
                and parallel.tensor_parallel_size > 1
                and "multiproc" in registry.choices("executor")):
            default = "multiproc"     # as vLLM picks its multiprocess executor for TP > 1
    name = raw.get("name", default)
    if not isinstance(name, str):
        problems.append((f"{path}.name", f"expected a plugin name, got {name!r}"))
        return None
    if shared:
        mine = _coerced(base, raw)
        for key, value in shared.items():
            if key in raw and mine.get(key, raw[key]) != value:
                problems.append((f"{path}.{key}", f"{raw[key]!r} differs from the wrapper's "
                                 f"{path.rsplit('.', 1)[0]}.{key}={value!r}: it is a setting "
                                 f"of the {section} section, which the wrapper and its "
                                 "delegate share (set it on the wrapper)"))
            raw[key] = value
    owner_note = ""
    if section == "platform":
        if name == "auto":    # its options are checked against the platform auto chose
            owner_note = "platform.name: auto chose it here; "
        name = _resolve_platform(name, raw, registry, problems)
        if name is None:
            return None
    raw["name"] = name
    if section == "kv_cache" and "block_size" not in raw:
        raw["block_size"] = _platform_block_size(values.get("platform"), registry, problems)
    if section == "attention" and name == "auto" and path != section:
        problems.append((f"{path}.name", "a wrapped attention backend is named, not auto"))
        return None
    if section == "attention" and name == "auto":     # resolved by each worker, per device
        return _validate_model(base, raw, path, problems,
                               owner="attention.name: auto (name a backend to set its options)")
    try:
        entry = registry.get(section, name)
    except PluginError as exc:
        problems.append((f"{path}.name", str(exc)))
        return None
    wrapped = delegate_fields(entry.spec.options)
    if wrapped:
        # The wrapper's own values of the section's shared keys, its defaults included: what
        # the delegate inherits.
        given = _coerced(base, raw)
        own = {k: given[k] if k in given
               else entry.spec.options.model_fields[k].get_default(call_default_factory=True)
               for k in base.model_fields if k != "name" and k not in wrapped}
        for key, (sub_section, sub_default) in wrapped.items():
            if sub_section != section:
                problems.append((f"{path}.{key}", f"{entry.describe()} declares a delegate of "
                                 f"section {sub_section!r}; a wrapper wraps its own kind"))
                return None
            inner = _validate_section(section, f"{path}.{key}", raw.get(key), registry, values,
                                      problems, shared=own, default=sub_default)
            if inner is None:
                return None
            raw[key] = inner
    options = _validate_model(entry.spec.options, raw, path, problems,
                              owner=owner_note + entry.plugin.describe())
    if section == "executor" and parallel is not None and options is not None:
        tp = parallel.tensor_parallel_size
        if tp > 1 and not runs_tensor_parallel(options, registry):
            problems.append(("parallel.tensor_parallel_size",
                             f"{tp} needs an executor that runs one worker per rank; "
                             f"executor {name!r} ({entry.plugin.describe()}) runs one "
                             "(set executor.name: multiproc)"))
    return options


def _coerced(base: type[ComponentOptions], raw: Mapping[str, Any]) -> dict[str, Any]:
    """The section's shared keys given in ``raw``, as the base options model reads them
    (``"8"`` is 8); keys that do not validate are left out (their own error comes later)."""
    out = {}
    for key in base.model_fields:
        if key != "name" and key in raw:
            try:
                out[key] = getattr(base.model_validate({key: raw[key]}), key)
            except ValidationError:
                pass
    return out


def runs_tensor_parallel(options: ComponentOptions, registry: Registry) -> bool:
    """Whether the executor ``options`` select runs one worker per tensor-parallel rank: its
    spec says so, or it is a wrapper whose delegate does."""
    entry = registry.get("executor", options.name)
    if getattr(entry.spec, "tensor_parallel", False):
        return True
    return any(runs_tensor_parallel(getattr(options, key), registry)
               for key in delegate_fields(type(options)))


def _platform_block_size(platform: PlatformOptions | None, registry: Registry,
                         problems: list[tuple[str, str]]) -> int:
    """The default ``kv_cache.block_size``: the platform's (16 when the platform section itself
    is invalid). A platform whose factory fails is a problem on ``platform.name`` naming its
    plugin."""
    if platform is None:
        return 16
    from corellm.platforms import build_platform
    try:
        return build_platform(platform, registry).default_block_size
    except (ConfigError, PluginError):
        raise
    except Exception as exc:
        owner = registry.get("platform", platform.name, usable=False).plugin.describe()
        problems.append(("platform.name", f"{platform.name!r} ({owner}) could not be built: "
                                          f"{exc!r}"))
        return 16


def _move_deprecated_model_keys(data: dict[str, Any],
                                problems: list[tuple[str, str]]) -> dict[str, Any]:
    """``model.device``, ``model.cpu_weight_packing`` and ``model.cpu_fused_ops`` (before the
    platform section) become ``platform.name``, ``platform.weight_packing`` and
    ``platform.fused_ops``, with a ConfigDeprecationWarning naming the new key; giving both
    spellings with different values is an error. The CPU options move only when the platform
    is (or resolves to) ``cpu``: elsewhere they never applied."""
    model = data.get("model")
    if not isinstance(model, Mapping) or not set(model) & set(DEPRECATED_MODEL_KEYS):
        return data
    model = dict(model)
    platform = data.get("platform")
    platform = dict(platform) if isinstance(platform, Mapping) else {}
    for old, new in DEPRECATED_MODEL_KEYS.items():
        if old not in model:
            continue
        value = model.pop(old)
        target = new or "name"
        warnings.warn(f"model.{old} is deprecated and will be removed in corellm 0.5; "
                      f"use platform.{target}", ConfigDeprecationWarning, stacklevel=4)
        if new is None and value == "auto":
            continue
        if target == "name" and platform.get("name") == "auto":
            platform.pop("name")                 # auto is the default the old key overrides
        if target in platform and platform[target] != value:
            problems.append((f"model.{old}", f"{value!r} contradicts platform.{target}="
                                             f"{platform[target]!r} (the same setting; give "
                                             f"platform.{target} alone)"))
            continue
        if new is None:
            platform[target] = value
        else:               # applied once the platform is resolved, if it takes them (cpu)
            platform.setdefault("_cpu_only", {})[target] = value
    return {**data, "model": model, "platform": platform}


def _resolve_platform(name: str, raw: dict[str, Any], registry: Registry,
                      problems: list[tuple[str, str]]) -> str | None:
    """The platform ``name`` stands for: itself when available here (else a problem with the
    reason), or for ``auto`` the available platform of the highest priority (the others' reasons
    logged). Options moved from the deprecated ``model.cpu_*`` keys join ``raw`` when the result
    is the CPU platform."""
    from corellm.platforms import choose_platform, platform_availability

    cpu_only = raw.pop("_cpu_only", {})
    if name == "auto":
        try:
            name, skipped = choose_platform(registry)
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None
        logger.info("platform.name: auto -> %s%s", name,
                    f" (not {'; not '.join(skipped)})" if skipped else "")
    else:
        try:
            entry = registry.get("platform", name, usable=False)
        except PluginError as exc:
            problems.append(("platform.name", str(exc)))
            return None
        reason = platform_availability(registry, name)
        if reason:
            problems.append(("platform.name", f"{name!r} ({entry.plugin.describe()}) is not "
                                              f"available here: {reason}"))
            return None
    if cpu_only:
        fields = registry.get("platform", name, usable=False).spec.options.model_fields
        if all(key in fields for key in cpu_only):        # the CPU platform's options
            for key, value in cpu_only.items():
                raw.setdefault(key, value)
        else:
            logger.warning("model.%s only ever applied on the CPU; platform %r has no such "
                           "option, so it is ignored",
                           ", model.".join(f"cpu_{k}" for k in cpu_only), name)
    return name


def _move_tp_shorthand(data: dict[str, Any], problems: list[tuple[str, str]]) -> dict[str, Any]:
    """``executor: {tensor_parallel_size: N}`` (vLLM's spelling, next to the executor that runs
    the ranks) is ``parallel: {tensor_parallel_size: N}``; both differing is an error."""
    executor = data.get("executor")
    if not isinstance(executor, Mapping) or "tensor_parallel_size" not in executor:
        return data
    executor = dict(executor)
    size = executor.pop("tensor_parallel_size")
    parallel = data.get("parallel")
    parallel = dict(parallel) if isinstance(parallel, Mapping) else {}
    if "tensor_parallel_size" in parallel and parallel["tensor_parallel_size"] != size:
        problems.append(("executor.tensor_parallel_size",
                         f"{size!r} contradicts parallel.tensor_parallel_size="
                         f"{parallel['tensor_parallel_size']!r} (they are one setting; give one)"))
    parallel.setdefault("tensor_parallel_size", size)
    return {**data, "executor": executor, "parallel": parallel}


def _validate_model(model: type[BaseModel], raw: Any, section: str,
                    problems: list[tuple[str, str]], owner: str | None = None) -> Any:
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        problems.append((section, f"expected a mapping, got {type(raw).__name__}"))
        return None
    try:
        return model.model_validate(dict(raw))
    except ValidationError as exc:
        fields = list(model.model_fields)
        for err in exc.errors():
            path = ".".join([section, *(str(p) for p in err["loc"])])
            if err["type"] == "extra_forbidden":
                key = str(err["loc"][-1])
                msg = "unknown option" + did_you_mean(key, fields)
                if owner:
                    names = [f for f in fields if f != "name"]
                    msg += (f" (options of {owner}: {', '.join(names)})" if names
                            else f" ({owner} takes no options besides name)")
            else:
                text = err["msg"].removeprefix("Value error, ")   # a validator's own words
                msg = f"{text} (got {err.get('input')!r})"
            problems.append((path, msg))
        return None


_RADIX_INT = re.compile(r"[-+]?(0[0-9_]+|0[xXoObB][0-9a-fA-F_]+)")


def parse_override(text: str) -> tuple[str, Any]:
    """``"scheduler.max_num_seqs=32"`` -> ``("scheduler.max_num_seqs", 32)``.

    The value is read as YAML, as in a config file: ``32`` is an int, ``true`` a bool, ``null``
    None, ``[a, b]`` a list; quote it (``'"32"'``) to keep a string.
    """
    key, eq, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not eq or not key or any(not p for p in parts):
        raise ConfigError([("--set", f"{text!r}: expected KEY=VALUE with a dotted key, e.g. "
                                     "scheduler.max_num_seqs=32")])
    try:
        # YAML 1.1 reads 010 as 8 and 0x10 as 16; on a command line that is a trap: keep such
        # values as text (an int option then reads "010" as 10).
        value = raw.strip() if _RADIX_INT.fullmatch(raw.strip()) else (
            yaml.safe_load(raw) if raw.strip() else "")
    except yaml.YAMLError as exc:
        raise ConfigError([(key, f"--set value {raw!r} is not valid YAML: {exc}")]) from None
    return key, value


def apply_overrides(data: Mapping[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted key set, in order (later ones win). Intermediate
    sections are created; the result is validated by ``load_config`` like any file."""
    out = _deep_copy(data)
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError([(".".join(parts[:i + 1]),
                                    f"is {child!r}, not a section, so {key} cannot be set")])
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def did_you_mean(key: str, choices: list[str], template: str = "; did you mean {}?") -> str:
    """``"; did you mean X?"`` (or ``template`` filled with X) for the closest of ``choices`` to
    a misspelt ``key``, or ``""``. Config keys and the command line's flags use it alike."""
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    return template.format(close[0]) if close else ""


def _uses_defs(schema: Any) -> bool:
    """Whether a JSON schema still refers to its own ``$defs``."""
    if isinstance(schema, dict):
        return any((k == "$ref" and str(v).startswith("#/$defs/")) or
                   (k != "$defs" and _uses_defs(v)) for k, v in schema.items())
    if isinstance(schema, list):
        return any(_uses_defs(v) for v in schema)
    return False


def config_schema(registry: Registry) -> dict[str, Any]:
    """JSON schema of the config for the installed plugin set: each plugin section is a ``oneOf``
    over the installed plugins of that kind, discriminated by ``name``."""
    properties: dict[str, Any] = {
        "model": ModelConfig.model_json_schema(),
        "parallel": ParallelConfig.model_json_schema(),
        "plugins": PluginsConfig.model_json_schema(),
    }
    for section in PLUGIN_SECTIONS:
        variants = []
        chosen = registry.components.get(section, {})
        for bare in registry.choices(section):
            for entry in registry.providers[section][bare]:
                # Every spelling that selects this provider: the bare name when it does, and
                # the name qualified by its distribution or its plugin.
                qualifiers = [entry.plugin.distribution, entry.plugin.name,
                              entry.plugin.entry_point]
                names = list(dict.fromkeys(
                    ([bare] if chosen.get(bare) is entry else [])
                    + [f"{q}:{bare}" for q in qualifiers if q]))
                schema = entry.spec.options.model_json_schema()
                schema["properties"]["name"] = {"enum": names, "default": names[0]}
                for key in delegate_fields(entry.spec.options):
                    schema["properties"][key] = {
                        "$ref": f"#/properties/{section}",
                        "description": entry.spec.options.model_fields[key].description}
                schema.pop("$defs", None) if not _uses_defs(schema) else None
                schema["title"] = f"{section}: {names[0]}"
                schema["description"] = (f"{entry.spec.summary} "
                                         f"[{entry.plugin.describe()}]").strip()
                variants.append(schema)
        if section == "platform":
            variants.append({"title": "platform: auto", "type": "object",
                             "additionalProperties": False,
                             "description": PlatformOptions.__doc__.split("\n\n")[0],
                             "properties": {"name": {"const": "auto", "default": "auto"}}})
        if section == "attention":
            variants.append({"title": "attention: auto", "type": "object",
                             "additionalProperties": False,
                             "description": AttentionOptions.__doc__.split("\n\n")[0],
                             "properties": {"name": {"const": "auto", "default": "auto"}}})
        properties[section] = {"oneOf": variants} if variants else {"type": "object"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "corellm engine config",
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }


assert set(PLUGIN_SECTIONS) == set(SECTION_SPECS)
