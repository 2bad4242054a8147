"""The tensor-parallel executor: one worker per rank, on torch.distributed.

Two ways to get the ranks:

* **spawn** (``parallel.init_method: tcp://...``, the default; ``spawn.py``): the executor starts
  ``parallel.tensor_parallel_size`` worker processes on this machine, one per rank, each with
  its device, its shard of the weights and of the KV cache. The engine process holds no model:
  it writes each step's plan into a shared-memory ring (``corellm/platforms/shm_ring.py``)
  every worker reads, and rank 0 writes its sampled tokens back through a second ring. Each
  worker also has a pipe for replies to ``collective_rpc`` and for reporting its own failure.
* **launcher** (``parallel.init_method: env://``; ``launcher.py``): ``torchrun`` (or any launcher
  that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) started every rank, on one machine or
  many. The process of rank 0 runs the engine and its worker in-process; the others run
  ``launcher_worker``. The plan reaches them by a broadcast on a gloo group, since they may be
  on other machines.

Faults: the engine waits for rank 0's output on the ring, each worker's pipe and each worker
process's sentinel together, so a worker that raises or dies is noticed at once (a hang after
``parallel.timeout_s``, when a collective times out); the executor then names the rank and the
cause in an ``ExecutorError``, stops every worker (SIGTERM, then SIGKILL) and the engine ends
every unfinished request with an error. Workers die with the engine (``PR_SET_PDEATHSIG``, and a
check of the parent while idle), ignore SIGINT (the engine decides when they stop), and the
shared memory is unlinked as soon as all have mapped it: nothing outlives the engine.
"""

from __future__ import annotations

from typing import Any

from corellm.components import BuildContext
from corellm.config import EngineConfig
from corellm.config.setup import EngineSetup, resolve_setup
from corellm.platforms import Platform, build_platform
from corellm.platforms.distributed import check_tensor_parallel
from corellm.plugins import Registry
from corellm.worker.ranks import RankBackend, RanksExecutor
from corellm_plugins.executor_multiproc.launcher import _LauncherBackend
from corellm_plugins.executor_multiproc.spawn import _SpawnBackend


def _check_config(config: EngineConfig, registry: Registry, setup: EngineSetup) -> Platform:
    """Refuse in the engine process, before anything starts, a size the model or the machine
    cannot take. Returns the platform."""
    platform = build_platform(config.platform, registry)
    check_tensor_parallel(setup.arch, config.parallel.tensor_parallel_size, platform,
                          setup.source)
    return platform


class MultiprocExecutor(RanksExecutor):
    """The step protocol (and the fault handling above) is ``RanksExecutor``'s
    (corellm/worker/ranks.py); this picks the way the ranks run."""

    name = "multiproc"

    def __init__(self, options: Any, ctx: BuildContext) -> None:
        config = ctx.config
        self.config = config
        self.options = options
        self.tp_size = config.parallel.tensor_parallel_size
        setup = ctx.setup or resolve_setup(config, ctx.registry)
        platform = _check_config(config, ctx.registry, setup)
        wanted = config.scheduler.async_scheduling
        backend: RankBackend
        if config.parallel.external_launcher:
            backend = _LauncherBackend(config, ctx.registry, setup, platform)
        else:
            backend = _SpawnBackend(config, options, setup, platform)
        super().__init__(backend, platform.async_scheduling if wanted is None else wanted)
