"""The CPU platform: the host's cores and memory, gloo, 128-token KV blocks, and the C kernels
(GEMMs, element-wise ops, and whatever a plugin asks it to build) compiled for this CPU."""

from __future__ import annotations

import logging
import platform as _platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from corellm.platforms import ModelStepper, NativeUnavailable, Platform, host_memory_available
from corellm.platforms.distributed import world_size
from corellm_plugins.platform_cpu.memory import tune_malloc, zeroed_cpu_tensor
from corellm_plugins.platform_cpu.ops import CpuDeviceOps

if TYPE_CHECKING:
    import ctypes

    from corellm_plugins.platform_cpu import CpuOptions

logger = logging.getLogger(__name__)


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"
    # vLLM's CPU default: a decode reads each request's K/V block by block, and longer runs in
    # one place read faster (memory streams at full bandwidth over long contiguous runs, and a
    # small scattered block falls short of it; figures in docs/attention.md).
    default_block_size = 128
    shares_devices = True             # tensor-parallel ranks split the cores
    supported_dtypes = ("float32", "bfloat16", "float16")

    def __init__(self, options: CpuOptions) -> None:
        super().__init__(options)
        self._ops = CpuDeviceOps(weight_packing=options.weight_packing,
                                 fused_ops=options.fused_ops,
                                 weight_prefetch=options.weight_prefetch)

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_names(self) -> list[str]:
        model = _platform.processor() or "CPU"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        from corellm_plugins.platform_cpu.native import cpu_budget
        return [f"{model} ({cpu_budget()[0]} cores)"]

    def prepare_process(self, local_world_size: int = 1) -> None:
        """Tune the allocator, and give this process its share of the CPUs it may use (its
        affinity mask and cgroup quota, split between the tensor-parallel ranks on this host)
        as the thread pool's size. With weight packing on, every matmul planned onto corellm's
        kernel and every fused op run on the pool, and torch's own ops (residual adds, an
        embedding lookup, a library GEMM path where it measured faster single-threaded) run on
        one thread: torch's OpenMP threads would otherwise spin between its parallel regions on
        the cores the pool's threads need. Without weight packing (or a C compiler) the
        matmuls are torch's, and torch gets the threads."""
        tune_malloc()
        from corellm_plugins.platform_cpu.native import cpu_budget, thread_pool
        cpus, how = cpu_budget()
        threads = max(1, cpus // max(1, local_world_size))
        try:
            pool = thread_pool()
        except NativeUnavailable as exc:
            torch.set_num_threads(threads)
            logger.info("CPU: %d torch threads per worker (%s, %d worker(s) on this host); no "
                        "thread pool: %s", threads, how, local_world_size, exc)
            return
        pool.configure(threads)
        torch_threads = 1 if self.options.weight_packing else threads
        torch.set_num_threads(torch_threads)
        logger.info("CPU: a pool of %d threads per worker (%s, %d worker(s) on this host), "
                    "whose waiting threads spin %.1f-200 us and then sleep; torch's ops on %d "
                    "thread(s)", threads, how, local_world_size, pool.spin_ns / 1e3,
                    torch_threads)

    def free_memory(self, device: torch.device, local_world_size: int = 1) -> int | None:
        """This worker's share of the host's available memory."""
        available = host_memory_available()
        return None if available is None else available // max(1, local_world_size)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """Its own anonymous mapping, zero-filled by the kernel on first touch: a large pool
        costs nothing at start-up and only the pages ever used take memory."""
        return zeroed_cpu_tensor(shape, dtype)

    def resolve_dtype(self, requested: str, checkpoint_dtype: str) -> str:
        """A float16 checkpoint runs in float32 unless float16 is asked for: fp16 matmuls are
        slow or missing on CPUs."""
        if requested == "auto" and checkpoint_dtype == "float16":
            return "float32"
        return super().resolve_dtype(requested, checkpoint_dtype)

    def make_stepper(self, model: Any, device: torch.device, limits: Any) -> ModelStepper:
        """Decode steps replayed from recordings (``cpu_graphs``); others eager."""
        from corellm_plugins.platform_cpu.replay import CpuStepper
        return CpuStepper(model, device, limits, self.options.cpu_graph_max_rows)

    def warm_up(self, stepper: ModelStepper) -> None:
        """Let the stepper record decode steps, or say why it never will."""
        from corellm_plugins.platform_cpu.replay import CpuStepper, replay_refused
        if isinstance(stepper, CpuStepper):
            stepper.enable(replay_refused(self.options.cpu_graphs, stepper.attn_builder,
                                          world_size()))

    @property
    def ops(self) -> CpuDeviceOps:
        return self._ops

    def native_library(self, name: str, source: str | Path, flags: tuple[str, ...] = ()
                       ) -> ctypes.CDLL:
        from corellm_plugins.platform_cpu.native import load_library
        return load_library(name, source, flags)
