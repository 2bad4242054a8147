"""Tensor parallelism's core facts: which rank a worker is, and the collectives its layers use.

A worker is one rank of ``parallel.tensor_parallel_size``. Everything below the executor that
depends on it (the model factory, the sharded layers of ``corellm.layers.linear``, the model
runner) reads one ``ParallelContext``, handed over in ``BuildContext.parallel``. With one rank
(``SINGLE``) every collective is the identity and no ``torch.distributed`` state exists, so a
single-device model runs exactly the code it ran before tensor parallelism existed.

Process groups come from ``torch.distributed`` (gloo on CPU, NCCL on CUDA), initialised by
``init_parallel`` from the ``parallel`` config section (the backend of ``auto`` is the
platform's): a TCP rendezvous on 127.0.0.1 for the
workers an executor spawns on one machine, or ``env://`` for processes started by ``torchrun``
on one machine or many.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corellm.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from corellm.config.schema import ParallelConfig
    from corellm.arch import ModelArchConfig
    from corellm.platforms.interface import Platform

TP_KEY = "parallel.tensor_parallel_size"


@dataclass(frozen=True)
class ParallelContext:
    """This worker's place among the ranks that shard one model.

    ``group`` is the tensor-parallel process group (None with one rank); ``cpu_group`` a gloo
    group over the same ranks for host-side control traffic (the same group on CPU).
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    cpu_group: Any = None
    backend: str | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: the rank that samples and returns tokens to the engine."""
        return self.tp_rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.tp_size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dimension, on rank 0 only (others get
        None): the one transfer vocab-parallel logits need, since only rank 0 samples."""
        if self.tp_size == 1:
            return x
        import torch
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)] if self.is_driver else None
        dist.gather(x, parts, dst=self._global(0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, on every rank."""
        if self.tp_size == 1:
            return x
        import torch
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else 0


SINGLE = ParallelContext()


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when exact, else a ConfigError naming both numbers."""
    if numerator % denominator:
        raise ConfigError([(TP_KEY, f"{what}={numerator} is not divisible by "
                                    f"tensor_parallel_size={denominator}")])
    return numerator // denominator


def kv_head_split(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads each rank holds, ranks that hold the same KV heads). With fewer KV heads than
    ranks each is replicated on ``tp_size // num_kv_heads`` ranks."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "num_key_value_heads"), 1
    if tp_size % num_kv_heads:
        raise ConfigError([(TP_KEY, f"tensor_parallel_size={tp_size} is not a multiple of "
                                    f"num_key_value_heads={num_kv_heads}: KV heads can be split "
                                    "across ranks or replicated on an equal number of ranks")])
    return 1, tp_size // num_kv_heads


def check_tensor_parallel(arch: ModelArchConfig, tp_size: int, platform: Platform | None,
                          source: str = "config.json") -> None:
    """Refuse, before any worker starts, a tensor-parallel size the checkpoint or the machine
    cannot take; each message names both numbers. ``platform`` None: the ranks are on other
    machines (a cluster's), whose devices this one cannot count."""
    if tp_size == 1:
        return
    problems = []
    if arch.num_attention_heads % tp_size:
        problems.append((TP_KEY, f"tensor_parallel_size={tp_size} does not divide the model's "
                                 f"num_attention_heads={arch.num_attention_heads} ({source})"))
    try:
        kv_head_split(arch.num_key_value_heads, tp_size)
    except ConfigError as exc:
        problems.extend((k, f"{m} ({source})") for k, m in exc.problems)
    if platform is not None and not platform.shares_devices:
        visible = platform.device_count()
        if tp_size > visible:
            problems.append((TP_KEY, f"tensor_parallel_size={tp_size} exceeds the "
                                     f"{visible} visible {platform.device_type} device(s) of "
                                     f"platform {platform.name!r}"))
    if problems:
        raise ConfigError(problems)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launcher_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by ``torchrun`` or another ``env://``
    launcher (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def resolve_backend(cfg: ParallelConfig, platform: Platform) -> str:
    """``parallel.backend``, or for ``auto`` the platform's (gloo on the CPU, NCCL on CUDA)."""
    if cfg.backend != "auto":
        return cfg.backend
    return platform.dist_backend


def init_parallel(cfg: ParallelConfig, rank: int, init_method: str,
                  device: torch.device, platform: Platform) -> ParallelContext:
    """Join the process group (``cfg.tensor_parallel_size`` ranks) as ``rank``; the worker's
    device must be set first (``Platform.device``). Returns the worker's ParallelContext."""
    import torch.distributed as dist

    size = cfg.tensor_parallel_size
    if size == 1:
        return SINGLE
    backend = resolve_backend(cfg, platform)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timeout, **kwargs)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(tp_rank=dist.get_rank(), tp_size=size, group=group,
                           cpu_group=cpu_group, backend=backend)


def world_size() -> int:
    """The ranks of this process's ``torch.distributed`` group (1 where none is initialised):
    what a platform asks before capturing or recording steps, whose collectives it cannot."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def destroy_parallel(ctx: ParallelContext) -> None:
    if ctx.tp_size > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
