"""The in-process executor: one worker, in the engine core's own process."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field

from corellm import hookimpl
from corellm.components import BuildContext, ExecutorOptions, ExecutorSpec
from corellm.interfaces import Executor, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput


class UniprocOptions(ExecutorOptions):
    name: str = "uniproc"
    tensor_parallel_size: int = Field(
        1, ge=1, le=1, description="Must be 1: uniproc runs a single worker "
                                   "(use a multiprocess executor for tensor parallelism).")


class UniprocExecutor(Executor):
    def __init__(self, options: UniprocOptions, ctx: BuildContext) -> None:
        from corellm.worker.worker import Worker
        self.worker = Worker(ctx.config, ctx.registry)

    @property
    def model_info(self) -> ModelInfo:
        return self.worker.model_info

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.sample_tokens(scheduler_output)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="uniproc", factory=UniprocExecutor, options=UniprocOptions,
                       summary="One worker in the engine core's process.")
