"""Plugin components' conformance, checked once when a component is built (not on the step
path): the interface it implements, the arguments its methods take, and which optional
decisions a scheduling policy makes (the scheduler skips the others on its step path). A
mismatch is a ``PluginError`` naming the component and what to change."""

from __future__ import annotations

import inspect

from corellm.errors import PluginError
from corellm.interfaces import NO_CACHED_PREFIX, KVCacheManager, SchedulingPolicy


def overrides(policy: SchedulingPolicy, name: str) -> bool:
    """Whether ``policy`` implements the optional decision ``name`` (the interface's default does
    nothing)."""
    return getattr(type(policy), name) is not getattr(SchedulingPolicy, name)


def check_policy(policy: SchedulingPolicy) -> None:
    """Fail at start-up, not at the first step, when a policy was written against another
    version of the interface (0.3 added the ``ctx`` argument to every decision)."""
    if not isinstance(policy, SchedulingPolicy):
        raise PluginError(f"{type(policy).__qualname__} does not implement "
                          "corellm.interfaces.SchedulingPolicy")
    arity = {"waiting_key": 2, "choose_victim": 2, "queue_group": 1, "select": 2,
             "can_admit": 2, "preempt_for": 3, "on_scheduled": 2, "on_finished": 2}
    for name, n in arity.items():
        method = getattr(policy, name)
        try:
            inspect.signature(method).bind(*[None] * n)
        except TypeError:
            expected = inspect.signature(getattr(SchedulingPolicy, name))
            raise PluginError(
                f"{type(policy).__qualname__}.{name}{inspect.signature(method)} does not take the "
                f"arguments corellm passes: {name}{expected} (the policy interface changed in "
                "corellm 0.3: every decision receives a SchedulingContext; see docs/plugins.md, "
                "'A scheduling policy')") from None


def check_kv_cache_manager(kv: KVCacheManager, owner: str) -> None:
    """Fail at start-up, naming the plugin, rather than at the first step."""
    if not isinstance(kv, KVCacheManager):
        raise PluginError(f"{owner}: the kv_cache factory returned {type(kv).__name__}, which "
                          "does not implement corellm.interfaces.KVCacheManager")
    try:
        inspect.signature(kv.allocate_slots).bind(None, 1, NO_CACHED_PREFIX)
    except TypeError:
        raise PluginError(
            f"{owner}: {type(kv).__name__}.allocate_slots"
            f"{inspect.signature(kv.allocate_slots)} does not accept the `prefix` argument the "
            "scheduler passes at admission since corellm 0.2; add `prefix: CachedPrefix | None "
            "= None` (see docs/plugins.md, 'A KV-cache manager')") from None
