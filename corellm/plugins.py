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

import difflib
import importlib.metadata
import inspect
import logging
import os
import re
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy
from pydantic import ValidationError

from corellm import hookspecs
from corellm.components import (AttentionBackendSpec, BuildContext, ComponentOptions,
                                CommandSpec, ComponentSpec, ExecutorSpec, FrontendSpec, KVCacheManagerSpec,
                                ModelSpec, PlatformSpec, SamplerSpec, SchedulerSpec, section_of)
from corellm.deprecation import acting_plugin
from corellm.errors import ConfigError, CorellmError, OptionError, PluginError
from corellm.interfaces import ExecutorError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "corellm"
ALLOW_ENV = "CORELLM_PLUGINS"
STRICT_ENV = "CORELLM_STRICT_PLUGINS"
# The distribution whose plugins are the built-ins: an installed plugin providing the same
# component name or architecture takes precedence over them (see Registry.get).
BUILTIN_DISTRIBUTION = "corellm"
# The version of the interfaces plugins are written against (hooks, specs, BuildContext, the
# interfaces in corellm.interfaces, the public modules listed in docs/compatibility.md). A
# plugin declares the one it was written for as a module attribute, CORELLM_PLUGIN_API = "1.0";
# corellm loads it when the major versions are equal and its own minor is at least the
# plugin's. Additions bump the minor; an incompatible change bumps the major.
PLUGIN_API_VERSION: tuple[int, int] = (1, 2)
API_ATTR = "CORELLM_PLUGIN_API"

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
    "corellm_commands": CommandSpec,
}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_.\-]*$")


def canonical_name(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): case and ``-_.`` runs folded."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PluginInfo:
    """Where a plugin came from: its entry point and distribution, or an in-process object.

    ``name`` is the plugin's name in the registry: the entry point's name, or
    ``<distribution>:<entry point>`` when two distributions use one entry-point name."""

    name: str
    value: str | None = None             # entry point target, "package.module[:attr]"
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None       # the entry point's own name (None: in-process)

    @property
    def builtin(self) -> bool:
        """Shipped with corellm (the ``corellm`` distribution)."""
        return (self.distribution is not None
                and canonical_name(self.distribution) == BUILTIN_DISTRIBUTION)

    def matches(self, qualifier: str) -> bool:
        """Whether ``qualifier`` (of a ``qualifier:name`` selection) names this plugin: its
        registry name, its entry point's name or its distribution."""
        return (qualifier in (self.name, self.entry_point)
                or (self.distribution is not None
                    and canonical_name(qualifier) == canonical_name(self.distribution)))

    def describe(self) -> str:
        if self.value is None:
            return f"plugin {self.name!r} (registered in-process)"
        dist = f"{self.distribution} {self.version}" if self.distribution else "unknown distribution"
        return (f"plugin {self.name!r} (entry point {self.entry_point or self.name} = "
                f"{self.value}, from {dist})")


@dataclass(frozen=True)
class BrokenPlugin:
    info: PluginInfo
    error: str
    stage: str = "import"        # import, api, hooks, specs

    def describe(self) -> str:
        what = {"import": "failed to import", "api": "was not loaded",
                "hooks": "does not match corellm.hookspecs",
                "specs": "registered invalid components"}.get(self.stage, "is broken")
        return f"{self.info.describe()} {what}: {self.error}"


@dataclass(frozen=True)
class RegisteredComponent:
    spec: ComponentSpec
    plugin: PluginInfo

    def describe(self) -> str:
        return f"{self.spec.kind.replace('_', ' ')} {self.spec.name!r} of {self.plugin.describe()}"


@dataclass(frozen=True)
class Conflict:
    """A component name (or, for ``section == "architecture"``, a checkpoint architecture)
    that several plugins provide. ``chosen`` is what the bare name selects (an installed plugin
    over a built-in), or None when the bare name is ambiguous and selecting it is an error."""

    section: str
    name: str
    providers: tuple[RegisteredComponent, ...]
    chosen: RegisteredComponent | None


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


