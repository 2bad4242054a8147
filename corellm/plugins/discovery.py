"""Plugin discovery and the component registry.

``load_registry()`` builds a fresh pluggy ``PluginManager`` (no global state, so tests and worker
processes get identical, isolated registries), loads every ``corellm`` entry point, checks each
hook implementation against ``corellm.hookspecs``, and collects the specs the registration hooks
yield into a ``Registry`` that the config and the engine resolve names against. pluggy is used
only here and for observer hooks; resolved components are plain objects on the hot path.

An installed package never breaks corellm: an entry-point plugin that fails to import, declares
another plugin API, implements an unknown hook or yields bad specs is set aside as *broken*
(listed by ``corellm plugins``, named when a config asks for something it might have
provided), and names provided twice are an error only when a config selects them. In-process
plugins (``plugins=[...]``), which the caller asked for explicitly, fail loudly, and so does
every plugin with ``CORELLM_STRICT_PLUGINS=1``.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import re
import traceback
from collections.abc import Iterable, Sequence
from typing import Any

import pluggy

from corellm import hookspecs
from corellm.plugins.deprecation import acting_plugin
from corellm.errors import PluginError
# The registry's types are public here too.
from corellm.plugins.registry import (BUILTIN_DISTRIBUTION, BrokenPlugin, Conflict,  # noqa: F401
                              PluginInfo, RegisteredComponent, Registry, call_factory,
                              canonical_name, executor_launcher_worker, renamed_builtin)
from corellm.specs import section_of  # noqa: F401  (importable here in 1.1)
from corellm.specs import (PLATFORM_INTERFACE_VERSION, AttentionBackendSpec, CommandSpec,
                           ReasoningParserSpec, ToolParserSpec, CoreLauncherSpec,
                           ComponentSpec, ExecutorSpec, FrontendSpec, KVCacheManagerSpec, ModelSpec,
                           LogitsProcessorSpec, PlatformSpec, SamplerSpec, SchedulerSpec)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "corellm"
ALLOW_ENV = "CORELLM_PLUGINS"
STRICT_ENV = "CORELLM_STRICT_PLUGINS"
# The version of the interfaces plugins are written against (hooks, specs, BuildContext, the
# interfaces in corellm.interfaces, the public modules listed in docs/compatibility.md). A
# plugin declares the one it was written for as a module attribute, CORELLM_PLUGIN_API = "1.0";
# corellm loads it when the major versions are equal and its own minor is at least the
# plugin's. Additions bump the minor; an incompatible change bumps the major.
PLUGIN_API_VERSION: tuple[int, int] = (1, 13)
API_ATTR = "CORELLM_PLUGIN_API"

# registration hook -> the spec type its results must have
REGISTRATION_HOOKS: dict[str, type[ComponentSpec]] = {
    "corellm_platforms": PlatformSpec,
    "corellm_schedulers": SchedulerSpec,
    "corellm_kv_cache_managers": KVCacheManagerSpec,
    "corellm_attention_backends": AttentionBackendSpec,
    "corellm_executors": ExecutorSpec,
    "corellm_core_launchers": CoreLauncherSpec,
    "corellm_samplers": SamplerSpec,
    "corellm_logits_processors": LogitsProcessorSpec,
    "corellm_models": ModelSpec,
    "corellm_frontends": FrontendSpec,
    "corellm_commands": CommandSpec,
    "corellm_tool_parsers": ToolParserSpec,
    "corellm_reasoning_parsers": ReasoningParserSpec,
}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_.\-]*$")


class _Manager(pluggy.PluginManager):
    """Treats any function named ``corellm_*`` as a hook implementation, marked or not (as pytest
    does for ``pytest_*``), so a misspelt hook name is caught instead of being silently
    ignored."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("corellm_"):
            method = getattr(plugin, name, None)
            if inspect.isroutine(method):
                opts = {"wrapper": False, "hookwrapper": False, "optionalhook": False,
                        "tryfirst": False, "trylast": False, "specname": None}
        return opts


def _allow_list() -> set[str] | None:
    raw = os.environ.get(ALLOW_ENV)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _entry_point_info(ep: importlib.metadata.EntryPoint) -> PluginInfo:
    dist = getattr(ep, "dist", None)
    return PluginInfo(name=ep.name, value=ep.value, entry_point=ep.name,
                      distribution=dist.metadata["Name"] if dist is not None else None,
                      version=dist.version if dist is not None else None)


