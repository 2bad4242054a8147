"""The in-process executor: one worker, in the engine core's own process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from corellm import hookimpl
from corellm.components import BuildContext, ExecutorOptions, ExecutorSpec
from corellm.interfaces import Executor, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput


class UniprocOptions(ExecutorOptions):
    name: str = "uniproc"


class UniprocExecutor(Executor):
    def __init__(self, options: UniprocOptions, ctx: BuildContext) -> None:
        from corellm.worker.worker import Worker
        self.worker = Worker(ctx.config, ctx.registry, setup=ctx.setup)

    @property
    def model_info(self) -> ModelInfo:
        return self.worker.model_info

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="uniproc", factory=UniprocExecutor, options=UniprocOptions,
                       summary="One worker in the engine core's process.")
