"""One pydantic configuration, composed from the core's sections and the selected plugins' options.

Every section but the core's own (``model``, ``parallel``, ``logits_processors``, ``plugins``)
is ``{name: <plugin>, ...that plugin's options}``, flat; the options are validated by the
selected plugin's options model (``extra="forbid"``), so ``config.scheduler`` *is* the plugin's
typed options object. Errors name the key path and, for a misspelling, the likely intended key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

# The configuration's shape is public here too.
from corellm.config.schema import (REMOVED_MODEL_KEYS, PLUGIN_SECTIONS,  # noqa: F401
                                   SECTIONS, EngineConfig, LogitsProcessorsConfig, LoRAConfig,
                                   ModelConfig, ParallelConfig,
                                   PluginsConfig, apply_overrides, did_you_mean,
                                   parse_override, read_config_file)
from corellm.errors import ConfigError, PluginError
from corellm.specs import (SECTION_SPECS, AttentionOptions, ComponentOptions,  # noqa: F401
                           CoreLauncherOptions, DType, ExecutorOptions, FrontendOptions,
                           KVCacheOptions, PlatformOptions, SamplerOptions, SchedulerOptions,
                           delegate_fields)

if TYPE_CHECKING:
    from corellm.plugins.discovery import Registry

logger = logging.getLogger(__name__)


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

    data = _removed_model_keys(data, problems)
    values: dict[str, Any] = {}
    values["model"] = _validate_model(ModelConfig, data.get("model"), "model", problems)
    values["plugins"] = _validate_model(PluginsConfig, data.get("plugins"), "plugins", problems)
    data = _move_aliases(data, problems)
    values["parallel"] = _validate_model(ParallelConfig, data.get("parallel"), "parallel",
                                         problems)
    values["lora"] = _validate_model(LoRAConfig, data.get("lora"), "lora", problems)
    if values["plugins"] is None:
        raise ConfigError(problems, source=origin)
    if registry is None:
        from corellm.plugins.discovery import load_registry
        registry = load_registry(disable=values["plugins"].disable)

    for section, base in PLUGIN_SECTIONS.items():
        raw = data.get(section)
        if raw is None and section == "frontend":
            continue
        if raw is None and section == "core_launcher" \
                and CoreLauncherOptions().name not in registry.choices(section):
            # Unset, and its default's plugin not loaded (an allow-list without it): an
            # in-process engine never launches a core; a client that does names the problem.
            values[section] = CoreLauncherOptions()
            continue
        values[section] = _validate_section(section, section, raw, registry, values, problems)
    values["logits_processors"] = _validate_logits_processors(data.get("logits_processors"),
                                                              registry, problems)
    if problems:
        raise ConfigError(problems, source=origin)
    return EngineConfig(**{k: v for k, v in values.items() if v is not None})


def _validate_logits_processors(raw: Any, registry: Registry,
                                problems: list[tuple[str, str]]) -> Any:
    section = _validate_model(LogitsProcessorsConfig, raw, "logits_processors", problems)
    if section is None or section.enable is None:
        return section
    for i, name in enumerate(section.enable):
        try:
            registry.get("logits_processors", name)
        except PluginError as exc:
            problems.append((f"logits_processors.enable[{i}]", str(exc)))
    return section


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
    spec = registry.get("platform", platform.name, usable=False).spec
    if spec.default_block_size is not None:
        return spec.default_block_size
    from corellm.platforms.interface import build_platform
    try:
        return build_platform(platform, registry).default_block_size
    except (ConfigError, PluginError):
        raise
    except Exception as exc:
        owner = registry.get("platform", platform.name, usable=False).plugin.describe()
        problems.append(("platform.name", f"{platform.name!r} ({owner}) could not be built: "
                                          f"{exc!r}"))
        return 16


def _removed_model_keys(data: dict[str, Any], problems: list[tuple[str, str]]) -> dict[str, Any]:
    """``model.device``, ``model.cpu_weight_packing`` and ``model.cpu_fused_ops`` moved to the
    ``platform`` section in 0.4 and were removed in 0.6: each is a problem at its key path that
    names its replacement (not an "unknown option")."""
    model = data.get("model")
    if not isinstance(model, Mapping) or not set(model) & set(REMOVED_MODEL_KEYS):
        return data
    for old, new in REMOVED_MODEL_KEYS.items():
        if old in model:
            problems.append((f"model.{old}", f"removed in corellm 0.6 (the platform section "
                                             f"took it over); use platform.{new}"))
    return {**data, "model": {k: v for k, v in model.items() if k not in REMOVED_MODEL_KEYS}}


def _resolve_platform(name: str, raw: dict[str, Any], registry: Registry,
                      problems: list[tuple[str, str]]) -> str | None:
    """The platform ``name`` stands for: itself when available here (else a problem with the
    reason), or for ``auto`` the available platform of the highest priority (the others' reasons
    logged)."""
    from corellm.platforms.interface import choose_platform, platform_availability

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
    return name


# vLLM's spellings of a key, beside a neighbour: (section, key) -> the (section, key) it is.
# ``executor.tensor_parallel_size`` sits next to the executor that runs the ranks;
# ``parallel.data_parallel_backend`` next to the replicas' count.
KEY_ALIASES: dict[tuple[str, str], tuple[str, str]] = {
    ("executor", "tensor_parallel_size"): ("parallel", "tensor_parallel_size"),
    ("parallel", "data_parallel_backend"): ("core_launcher", "name"),
}


def _move_aliases(data: dict[str, Any], problems: list[tuple[str, str]]) -> dict[str, Any]:
    """Each ``KEY_ALIASES`` key given is moved to the key it stands for; both given with
    different values is an error naming both."""
    for (section, key), (to_section, to_key) in KEY_ALIASES.items():
        src = data.get(section)
        if not isinstance(src, Mapping) or key not in src:
            continue
        src = dict(src)
        value = src.pop(key)
        dst = data.get(to_section)
        dst = dict(dst) if isinstance(dst, Mapping) else {}
        if to_key in dst and dst[to_key] != value:
            problems.append((f"{section}.{key}", f"{value!r} contradicts {to_section}.{to_key}="
                             f"{dst[to_key]!r} (they are one setting; give one)"))
        dst.setdefault(to_key, value)
        data = {**data, section: src, to_section: dst}
    return data


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
        "logits_processors": LogitsProcessorsConfig.model_json_schema(),
        "lora": LoRAConfig.model_json_schema(),
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