def _named_by(info: PluginInfo, names: set[str]) -> bool:
    """Whether ``plugins.disable`` / ``CORELLM_PLUGINS`` names the plugin: by its entry point's
    name (every distribution's), or as ``distribution:entry_point``."""
    if info.entry_point in names or info.name in names:
        return True
    return any((q and info.distribution is not None and ep == info.entry_point
                and canonical_name(q) == canonical_name(info.distribution))
               or ((not q or info.distribution is not None
                    and canonical_name(q) == canonical_name(info.distribution))
                   and renamed_builtin(ep, info))
               for q, _, ep in (n.rpartition(":") for n in names))


def parse_api_version(raw: object) -> tuple[int, int]:
    """``"1.0"``, ``(1, 0)`` or ``1`` -> ``(1, 0)``; anything else is a ValueError."""
    if isinstance(raw, bool):
        raise ValueError(f"{raw!r} is not a version")
    if isinstance(raw, int):
        return raw, 0
    if isinstance(raw, str) and re.fullmatch(r"\d+(\.\d+)?", raw.strip()):
        major, _, minor = raw.strip().partition(".")
        return int(major), int(minor or 0)
    if (isinstance(raw, tuple) and len(raw) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in raw)):
        return raw[0], raw[1]
    raise ValueError(f"{raw!r} is not a version such as \"1.0\"")


def _api_refusal(obj: object) -> str | None:
    """Why a plugin declaring ``CORELLM_PLUGIN_API`` cannot be loaded by this corellm."""
    raw = getattr(obj, API_ATTR, None)
    if raw is None:
        return None
    from corellm import __version__
    have = f"{PLUGIN_API_VERSION[0]}.{PLUGIN_API_VERSION[1]}"
    try:
        major, minor = parse_api_version(raw)
    except ValueError as exc:
        return f"{API_ATTR} = {raw!r}: {exc}"
    if major != PLUGIN_API_VERSION[0]:
        return (f"it was written for corellm plugin API {major}.{minor} ({API_ATTR}); this "
                f"corellm {__version__} provides plugin API {have}, and different major "
                "versions are incompatible (CHANGELOG.md lists what changed)")
    if minor > PLUGIN_API_VERSION[1]:
        return (f"it needs corellm plugin API {major}.{minor} ({API_ATTR}); this corellm "
                f"{__version__} provides plugin API {have}: upgrade corellm")
    return None


def _register(pm: pluggy.PluginManager, obj: object, info: PluginInfo) -> None:
    if pm.has_plugin(info.name):
        raise PluginError(f"two plugins are named {info.name!r}; the second is {info.describe()}")
    try:
        refusal = _api_refusal(obj)
    except Exception as exc:       # a module __getattr__ that raises, say
        raise _Refused("api", f"reading {API_ATTR} raised {exc!r}") from exc
    if refusal:
        raise _Refused("api", refusal)
    try:
        pm.register(obj, name=info.name)
    except ValueError as exc:       # already registered under another name
        raise PluginError(f"{info.describe()} could not be registered: {exc}") from exc
    except Exception as exc:
        # pluggy validates hook by hook: the implementations before the bad one stay
        # registered unless the plugin is taken out again. Reading the object's attributes
        # can raise anything (a lazy module's __getattr__).
        if pm.is_registered(obj):
            pm.unregister(obj)
        detail = str(exc) if isinstance(exc, pluggy.PluginValidationError) else repr(exc)
        raise _Refused("hooks", detail) from exc
    unknown = sorted({caller.name for caller in (pm.get_hookcallers(obj) or [])
                      if not caller.has_spec()})
    if unknown:
        pm.unregister(obj)
        raise _Refused("hooks", f"unknown hook {', '.join(map(repr, unknown))} (known hooks: "
                                f"{', '.join(_hook_names())})")


class _Refused(Exception):
    def __init__(self, stage: str, error: str) -> None:
        super().__init__(error)
        self.stage = stage
        self.error = error


def _refusal_error(info: PluginInfo, exc: _Refused) -> PluginError:
    broken = BrokenPlugin(info, exc.error, exc.stage)
    return PluginError(broken.describe())


