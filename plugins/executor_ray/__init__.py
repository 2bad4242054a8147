"""corellm on Ray. Two components, see docs/scaling.md for their use:

* the ``ray`` executor: tensor parallelism over Ray actors, ``executor: {name: ray}`` with
  ``parallel.tensor_parallel_size: N``, or vLLM's ``distributed_executor_backend="ray"``
  (``--distributed-executor-backend ray``). One actor per rank in a placement group, on one
  machine or across a Ray cluster (``executor.py``);
* the ``ray`` core launcher: each engine core (a data-parallel replica) as a Ray actor somewhere
  in the cluster, ``core_launcher: {name: ray}``, or vLLM's ``--data-parallel-backend ray``
  (``launcher.py``).

Ray is an optional dependency: ``pip install 'corellm[ray]'``."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from corellm import hookimpl
from corellm.components import (CoreLauncherOptions, CoreLauncherSpec, ExecutorOptions,
                                ExecutorSpec)

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


class RayCoreLauncherOptions(CoreLauncherOptions):
    name: str = "ray"
    address: str | None = Field(
        None, description="The Ray cluster to join (ray.init's address: 'auto', "
                          "'host:6379'); default $RAY_ADDRESS, else the cluster this process "
                          "is already connected to, else a local one started here.")
    cpus_per_replica: float = Field(
        1.0, gt=0, description="CPUs each engine core's actor reserves; on the CPU platform "
                               "also the CPUs of its node it takes to itself (pin_cpus).")
    gpus_per_replica: float | None = Field(
        None, ge=0, description="GPUs each engine core's actor reserves (Ray then shows it "
                                "just those); default parallel.tensor_parallel_size where the "
                                "platform has a device per rank and the executor runs its "
                                "ranks in the core's process tree, else 0.")
    pin_cpus: bool = Field(
        True, description="On the CPU platform, each core takes int(cpus_per_replica) CPUs of "
                          "its node that no other engine core holds (its torch threads and "
                          "thread pool run there); parallel.cpu_affinity, if set, wins.")
    scheduling_strategy: Literal["SPREAD", "DEFAULT"] = Field(
        "SPREAD", description="How Ray places the cores: SPREAD over the nodes, or DEFAULT "
                              "(Ray's: fill a node first).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each core's actor reserves "
                                          "(to place the cores on the nodes that have them).")
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long placing the actor and loading the model may take.")
    env_prefixes: list[str] = Field(
        list(ENV_PREFIXES), description="The driver's environment variables passed to the "
                                        "cores, by name prefix.")
    log_to_driver: bool = Field(
        False, description="Print the cores' output here (ray.init's log_to_driver) when this "
                           "launcher starts Ray.")


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


def _launcher(options, config):
    from corellm_plugins.executor_ray.launcher import RayCoreLauncher
    return RayCoreLauncher(options, config)


@hookimpl
def corellm_core_launchers() -> Iterator[CoreLauncherSpec]:
    yield CoreLauncherSpec(name="ray", factory=_launcher, options=RayCoreLauncherOptions,
                           on_this_machine=False, unavailable=_unavailable(),
                           summary="Each engine core (data-parallel replica) as a Ray actor, "
                                   "anywhere in a Ray cluster (ZeroMQ over TCP, CURVE-"
                                   "authenticated, to the server).")
