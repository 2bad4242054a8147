"""What ``MultiprocExecutor`` asks of a way of running the ranks (``_Backend``: ``spawn.py``,
``launcher.py``), and what both ways share."""

from __future__ import annotations

import os

from corellm.interfaces import ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput


class _Backend:
    """The ranks as ``MultiprocExecutor`` drives them: start them (the model's info), call a
    method on every rank, send a step and receive its output, stop them."""

    def start(self) -> ModelInfo: ...
    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list: ...
    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None: ...
    def recv_output(self) -> ModelRunnerOutput: ...
    def stop(self) -> None: ...


def _cpu_threads(tp_size: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // tp_size)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