def load_registry(disable: Iterable[str] = (), plugins: Sequence[object] = (),
                  entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
                  strict: bool | None = None) -> Registry:
    """Build a fresh registry.

    ``disable`` names entry points not to load (``plugins.disable`` in the config): by entry
    point name, or as ``distribution:entry_point``. The ``CORELLM_PLUGINS`` environment
    variable, when set, is a comma-separated allow-list in the same spellings. ``plugins`` are
    extra in-process plugin objects (modules, classes or instances), registered after the entry
    points, as ``pytest.main(plugins=[...])`` does.

    An entry-point plugin that cannot be used is recorded in ``Registry.broken`` and left out,
    with a warning; with ``strict`` (default: ``CORELLM_STRICT_PLUGINS``) it is a PluginError,
    as a bad in-process plugin always is.
    """
    strict = _strict() if strict is None else strict
    pm = _Manager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    disabled = set(disable)
    allowed = _allow_list()
    infos: dict[str, PluginInfo] = {}
    objects: dict[str, object] = {}
    broken: list[BrokenPlugin] = []

    def set_aside(info: PluginInfo, error: str, stage: str, obj: object = None) -> None:
        entry = BrokenPlugin(info, error, stage, None if obj is None else _sections_of(obj))
        if strict:
            raise PluginError(f"{entry.describe()} ({STRICT_ENV} is set)")
        broken.append(entry)
        _warn_once(f"{entry.describe()}; it is left out")

    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: dict[str, list[PluginInfo]] = {}
    loaded: list[tuple[object, PluginInfo]] = []
    for ep in sorted(entry_points, key=lambda e: (e.name, e.value)):
        info = _entry_point_info(ep)
        same = seen.setdefault(info.name, [])
        if any(o.value == info.value and o.distribution == info.distribution for o in same):
            continue  # the same distribution seen twice on sys.path (editable + site)
        if same:      # another distribution took this entry-point name: qualify this one
            info = PluginInfo(name=f"{info.distribution or info.value}:{info.entry_point}",
                              value=info.value, distribution=info.distribution,
                              version=info.version, entry_point=info.entry_point)
            logger.warning("two distributions have a corellm entry point named %r: %s and %s; "
                           "the second is registered as %r", info.entry_point,
                           same[0].describe(), info.describe(), info.name)
        same.append(info)
        if _named_by(info, disabled) or (allowed is not None and not _named_by(info, allowed)):
            logger.debug("not loading %s (disabled)", info.describe())
            continue
        try:
            with acting_plugin(info):
                obj = ep.load()
        except Exception as exc:  # any import failure: record it, the config decides if fatal
            set_aside(info, "".join(traceback.format_exception_only(type(exc), exc)).strip(),
                      "import")
            continue
        try:
            _register(pm, obj, info)
        except _Refused as exc:
            set_aside(info, exc.error, exc.stage, obj)
            continue
        except PluginError as exc:
            set_aside(info, str(exc), "hooks", obj)
            continue
        infos[info.name] = info
        objects[info.name] = obj
        loaded.append((obj, info))

    installed = {i.entry_point for group in seen.values() for i in group}
    for label, names in (("plugins.disable", disabled), (ALLOW_ENV, allowed or set())):
        for name in sorted(names):
            if not any(_named_by(i, {name}) for group in seen.values() for i in group):
                _warn_once(f"{label} names {name!r}, but no installed plugin has that "
                           f"entry-point name (installed: {', '.join(sorted(installed))})")

    in_process = set()
    for obj in plugins:
        name = getattr(obj, "__name__", None) or f"{type(obj).__name__}-{id(obj):x}"
        info = PluginInfo(name=name)
        try:
            _register(pm, obj, info)
        except _Refused as exc:
            raise _refusal_error(info, exc) from None
        infos[info.name] = info
        in_process.add(info.name)

    limited_by = None
    if allowed is not None:
        left_out = sorted(installed - {i.entry_point for i in infos.values()})
        limited_by = (f"{ALLOW_ENV}={os.environ.get(ALLOW_ENV, '')!r} is set: "
                      + (f"entry-point plugins left out: {', '.join(left_out)}" if left_out
                         else "it leaves out no entry-point plugin"))
    registry = Registry(pm=pm, plugins=infos, broken=broken, limited_by=limited_by)
    for name, error in _collect(registry).items():
        info = infos.pop(name)
        pm.unregister(name=name)
        if name in in_process:
            raise PluginError(f"{info.describe()}: {error}")
        set_aside(info, error, "specs", objects.get(name))
    return registry


# Warnings about installed plugins, each logged once per process however many registries are
# built (an engine, its worker processes' and a server's each build one).
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    # A load made with the logger silenced (the command line's, before logging is configured)
    # does not use up the warning: the command's own load reports it.
    if message not in _warned and not logger.disabled and logger.isEnabledFor(logging.WARNING):
        _warned.add(message)
        logger.warning("%s", message)


def _sections_of(obj: object) -> frozenset[str] | None:
    """The config sections whose registration hooks ``obj`` implements (None when reading its
    attributes raises: a lazy module's ``__getattr__``)."""
    try:
        return frozenset(spec.section for hook, spec in REGISTRATION_HOOKS.items()
                         if callable(getattr(obj, hook, None)))
    except Exception:
        return None