def _resolve(providers: Sequence[RegisteredComponent]) -> RegisteredComponent | None:
    """What a bare name selects among its providers: the only one; else the only one not
    built in (an installed plugin takes precedence over corellm's own); else None
    (ambiguous)."""
    if len(providers) == 1:
        return providers[0]
    third_party = [p for p in providers if not p.plugin.builtin]
    return third_party[0] if len(third_party) == 1 else None


def _qualified(entry: RegisteredComponent) -> str:
    """The ``qualifier:name`` spelling that selects exactly ``entry``."""
    qualifier = entry.plugin.distribution or entry.plugin.name
    return f"{qualifier}:{entry.spec.name}"


@dataclass
class Registry:
    """Every component the loaded plugins offer, by section and name.

    ``providers[section][name]`` lists every plugin providing ``name``; ``components[section]
    [name]`` is what the bare name selects (absent when ambiguous). ``architectures[arch]``
    and ``models_by_arch[arch]`` are the same for checkpoint architectures.
    """

    pm: pluggy.PluginManager
    plugins: dict[str, PluginInfo]
    broken: list[BrokenPlugin]
    providers: dict[str, dict[str, list[RegisteredComponent]]] = field(default_factory=dict)
    architectures: dict[str, list[RegisteredComponent]] = field(default_factory=dict)
    _announced: set[tuple[str, str]] = field(default_factory=set, repr=False)

    @property
    def hook(self) -> Any:
        return self.pm.hook

    @property
    def components(self) -> dict[str, dict[str, RegisteredComponent]]:
        """Section -> name -> the component the bare name selects (ambiguous names left out)."""
        return {section: {name: chosen for name, provs in table.items()
                          if (chosen := _resolve(provs)) is not None}
                for section, table in self.providers.items()}

    @property
    def models_by_arch(self) -> dict[str, RegisteredComponent]:
        return {arch: chosen for arch, provs in self.architectures.items()
                if (chosen := _resolve(provs)) is not None}

    def choices(self, section: str) -> list[str]:
        """Every component name of ``section``, ambiguous ones included."""
        return sorted(self.providers.get(section, {}))

    def conflicts(self) -> list[Conflict]:
        """Every name (and architecture) that several plugins provide, with what its bare
        name selects."""
        out = [Conflict(section, name, tuple(provs), _resolve(provs))
               for section, table in sorted(self.providers.items())
               for name, provs in sorted(table.items()) if len(provs) > 1]
        out += [Conflict("architecture", arch, tuple(provs), _resolve(provs))
                for arch, provs in sorted(self.architectures.items()) if len(provs) > 1]
        return out

    def get(self, section: str, name: str, usable: bool = True) -> RegisteredComponent:
        """The component ``name`` selects in ``section``, or a PluginError that says why not.

        ``name`` is a component name, or ``qualifier:name`` where the qualifier is a plugin
        name or a distribution (``corellm:paged`` is always the built-in). A bare name that
        several plugins provide selects the one that is not built in when there is exactly one,
        logging the choice once; otherwise it is an error naming every provider and how to pick
        one. Unknown names list the available ones and any broken plugin. With ``usable`` (the
        default), a component that declares itself unavailable here is a PluginError giving its
        reason."""
        qualifier, sep, short = name.rpartition(":")
        providers = self.providers.get(section, {}).get(short if sep else name, [])
        if sep:
            matching = [p for p in providers if p.plugin.matches(qualifier)]
            if not providers:
                self._unknown(section, short)
            if len(matching) != 1:
                have = ", ".join(f"{_qualified(p)} ({p.plugin.describe()})" for p in providers)
                raise PluginError(
                    f"{section} {name!r}: "
                    + (f"no plugin or distribution {qualifier!r} provides {short!r}"
                       if not matching else f"{qualifier!r} provides {short!r} more than once")
                    + f"; it is provided by {have}" + self._broken_notes())
            found = matching[0]
        elif providers:
            chosen = _resolve(providers)
            if chosen is None:
                raise PluginError(self._ambiguous(section, name, providers))
            if len(providers) > 1:
                self._announce(section, name, chosen, providers)
            found = chosen
        else:
            self._unknown(section, name)
        if usable and found.spec.unavailable:
            raise PluginError(f"{section} {name!r} ({found.plugin.describe()}) is "
                              f"unavailable: {found.spec.unavailable}")
        return found

    def _unknown(self, section: str, name: str) -> None:
        choices = self.choices(section)
        msg = f"unknown {section} {name!r}; available: {', '.join(choices) or '(none)'}"
        close = difflib.get_close_matches(name, choices, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        msg += self._broken_notes()
        raise PluginError(msg)

    def _broken_notes(self) -> str:
        return "".join(f"\n  note: {b.describe()}" for b in self.broken)

    @staticmethod
    def _ambiguous(section: str, name: str, providers: Sequence[RegisteredComponent],
                   how: str | None = None) -> str:
        listed = "; ".join(f"{p.describe()}" for p in providers)
        picks = " or ".join(repr(_qualified(p)) for p in providers)
        key = "model.implementation" if section == "model" else f"{section}.name"
        how = how or f"select one as {key}: {picks}"
        return (f"{section} {name!r} is provided by {len(providers)} plugins: "
                f"{listed}. {how[0].upper() + how[1:]}, or disable the "
                "plugins you do not want (plugins.disable)")

    def _announce(self, section: str, name: str, chosen: RegisteredComponent,
                  providers: Sequence[RegisteredComponent]) -> None:
        if (section, name) in self._announced:
            return
        self._announced.add((section, name))
        others = ", ".join(repr(_qualified(p)) for p in providers if p is not chosen)
        logger.info("%s %r: using %s, installed over the built-in (select %s for the "
                    "built-in)", section, name, chosen.describe(), others)

    def model_for(self, architectures: Sequence[str],
                  implementation: str | None = None) -> RegisteredComponent:
        """The model implementation for a checkpoint: ``implementation`` (``model.
        implementation``, a ModelSpec name, qualified or not) when given, which must list one
        of the checkpoint's ``architectures``; else the one implementing the first listed
        architecture any plugin implements, chosen among several as ``get`` chooses."""
        if implementation is not None:
            try:
                entry = self.get("model", implementation)
            except PluginError as exc:
                raise PluginError(f"model.implementation: {exc}") from None
            implements = list(entry.spec.architectures)  # type: ignore[attr-defined]
            if not set(implements) & set(architectures):
                raise PluginError(
                    f"model.implementation: {implementation!r} ({entry.plugin.describe()}) "
                    f"implements {', '.join(implements)}, not the checkpoint's "
                    f"{', '.join(architectures) or '(none)'}")
            return entry
        for arch in architectures:
            providers = self.architectures.get(arch)
            if not providers:
                continue
            chosen = _resolve(providers)
            if chosen is None:
                picks = " or ".join(repr(_qualified(p)) for p in providers)
                raise PluginError(self._ambiguous(
                    "architecture", arch, providers,
                    how=f"choose one with model.implementation: {picks}"))
            if len(providers) > 1:
                self._announce("architecture", arch, chosen, providers)
            return chosen
        msg = (f"no model plugin implements architecture {', '.join(architectures) or '(none)'}; "
               f"supported: {', '.join(sorted(self.architectures)) or '(none)'}")
        raise PluginError(msg + self._broken_notes())

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
    return any(q and info.distribution is not None and ep == info.entry_point
               and canonical_name(q) == canonical_name(info.distribution)
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
    broken: list[BrokenPlugin] = []

    def set_aside(info: PluginInfo, error: str, stage: str) -> None:
        entry = BrokenPlugin(info, error, stage)
        if strict:
            raise PluginError(f"{entry.describe()} ({STRICT_ENV} is set)")
        broken.append(entry)
        logger.warning("%s; it is left out", entry.describe())

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
            set_aside(info, exc.error, exc.stage)
            continue
        except PluginError as exc:
            set_aside(info, str(exc), "hooks")
            continue
        infos[info.name] = info
        loaded.append((obj, info))

    installed = {i.entry_point for group in seen.values() for i in group}
    for label, names in (("plugins.disable", disabled), (ALLOW_ENV, allowed or set())):
        for name in sorted(names):
            if not any(_named_by(i, {name}) for group in seen.values() for i in group):
                logger.warning("%s names %r, but no installed plugin has that entry-point name "
                               "(installed: %s)", label, name, ", ".join(sorted(installed)))

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

    registry = Registry(pm=pm, plugins=infos, broken=broken)
    for name, error in _collect(registry).items():
        info = infos.pop(name)
        pm.unregister(name=name)
        if name in in_process:
            raise PluginError(f"{info.describe()}: {error}")
        set_aside(info, error, "specs")
    return registry


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


def build_component(ctx: BuildContext, options: ComponentOptions, path: str | None = None) -> Any:
    """``ctx.build(options)``: the component ``options.name`` selects in the options' section,
    from its factory, called with ``options`` and ``ctx``. What the factory raises is
    attributed: an ``OptionError`` becomes a ConfigError at the option's key path, any other
    exception a PluginError naming the component, its plugin and distribution (corellm's own
    errors, which already say what is wrong, pass unchanged). Deprecated interfaces the
    factory uses are reported naming the plugin."""
    section = section_of(options)
    entry = ctx.registry.get(section, options.name)
    path = path or section
    if not isinstance(options, entry.spec.options):
        # Options made in code rather than by load_config (a delegate's default is the
        # section's base options): read them with the component's own model.
        try:
            options = entry.spec.options.model_validate(
                {**options.model_dump(exclude_unset=True, serialize_as_any=True),
                 "name": options.name})
        except ValidationError as exc:
            raise ConfigError([(f"{path}.{'.'.join(map(str, e['loc']))}", e["msg"])
                               for e in exc.errors()]) from None
    outer, ctx.path = ctx.path, path
    try:
        return call_factory(entry, path, options, ctx)
    finally:
        ctx.path = outer


def call_factory(entry: RegisteredComponent, path: str, *args: Any) -> Any:
    """``entry.spec.factory(*args)`` with its errors attributed as ``build_component`` says."""
    try:
        with acting_plugin(entry.plugin):
            return entry.spec.factory(*args)
    except OptionError as exc:
        raise ConfigError([(f"{path}.{exc.key}",
                            f"{exc.message} ({entry.describe()})")]) from exc
    except (CorellmError, OSError, MemoryError, ExecutorError) as exc:
        # Errors that already say what failed (a checkpoint file, memory, a worker rank) keep
        # their type; the note says which component was being built.
        exc.add_note(f"while building {path}: {entry.describe()}")
        raise
    except Exception as exc:
        raise PluginError(f"{path}: {entry.describe()} could not be built: {exc!r}") from exc


def executor_launcher_worker(options: ComponentOptions, registry: Registry
                             ) -> Callable[..., int] | None:
    """The ``launcher_worker`` of the executor ``options`` select, or of the executor it wraps
    (through ``delegate`` fields), or None."""
    from corellm.components import delegate_fields
    entry = registry.get("executor", options.name)
    run = getattr(entry.spec, "launcher_worker", None)
    if run is not None:
        return run
    for name in delegate_fields(type(options)):
        run = executor_launcher_worker(getattr(options, name), registry)
        if run is not None:
            return run
    return None


def _check_model_spec(spec: ModelSpec) -> None:
    from corellm.model_config import ModelArchConfig

    if isinstance(spec.architectures, str) or not spec.architectures:
        raise PluginError(f"ModelSpec {spec.name!r} architectures must be a "
                          f"non-empty list of config.json architecture names, got "
                          f"{spec.architectures!r}")
    cls = spec.config_class
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, ModelArchConfig)):
        raise PluginError(f"ModelSpec {spec.name!r} config_class must "
                          "subclass corellm.model_config.ModelArchConfig")


def _check_platform_spec(spec: PlatformSpec) -> None:
    from corellm.platforms import PLATFORM_INTERFACE_VERSION

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
