"""A scheduling policy's conformance, checked once when the scheduler is built: the interface it
implements, the arguments its decisions take, and which optional decisions it makes (the
scheduler skips the others on its step path)."""

from __future__ import annotations

import inspect

from corellm.errors import PluginError
from corellm.interfaces import SchedulingPolicy


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
