"""The launcher way (``parallel.init_method: env://``): ranks started by ``torchrun`` or another
launcher. Rank 0's process runs the engine and its own worker (``_LauncherBackend``); the
others run ``launcher_worker`` and receive each plan by a broadcast on the gloo group."""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from corellm.config import EngineConfig
from corellm.platforms.distributed import destroy_parallel, init_parallel, launcher_env
from corellm.errors import ConfigError
from corellm.interfaces import ExecutorError, ModelInfo
from corellm.outputs import ModelRunnerOutput, SchedulerOutput
from corellm.platforms import Platform, build_platform
from corellm.plugins import Registry
from corellm.config.setup import EngineSetup
from corellm.worker.ranks import RankBackend, cpu_threads, describe

# The executor's logger: the package's records come under one name, the executor's.
logger = logging.getLogger("corellm_plugins.executor_multiproc.executor")


class _LauncherBackend(RankBackend):
    """Rank 0 of a ``torchrun``-style launch: the engine's process is also rank 0's worker; the
    other ranks (``launcher_worker``) receive the plan by a broadcast on the gloo group."""

    def __init__(self, config: EngineConfig, registry: Registry, setup: EngineSetup,
                 platform: Platform) -> None:
        self.config = config
        self.registry = registry
        self.setup = setup
        self.platform = platform
        self.tp = config.parallel.tensor_parallel_size
        self.worker: Any = None
        self.parallel: Any = None
        self._out: ModelRunnerOutput | None = None
        self._stopped = False
        self._broken = False

    def start(self) -> ModelInfo:
        env = launcher_env()
        if env is None:
            raise ConfigError([("parallel.init_method", "env:// needs a launcher such as "
                                "torchrun to set RANK and WORLD_SIZE (with MASTER_ADDR and "
                                "MASTER_PORT)")])
        rank, world = env
        if world != self.tp:
            raise ConfigError([("parallel.tensor_parallel_size",
                                f"{self.tp} != WORLD_SIZE={world} of the launcher")])
        if rank != 0:
            raise ConfigError([("parallel.init_method",
                                f"the engine runs on rank 0, but this process is RANK={rank} "
                                "(its command should run the worker: corellm serve/generate "
                                "do that by themselves)")])
        import torch.distributed as dist

        from corellm.worker.worker import Worker
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(self.tp)))
        device = self.platform.device(local_rank)
        self.parallel = init_parallel(self.config.parallel, 0, "env://", device, self.platform)
        # The other ranks build their workers from this setup, not from their own reading of
        # the checkpoint (launcher_worker receives it).
        dist.broadcast_object_list([self.setup], src=0, group=self.parallel.cpu_group)
        self.worker = Worker(self.config, self.registry, self.parallel, local_rank=local_rank,
                             local_world_size=local_world, setup=self.setup,
                             platform=self.platform)
        return self.worker.model_info

    def _collective(self, fn: Any, what: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            self._broken = True         # the group is unusable: stop() must not use it
            raise self._named_failure(exc, what) from None

    def _named_failure(self, exc: BaseException, what: str) -> ExecutorError:
        """A collective failed: look in the rendezvous store for a rank that reported why."""
        reports = []
        try:
            import torch.distributed as dist
            store = dist.distributed_c10d._get_default_store()
            for rank in range(1, self.tp):
                if store.check([f"corellm/error/{rank}"]):
                    reports.append(f"tensor-parallel rank {rank} failed: "
                                   f"{store.get(f'corellm/error/{rank}').decode()}")
        except Exception:
            pass
        head = "; ".join(reports) or f"a tensor-parallel peer of rank 0 failed during {what}"
        return ExecutorError(f"{head} ({describe(exc)})")

    def _broadcast(self, msg: tuple) -> None:
        import torch.distributed as dist
        if self._stopped:
            raise ExecutorError("the multiproc executor's workers are stopped")
        self._collective(lambda: dist.broadcast_object_list([msg], src=0,
                                                            group=self.parallel.cpu_group),
                         msg[0])

    def rpc(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list:
        import torch.distributed as dist
        self._broadcast(("rpc", method, args, kwargs, None))
        mine = getattr(self.worker, method)(*args, **kwargs)
        out: list[Any] = [None] * self.tp
        self._collective(lambda: dist.gather_object(mine, out, dst=0,
                                                    group=self.parallel.cpu_group), method)
        return out

    def send_step(self, plan: SchedulerOutput, prev: ModelRunnerOutput | None) -> None:
        self._broadcast(("step", plan, prev))
        self._out = self._collective(lambda: self.worker.execute_model(plan), "the step")

    def recv_output(self) -> ModelRunnerOutput:
        out, self._out = self._out, None
        assert out is not None
        return out

    def stop(self) -> None:
        if self._stopped:
            return
        try:
            if self.parallel is not None and not self._broken:
                import torch.distributed as dist
                dist.broadcast_object_list([("stop",)], src=0, group=self.parallel.cpu_group)
        except Exception:
            pass
        self._stopped = True
        if self.parallel is not None and not self._broken:
            try:
                destroy_parallel(self.parallel)
            except Exception:
                pass
        if self.worker is not None:
            self.worker.shutdown()          # rank 0's worker lives in the engine's process


def launcher_worker(config: EngineConfig, registry: Registry) -> int:
    """What a process of rank > 0 runs under ``torchrun``: join the group, load its shard,
    serve the broadcast plans until rank 0 stops. Returns the exit status."""
    import torch.distributed as dist

    from corellm.worker.worker import Worker

    env = launcher_env()
    assert env is not None
    rank, world = env
    if world != config.parallel.tensor_parallel_size:
        raise ConfigError([("parallel.tensor_parallel_size",
                            f"{config.parallel.tensor_parallel_size} != WORLD_SIZE={world} of "
                            "the launcher")])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    platform = build_platform(config.platform, registry)
    device = platform.device(local_rank)
    if platform.shares_devices:
        import torch
        torch.set_num_threads(cpu_threads(local_world))
    parallel = None
    try:
        parallel = init_parallel(config.parallel, rank, "env://", device, platform)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)    # rank 0's setup
        worker = Worker(config, registry, parallel, local_rank=local_rank,
                        local_world_size=local_world, setup=box[0], platform=platform)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)
            msg = box[0]
            if msg[0] == "step":
                _, plan, prev = msg
                if prev is not None:
                    worker.add_sampled_tokens(prev)
                worker.execute_model(plan)
            elif msg[0] == "rpc":
                _, method, args, kwargs, _ = msg
                result = getattr(worker, method)(*args, **kwargs)
                dist.gather_object(result, None, dst=0, group=parallel.cpu_group)
            elif msg[0] == "stop":
                break
    except BaseException as exc:
        logger.error("tensor-parallel rank %d failed: %s", rank, describe(exc))
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"corellm/error/{rank}", describe(exc))
        except Exception:
            pass
        return 1
    destroy_parallel(parallel)
    return 0
