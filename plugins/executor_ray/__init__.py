"""Tensor parallelism over Ray actors: ``executor: {name: ray}`` with
``parallel.tensor_parallel_size: N``, or vLLM's ``distributed_executor_backend="ray"``
(``--distributed-executor-backend ray``). One actor per rank in a placement group, on one
machine or across a Ray cluster. See ``executor.py`` for the design and docs/scaling.md for its
use. Ray is an optional dependency: ``pip install 'corellm[ray]'``."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from corellm import hookimpl
from corellm.components import ExecutorOptions, ExecutorSpec

INSTALL_HINT = "pip install 'corellm[ray]'"

# The driver's environment variables a rank gets (by prefix), besides Ray's own.
ENV_PREFIXES = ("CORELLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TRITON_", "TORCH_",
                "PYTORCH_", "NCCL_", "GLOO_", "OMP_", "MKL_", "PYTHONPATH")


class RayOptions(ExecutorOptions):
    name: str = "ray"
    address: str | None = Field(
        None, description="The Ray cluster to join (ray.init's address: 'auto', "
                          "'ray://host:10001', 'host:6379'); default $RAY_ADDRESS, else the "
                          "cluster this process is already connected to, else a local one "
                          "started for the engine.")
    placement_group: str | None = Field(
        None, description="The name of an existing placement group to place the ranks in "
                          "(bundles 0..N-1; it is left as it was); default: the one this "
                          "process runs in, else a new one.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How the ranks' bundles are placed across nodes.")
    cpus_per_rank: float = Field(
        1.0, gt=0, description="CPUs each rank's bundle reserves (on the CPU platform, also "
                               "its torch threads).")
    gpus_per_rank: float | None = Field(
        None, ge=0, description="GPUs each rank's bundle reserves; default 1 where the "
                                "platform has a device per rank, else 0.")
    ring_slots: int = Field(
        8, ge=2, description="Slots of the shared-memory rings (ranks on the driver's node).")
    ring_slot_bytes: int = Field(
        1 << 20, ge=4096, description="Bytes per ring slot; a larger message spans slots.")
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long placing the bundles, starting the actors and "
                                 "loading the model may take.")
    env_prefixes: list[str] = Field(
        list(ENV_PREFIXES), description="The driver's environment variables passed to the "
                                        "ranks, by name prefix.")
    log_to_driver: bool = Field(
        False, description="Print the ranks' output here (ray.init's log_to_driver) when this "
                           "executor starts Ray.")


def _unavailable() -> str | None:
    try:
        found = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"needs the optional dependency 'ray' ({INSTALL_HINT})"


def _factory(options, ctx):
    from corellm_plugins.executor_ray.executor import RayExecutor
    return RayExecutor(options, ctx)


@hookimpl
def corellm_executors() -> Iterator[ExecutorSpec]:
    yield ExecutorSpec(name="ray", factory=_factory, options=RayOptions, tensor_parallel=True,
                       unavailable=_unavailable(),
                       summary="One Ray actor per tensor-parallel rank, in a placement group, "
                               "on this machine or across a Ray cluster (torch.distributed "
                               "between the actors; plans through shared memory on the "
                               "driver's node, TCP to other nodes).")
