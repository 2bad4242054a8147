"""Deprecation of plugin-facing interfaces, attributed to the plugin that uses them.

An interface that changes keeps its previous form working for one minor release: the shim calls
``warn_deprecated`` with what to use instead. While corellm imports a plugin, calls its
registration hooks or runs one of its factories, it marks that plugin as the one acting
(``acting_plugin``), so the warning names the plugin and its distribution: the person who sees it
knows which package to update. The policy is in docs/compatibility.md.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from corellm.errors import CorellmDeprecationWarning

_acting: ContextVar[Any] = ContextVar("corellm_acting_plugin", default=None)


@contextlib.contextmanager
def acting_plugin(info: Any) -> Iterator[None]:
    """Within the block, deprecation warnings name ``info`` (a ``corellm.plugins.PluginInfo``)."""
    token = _acting.set(info)
    try:
        yield
    finally:
        _acting.reset(token)


def warn_deprecated(old: str, new: str, removed_in: str, *, stacklevel: int = 2) -> None:
    """``old`` still works but goes in corellm ``removed_in``; ``new`` replaces it. The warning
    (a ``CorellmDeprecationWarning``) names the acting plugin, if any."""
    info = _acting.get()
    who = f"{info.describe()} uses " if info is not None else ""
    warnings.warn(f"{who}{old}, which is deprecated and will be removed in corellm "
                  f"{removed_in}; use {new}", CorellmDeprecationWarning,
                  stacklevel=stacklevel + 1)
