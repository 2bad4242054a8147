"""Deprecated: ``corellm.ops`` (the kernels interface, ``DeviceOps``) lived here until 0.4.1.
Kept for platforms written against plugin API 1.1 until corellm 0.5; ``corellm.layers`` exports
the same names."""

from corellm.deprecation import warn_deprecated
from corellm.ops import REFERENCE_OPS, DeviceOps, OpsModule, bind_ops  # noqa: F401

warn_deprecated("the module corellm.layers.ops", "corellm.ops", removed_in="0.5")
