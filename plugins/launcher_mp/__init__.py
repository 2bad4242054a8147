"""The ``mp`` core launcher (the default ``core_launcher``): the engine core in a process of
this machine, spawned by the client (``corellm.engine.core_process._CoreProcess``), reached
through two IPC sockets in a private directory. vLLM's ``--data-parallel-backend mp``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from corellm import hookimpl
from corellm.components import CoreLauncherOptions, CoreLauncherSpec


def _launch(options: CoreLauncherOptions, config: Any) -> Any:
    from corellm.engine.core_process import _CoreProcess
    return _CoreProcess()


@hookimpl
def corellm_core_launchers() -> Iterator[CoreLauncherSpec]:
    yield CoreLauncherSpec(name="mp", factory=_launch, options=CoreLauncherOptions,
                           summary="The engine core in a process of this machine, spawned by "
                                   "its client (IPC sockets).")
