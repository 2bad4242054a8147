"""Tensor parallelism over worker processes: ``executor: {name: multiproc}`` with
``parallel.tensor_parallel_size: N`` (or the shorthand ``executor.tensor_parallel_size: N``).
See ``executor.py`` for the design and docs/tensor-parallel.md for its use."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import Field

from corellm import hookimpl
from corellm.components import ExecutorOptions, ExecutorSpec


class MultiprocOptions(ExecutorOptions):
    name: str = "multiproc"
    ring_slots: int = Field(
        8, ge=2, description="Slots of the shared-memory rings carrying plans and outputs.")
    ring_slot_bytes: int = Field(
        1 << 20, ge=4096, description="Bytes per ring slot; a larger message spans slots.")
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long the workers may take to start and load the model.")


def _factory(options, ctx):
    from corellm_plugins.executor_multiproc.executor import MultiprocExecutor
    return MultiprocExecutor(options, ctx)


def _launcher_worker(config, registry) -> int:
    from corellm_plugins.executor_multiproc.launcher import launcher_worker
    return launcher_worker(config, registry)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="multiproc", factory=_factory, options=MultiprocOptions,
                       tensor_parallel=True, launcher_worker=_launcher_worker,
                       summary="One worker process per tensor-parallel rank (torch.distributed: "
                               "gloo on CPU, NCCL on CUDA; spawned here, or started by torchrun "
                               "with parallel.init_method: env://).")