def _hook_names() -> list[str]:
    return [n for n in dir(hookspecs) if n.startswith("corellm_")]


# Called once per implementation by the engine (corellm.engine.core), not through pluggy's caller.
LIFECYCLE_HOOKS = ("corellm_engine_started", "corellm_engine_stopped")


def _collect(registry: Registry) -> dict[str, str]:
    """Fill the registry's tables from every plugin's registration hooks. Returns plugin name ->
    what is wrong with it, for the plugins whose hooks raised or yielded bad specs: none of
    their components are added."""
    pm = registry.pm
    errors: dict[str, str] = {}
    for hook_name in LIFECYCLE_HOOKS:
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.wrapper or impl.hookwrapper:
                errors.setdefault(impl.plugin_name, f"{hook_name} is called once per "
                                  "implementation; it takes plain implementations, not wrappers")
    found: list[RegisteredComponent] = []
    for hook_name, spec_type in REGISTRATION_HOOKS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            plugin = impl.plugin_name
            if plugin in errors:
                continue
            info = registry.plugins.get(plugin, PluginInfo(name=plugin))
            try:
                if impl.wrapper or impl.hookwrapper:
                    raise PluginError(f"{hook_name} is a registration hook; it takes plain "
                                      "implementations, not wrappers")
                try:
                    with acting_plugin(info):
                        result = impl.function()
                        specs = list(result) if result is not None else []
                except Exception as exc:
                    raise PluginError(f"{hook_name}() raised {exc!r}") from exc
                for spec in specs:
                    try:
                        _check_spec(spec, spec_type, hook_name)
                    except PluginError:
                        raise
                    except Exception as exc:      # a spec too malformed to check
                        raise PluginError(f"{hook_name}() yielded {spec!r}, which cannot be "
                                          f"checked: {exc!r}") from exc
                    found.append(RegisteredComponent(spec, info))
            except PluginError as exc:
                errors[plugin] = str(exc)
    for entry in found:
        if entry.plugin.name in errors:
            continue
        spec = entry.spec
        table = registry.providers.setdefault(spec.section, {})
        table.setdefault(spec.name, []).append(entry)
        if isinstance(spec, ModelSpec):
            for arch in spec.architectures:
                registry.architectures.setdefault(arch, []).append(entry)
    return errors


def _check_spec(spec: object, spec_type: type[ComponentSpec], hook_name: str) -> None:
    if not isinstance(spec, spec_type):
        raise PluginError(f"{hook_name}() yielded {spec!r}; expected {spec_type.__name__} "
                          "objects")
    if not _NAME_RE.match(spec.name):
        raise PluginError(f"{spec_type.__name__} name {spec.name!r} must be lower-case "
                          "letters, digits, '_', '-' or '.'")
    _check_options(spec)
    if isinstance(spec, PlatformSpec):
        _check_platform_spec(spec)
    if isinstance(spec, ModelSpec):
        _check_model_spec(spec)


def _check_model_spec(spec: ModelSpec) -> None:
    from corellm.arch import ModelArchConfig

    if isinstance(spec.architectures, str) or not spec.architectures:
        raise PluginError(f"ModelSpec {spec.name!r} architectures must be a "
                          f"non-empty list of config.json architecture names, got "
                          f"{spec.architectures!r}")
    cls = spec.config_class
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, ModelArchConfig)):
        raise PluginError(f"ModelSpec {spec.name!r} config_class must "
                          "subclass corellm.arch.ModelArchConfig")


def _check_platform_spec(spec: PlatformSpec) -> None:
    if spec.name == "auto":
        raise PluginError("a platform cannot be named 'auto' (it selects "
                          "the platform automatically)")
    version = tuple(spec.interface_version)
    if len(version) != 2 or version[0] != PLATFORM_INTERFACE_VERSION[0]:
        raise PluginError(
            f"platform {spec.name!r} was written for platform interface "
            f"{'.'.join(map(str, version))}; this corellm has "
            f"{'.'.join(map(str, PLATFORM_INTERFACE_VERSION))} (docs/plugins.md, 'A platform')")


def _check_options(spec: ComponentSpec) -> None:
    base = type(spec).__dataclass_fields__["options"].default
    if not (isinstance(spec.options, type) and issubclass(spec.options, base)):
        raise PluginError(f"{type(spec).__name__} {spec.name!r} options must "
                          f"subclass corellm.components.{base.__name__}")
