"""Deprecated: ``corellm.policy_view`` (what a scheduling policy sees) lived here until 0.4.1.
Kept until corellm 0.5; ``corellm.scheduling`` exports the same names."""

from corellm.deprecation import warn_deprecated
from corellm.policy_view import SchedulingContext, WaitingQueue  # noqa: F401

warn_deprecated("the module corellm.scheduling.queue", "corellm.scheduling (or corellm.policy_view)",
                removed_in="0.5")
