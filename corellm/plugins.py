"""Plugin discovery and the component registry.

``load_registry()`` builds a fresh pluggy ``PluginManager`` (no global state, so tests and worker
processes get identical, isolated registries), loads every ``corellm`` entry point, checks each
hook implementation against ``corellm.hookspecs``, and collects the specs the registration hooks
yield into a ``Registry`` that the config and the engine resolve names against. pluggy is used
only here and for observer hooks; resolved components are plain objects on the hot path.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import logging
import os
import re
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from corellm import hookspecs
from corellm.components import (AttentionBackendSpec, ComponentSpec, ExecutorSpec, FrontendSpec,
                                KVCacheManagerSpec, ModelSpec, PlatformSpec, SamplerSpec,
                                SchedulerSpec)
from corellm.errors import PluginError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "corellm"
ALLOW_ENV = "CORELLM_PLUGINS"

# registration hook -> the spec type its results must have
REGISTRATION_HOOKS: dict[str, type[ComponentSpec]] = {
    "corellm_platforms": PlatformSpec,
    "corellm_schedulers": SchedulerSpec,
    "corellm_kv_cache_managers": KVCacheManagerSpec,
    "corellm_attention_backends": AttentionBackendSpec,
    "corellm_executors": ExecutorSpec,
    "corellm_samplers": SamplerSpec,
    "corellm_models": ModelSpec,
    "corellm_frontends": FrontendSpec,
}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_.\-]*$")


@dataclass(frozen=True)
class PluginInfo:
    """Where a plugin came from: its entry point and distribution, or an in-process object."""

    name: str
    value: str | None = None             # entry point target, "package.module[:attr]"
    distribution: str | None = None
    version: str | None = None

    def describe(self) -> str:
        if self.value is None:
            return f"plugin {self.name!r} (registered in-process)"
        dist = f"{self.distribution} {self.version}" if self.distribution else "unknown distribution"
        return f"plugin {self.name!r} (entry point {self.name} = {self.value}, from {dist})"


@dataclass(frozen=True)
class BrokenPlugin:
    info: PluginInfo
    error: str

    def describe(self) -> str:
        return f"{self.info.describe()} failed to import: {self.error}"


@dataclass(frozen=True)
class RegisteredComponent:
    spec: ComponentSpec
    plugin: PluginInfo


class _Manager(pluggy.PluginManager):
    """Treats any function named ``corellm_*`` as a hook implementation, marked or not (as pytest
    does for ``pytest_*``), so a misspelt hook name is caught by ``check_pending`` instead of
    being silently ignored."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("corellm_"):
            method = getattr(plugin, name, None)
            if inspect.isroutine(method):
                opts = {"wrapper": False, "hookwrapper": False, "optionalhook": False,
                        "tryfirst": False, "trylast": False, "specname": None}
        return opts


