"""The in-process executor: one worker, in the engine core's own process.

With overlapped steps (``scheduler.async_scheduling``, by default the platform's
``async_scheduling``) the worker runs on a thread of its own, one step after another, so that
the engine plans and updates on its thread while a step runs (torch releases the GIL in its
kernels); every other call to the worker runs on that thread too, between steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
        wanted = ctx.config.scheduler.async_scheduling
        overlap = self.worker.platform.async_scheduling if wanted is None else wanted
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="corellm-worker")
                        if overlap else None)

    @property
    def model_info(self) -> ModelInfo:
        return self.worker.model_info

    @property
    def max_concurrent_batches(self) -> int:
        return 1 if self._thread is None else 2

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        call = getattr(self.worker, method)
        if self._thread is None:
            return [call(*args, **(kwargs or {}))]
        return [self._thread.submit(call, *args, **(kwargs or {})).result(timeout)]

    def execute_model(self, scheduler_output: SchedulerOutput,
                      ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if self._thread is None:
            return self.worker.execute_model(scheduler_output)
        return self._thread.submit(self.worker.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)
        self.worker.shutdown()


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="uniproc", factory=UniprocExecutor, options=UniprocOptions,
                       summary="One worker in the engine core's process.")
