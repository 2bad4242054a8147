"""The component registry: every component the loaded plugins offer, by section and name, and
how a name resolves when several plugins provide it.

``corellm.plugins.load_registry`` builds one (public as ``corellm.plugins.Registry``);
``call_factory`` runs a registered factory with its errors attributed to the plugin.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from corellm.plugins.deprecation import acting_plugin, warn_deprecated
from corellm.errors import ConfigError, CorellmError, OptionError, PluginError
from corellm.interfaces import ExecutorError
from corellm.specs import ComponentOptions, ComponentSpec, delegate_fields

logger = logging.getLogger("corellm.plugins.discovery")

# The distribution whose plugins are the built-ins: an installed plugin providing the same
# component name or architecture takes precedence over them (see Registry.get).
BUILTIN_DISTRIBUTION = "corellm"
# Built-in entry points that were renamed -> (their name now, the release the old one goes in).
# The old name keeps selecting (``old:component``), disabling and allowing its plugin until
# then, with a deprecation warning.
RENAMED_BUILTINS: dict[str, tuple[str, str]] = {}


def renamed_builtin(name: str, info: PluginInfo) -> bool:
    """Whether ``name`` is the former name of ``info``'s built-in entry point (warning that it
    is deprecated when it is)."""
    renamed = RENAMED_BUILTINS.get(name)
    if renamed is None or info.distribution != BUILTIN_DISTRIBUTION \
            or info.entry_point != renamed[0]:
        return False
    warn_deprecated(f"the built-in plugin name {name!r}", repr(renamed[0]),
                    removed_in=renamed[1], stacklevel=3)
    return True


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
                    and canonical_name(qualifier) == canonical_name(self.distribution))
                or renamed_builtin(qualifier, self))

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
    # The sections its registration hooks would have filled; None when it is not known (a
    # plugin that failed to import might have provided anything).
    sections: frozenset[str] | None = None

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
    # What kept installed plugins out, said with every "unknown name" error: the allow-list
    # variable when it is set (an empty one loads no entry-point plugin at all).
    limited_by: str | None = None
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
                    + f"; it is provided by {have}" + self._broken_notes(section))
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
        msg += self._broken_notes(section)
        raise PluginError(msg)

    def _broken_notes(self, section: str | None = None) -> str:
        """The broken plugins that might have provided a component of ``section``, and what
        kept installed plugins out."""
        notes = "".join(f"\n  note: {b.describe()}" for b in self.broken
                        if section is None or b.sections is None or section in b.sections)
        if self.limited_by:
            notes += f"\n  note: {self.limited_by}"
        return notes

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
        raise PluginError(msg + self._broken_notes("model"))

    def implements(self, hook_name: str) -> bool:
        return bool(getattr(self.pm.hook, hook_name).get_hookimpls())

    def hooks_of(self, plugin_name: str) -> list[str]:
        plugin = self.pm.get_plugin(plugin_name)
        if plugin is None:
            return []
        return sorted(caller.name for caller in (self.pm.get_hookcallers(plugin) or []))


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
    entry = registry.get("executor", options.name)
    run = getattr(entry.spec, "launcher_worker", None)
    if run is not None:
        return run
    for name in delegate_fields(type(options)):
        run = executor_launcher_worker(getattr(options, name), registry)
        if run is not None:
            return run
    return None