@dataclass
class Registry:
    """Every component the loaded plugins offer, by section and name."""

    pm: pluggy.PluginManager
    plugins: dict[str, PluginInfo]
    broken: list[BrokenPlugin]
    components: dict[str, dict[str, RegisteredComponent]] = field(default_factory=dict)
    models_by_arch: dict[str, RegisteredComponent] = field(default_factory=dict)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def choices(self, section: str) -> list[str]:
        return sorted(self.components.get(section, {}))

    def get(self, section: str, name: str, usable: bool = True) -> RegisteredComponent:
        """The component registered under ``name`` for ``section``, or a PluginError that lists
        the available names and any plugin that failed to import (it might have provided it).
        With ``usable`` (the default), a component that declares itself unavailable here is a
        PluginError giving its reason."""
        found = self.components.get(section, {}).get(name)
        if found is not None:
            if usable and found.spec.unavailable:
                raise PluginError(f"{section} {name!r} ({found.plugin.describe()}) is "
                                  f"unavailable: {found.spec.unavailable}")
            return found
        choices = self.choices(section)
        msg = f"unknown {section} {name!r}; available: {', '.join(choices) or '(none)'}"
        close = difflib.get_close_matches(name, choices, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        if self.broken:
            msg += "".join(f"\n  note: {b.describe()}" for b in self.broken)
        raise PluginError(msg)

    def model_for(self, architectures: Sequence[str]) -> RegisteredComponent:
        for arch in architectures:
            if arch in self.models_by_arch:
                return self.models_by_arch[arch]
        msg = (f"no model plugin implements architecture {', '.join(architectures) or '(none)'}; "
               f"supported: {', '.join(sorted(self.models_by_arch)) or '(none)'}")
        if self.broken:
            msg += "".join(f"\n  note: {b.describe()}" for b in self.broken)
        raise PluginError(msg)

    def implements(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.pm.get_plugin(plugin_name)
        if plugin is None:
            return []
        return sorted(caller.name for caller in (self.pm.get_hookcallers(plugin) or []))


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_point_info(ep: importlib.metadata.EntryPoint) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(name=ep.name, value=ep.value,
                      distribution=dist.metadata["Name"] if dist is not None else None,
                      version=dist.version if dist is not None else None)


def _register(pm: pluggy.PluginManager, obj: object, info: PluginInfo) -> None:
    if pm.has_plugin(info.name):
        raise PluginError(f"two plugins are named {info.name!r}; the second is {info.describe()}")
    try:
        pm.register(obj, name=info.name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{info.describe()} does not match corellm.hookspecs: {exc}") from exc
    except ValueError as exc:
        raise PluginError(f"{info.describe()} could not be registered: {exc}") from exc


def load_registry(disable: Iterable[str] = (), plugins: Sequence[object] = (),
                  entry_points: Iterable[importlib.metadata.EntryPoint] | None = None) -> Registry:
    """Build a fresh registry.

    ``disable`` names entry points not to load (``plugins.disable`` in the config). The
    ``CORELLM_PLUGINS`` environment variable, when set, is a comma-separated allow-list of entry
    point names. ``plugins`` are extra in-process plugin objects (modules, classes or instances),
    registered after the entry points, as ``pytest.main(plugins=[...])`` does.
    """
    pm = _Manager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    disabled = set(disable)
    allowed = _allow_list()
    infos: dict[str, PluginInfo] = {}
    broken: list[BrokenPlugin] = []

    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen_names: dict[str, PluginInfo] = {}
    for ep in sorted(entry_points, key=lambda e: e.name):
        info = _entry_point_info(ep)
        if info.name in seen_names:
            other = seen_names[info.name]
            if other.value == info.value and other.distribution == info.distribution:
                continue  # the same distribution seen twice on sys.path (editable + site)
            raise PluginError(f"two plugins are named {info.name!r}: {other.describe()} and "
                              f"{info.describe()}")
        seen_names[info.name] = info
        if info.name in disabled or (allowed is not None and info.name not in allowed):
            logger.debug("not loading %s (disabled)", info.describe())
            continue
        try:
            obj = ep.load()
        except Exception as exc:  # any import failure: record it, the config decides if fatal
            err = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            broken.append(BrokenPlugin(info, err))
            logger.warning("%s failed to import: %s", info.describe(), err)
            continue
        _register(pm, obj, info)
        infos[info.name] = info

    for label, names in (("plugins.disable", disabled), (ALLOW_ENV, allowed or set())):
        for name in sorted(names - set(seen_names)):
            logger.warning("%s names %r, but no installed plugin has that entry-point name "
                           "(installed: %s)", label, name, ", ".join(sorted(seen_names)))

    for obj in plugins:
        name = getattr(obj, "__name__", None) or f"{type(obj).__name__}-{id(obj):x}"
        info = PluginInfo(name=name)
        _register(pm, obj, info)
        infos[info.name] = info

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin_name = pm.get_name(exc.plugin) if exc.plugin is not None else None
        info = infos.get(plugin_name or "", PluginInfo(name=str(plugin_name)))
        raise PluginError(f"{info.describe()} implements a hook corellm does not define: {exc}. "
                          f"Known hooks: {', '.join(sorted(_hook_names()))}") from exc

    registry = Registry(pm=pm, plugins=infos, broken=broken)
    _collect(registry)
    return registry


def _hook_names() -> list[str]:
    return [n for n in dir(hookspecs) if n.startswith("corellm_")]


# Called once per implementation by the engine (corellm.engine.core), not through pluggy's caller.
LIFECYCLE_HOOKS = ("corellm_engine_started", "corellm_engine_stopped")


def _collect(registry: Registry) -> None:
    pm = registry.pm
    for hook_name in LIFECYCLE_HOOKS:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.wrapper or impl.hookwrapper:
                info = registry.plugins.get(impl.plugin_name, PluginInfo(name=impl.plugin_name))
                raise PluginError(f"{info.describe()}: {hook_name} is called once per "
                                  "implementation; it takes plain implementations, not wrappers")
    for hook_name, spec_type in REGISTRATION_HOOKS.items():
        section = spec_type.section
        table = registry.components.setdefault(section, {})
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            info = registry.plugins.get(impl.plugin_name, PluginInfo(name=impl.plugin_name))
            if impl.wrapper or impl.hookwrapper:
                raise PluginError(f"{info.describe()}: {hook_name} is a registration hook; "
                                  "it takes plain implementations, not wrappers")
            try:
                result = impl.function()
                specs = list(result) if result is not None else []
            except Exception as exc:
                raise PluginError(f"{info.describe()}: {hook_name}() raised {exc!r}") from exc
            for spec in specs:
                if not isinstance(spec, spec_type):
                    raise PluginError(f"{info.describe()}: {hook_name}() yielded {spec!r}; "
                                      f"expected {spec_type.__name__} objects")
                if not _NAME_RE.match(spec.name):
                    raise PluginError(f"{info.describe()}: {spec_type.__name__} name {spec.name!r} "
                                      "must be lower-case letters, digits, '_', '-' or '.'")
                _check_options(spec, info)
                if isinstance(spec, PlatformSpec):
                    _check_platform_spec(spec, info)
                entry = RegisteredComponent(spec, info)
                if isinstance(spec, ModelSpec):
                    _check_model_spec(spec, info)
                    for arch in spec.architectures:
                        other = registry.models_by_arch.get(arch)
                        if other is not None:
                            raise PluginError(
                                f"architecture {arch!r} is implemented twice: by "
                                f"{other.plugin.describe()} and by {info.describe()}")
                        registry.models_by_arch[arch] = entry
                other = table.get(spec.name)
                if other is not None:
                    raise PluginError(f"two plugins provide {spec_type.kind} {spec.name!r}: "
                                      f"{other.plugin.describe()} and {info.describe()}")
                table[spec.name] = entry


def _check_model_spec(spec: ModelSpec, info: PluginInfo) -> None:
    from corellm.model_config import ModelArchConfig

    if isinstance(spec.architectures, str) or not spec.architectures:
        raise PluginError(f"{info.describe()}: ModelSpec {spec.name!r} architectures must be a "
                          f"non-empty list of config.json architecture names, got "
                          f"{spec.architectures!r}")
    cls = spec.config_class
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, ModelArchConfig)):
        raise PluginError(f"{info.describe()}: ModelSpec {spec.name!r} config_class must "
                          "subclass corellm.model_config.ModelArchConfig")


def _check_platform_spec(spec: PlatformSpec, info: PluginInfo) -> None:
    from corellm.platforms import PLATFORM_INTERFACE_VERSION

    if spec.name == "auto":
        raise PluginError(f"{info.describe()}: a platform cannot be named 'auto' (it selects "
                          "the platform automatically)")
    version = tuple(spec.interface_version)
    if len(version) != 2 or version[0] != PLATFORM_INTERFACE_VERSION[0]:
        raise PluginError(
            f"{info.describe()}: platform {spec.name!r} was written for platform interface "
            f"{'.'.join(map(str, version))}; this corellm has "
            f"{'.'.join(map(str, PLATFORM_INTERFACE_VERSION))} (docs/plugins.md, 'A platform')")


def _check_options(spec: ComponentSpec, info: PluginInfo) -> None:
    base = type(spec).__dataclass_fields__["options"].default
    if not (isinstance(spec.options, type) and issubclass(spec.options, base)):
        raise PluginError(f"{info.describe()}: {type(spec).__name__} {spec.name!r} options must "
                          f"subclass corellm.components.{base.__name__}")
