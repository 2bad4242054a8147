"""Which logits processors a config enables, which one serves structured outputs, and the check
a request gets where it comes in (before it enters the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from corellm.errors import InvalidRequestError, PluginError
from corellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from corellm.config.schema import EngineConfig
    from corellm.plugins.registry import RegisteredComponent, Registry

SECTION = "logits_processors"
STRUCTURED_EXTRA = "pip install 'corellm[structured]'"


def enabled_logits_processors(config: EngineConfig, registry: Registry,
                              ) -> list[RegisteredComponent]:
    """The processors ``logits_processors.enable`` names (each must be available), or, when it
    is absent, every available one whose name selects a single provider."""
    names = config.logits_processors.enable
    if names is not None:
        return [registry.get(SECTION, name) for name in names]
    table = registry.components.get(SECTION, {})
    return [entry for _, entry in sorted(table.items()) if not entry.spec.unavailable]


def structured_outputs_backend(entries: Sequence[RegisteredComponent],
                               ) -> RegisteredComponent | None:
    """The enabled processor that serves ``structured_outputs``: the highest priority."""
    backends = [e for e in entries if getattr(e.spec, "structured_outputs", False)]
    return max(backends, key=lambda e: e.spec.priority, default=None)


class RequestChecker:
    """Runs each enabled processor's ``validate`` on a request's parameters, and refuses
    ``structured_outputs`` when no enabled processor serves them; errors are
    ``InvalidRequestError``s naming the field (a 400 from the server)."""

    def __init__(self, entries: Sequence[RegisteredComponent], why_none: str | None = None,
                 idle: Sequence[RegisteredComponent] = ()) -> None:
        self.entries = list(entries)
        self.backend = structured_outputs_backend(self.entries)
        self.why_none = why_none
        # extra_args keys only a processor that is installed but not enabled reads -> it
        served = {key for e in self.entries for key in e.spec.extra_args}
        self.idle_keys = {key: e for e in idle for key in e.spec.extra_args
                          if key not in served}

    @classmethod
    def for_config(cls, config: EngineConfig, registry: Registry) -> RequestChecker:
        entries = enabled_logits_processors(config, registry)
        why = None
        if structured_outputs_backend(entries) is None:
            missing = [e for e in registry.components.get(SECTION, {}).values()
                       if getattr(e.spec, "structured_outputs", False)]
            why = ("no structured-output backend is enabled ("
                   + ("; ".join(f"{e.spec.name!r} of {e.plugin.describe()}: "
                                + (e.spec.unavailable or "not in logits_processors.enable")
                                for e in missing)
                      if missing else f"none is installed: {STRUCTURED_EXTRA}") + ")")
        idle = [e for e in registry.components.get(SECTION, {}).values() if e not in entries]
        return cls(entries, why, idle)

    def check_keys(self, params: SamplingParams) -> None:
        """Refuse an ``extra_args`` key that only an installed processor left out of
        ``logits_processors.enable`` reads: the request would run unconstrained. Cheap: no
        processor code runs."""
        if params.extra_args and self.idle_keys:
            for key in params.extra_args:
                entry = self.idle_keys.get(key)
                if entry is not None:
                    raise InvalidRequestError(
                        "extra_args", f"{key}: read by {entry.describe()}, which is not enabled "
                        "(logits_processors.enable)" + (f": {entry.spec.unavailable}"
                                                        if entry.spec.unavailable else ""))

    def check(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None and self.backend is None:
            raise InvalidRequestError("structured_outputs", self.why_none or "unsupported")
        self.check_keys(params)
        for entry in self.entries:
            try:
                entry.spec.validate(params)
            except InvalidRequestError:
                raise
            except ValueError as exc:
                field = ("structured_outputs" if entry is self.backend
                         and params.structured_outputs is not None else "extra_args")
                raise InvalidRequestError(field, str(exc)) from None
            except Exception as exc:
                raise PluginError(f"{entry.describe()}: validate() raised {exc!r}") from exc
