"""The CUDA platform's device code: what only a GPU runs, kept small (the host-side logic it
calls is in ``graphs.py``, ``staging.py`` and ``memory.py``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from corellm.attention import AttentionBuildLimits
from corellm.ops import DeviceOps
from corellm.errors import ConfigError
from corellm.platforms import ModelStepper, Platform, StepInputs
from corellm.platforms.distributed import world_size
from corellm_plugins.platform_cuda.graphs import (DecodeGraphs, capture_sizes, graphs_refused,
                                                  padding_metadata)
from corellm_plugins.platform_cuda.memory import MemorySnapshot, kv_budget_bytes
from corellm_plugins.platform_cuda.staging import HostIds, StepStaging

if TYPE_CHECKING:
    from corellm_plugins.platform_cuda import CudaOptions

logger = logging.getLogger(__name__)


def snapshot(device: torch.device) -> MemorySnapshot:
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                          allocated=torch.cuda.memory_allocated(device))


class CudaStepper(ModelStepper):
    """The step on a GPU. Token ids, positions and the sampled rows go through one persistent
    pinned buffer, copied with one non-blocking copy (``StepStaging``); the sampled ids come
    back in one device-to-host copy (``HostIds``). Decode-only steps replay the CUDA graph
    captured for the smallest batch size that holds them (``capture``, at warm-up), their
    inputs padded; other steps run the model eagerly.

    ``pin`` and ``event`` exist for tests of the host-side logic on a machine without CUDA."""

    def __init__(self, model: Any, device: torch.device, limits: AttentionBuildLimits, *,
                 pin: bool = True, event: Callable[[], Any] | None = None) -> None:
        super().__init__(model, device)
        self.limits = limits
        event = event if event is not None else torch.cuda.Event
        self.staging = StepStaging(limits.max_num_batched_tokens, limits.max_num_seqs, device,
                                   pin=pin, event=event)
        self.landing = HostIds(limits.max_num_seqs, pin=pin, event=event)
        self.graphs = DecodeGraphs(limits)
        # batch size -> (graph, its output hidden states, the metadata it was captured with)
        self.captured: dict[int, tuple[Any, torch.Tensor, Any]] = {}
        self.replays = 0

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        size = self.graphs.size_for(inputs)
        ids, positions, rows = self.staging.stage(inputs.input_ids, inputs.positions,
                                                  inputs.logits_indices, size)
        if size is None:
            hidden = self.model(ids, positions, inputs.attn_metadata)
        else:
            graph, hidden, _ = self.captured[size]
            graph.replay()
            self.replays += 1
        return self.model.compute_logits(hidden[rows])

    def to_host(self, token_ids: torch.Tensor) -> list[int]:
        return self.landing.fetch(token_ids)

    def capture(self, sizes: Sequence[int]) -> None:
        """Capture the model's forward of a decode batch of each of ``sizes``, built of padding
        rows by the runner's own metadata builder (so that the graphs read its buffers), the
        largest first: the graphs share one memory pool, which the largest one sizes."""
        builder = self.attn_builder
        pool = self._graph_pool()
        with torch.inference_mode():
            for size in sorted(sizes, reverse=True):
                md = builder.build(padding_metadata(size, self.limits.block_size))
                zeros = np.zeros(size, dtype=np.int64)
                ids, positions, _ = self.staging.stage(zeros, zeros, zeros[:0], size)
                # Once eagerly first: compiles the kernels and fills what the metadata makes
                # lazily (the attention's tile grids), none of which a capture may do.
                self.model(ids, positions, md)
                graph, hidden = self._capture(partial(self.model, ids, positions, md), pool)
                self.captured[size] = (graph, hidden, md)
        self.graphs.enable(sizes)

    def _graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def _capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    # The host plans step N+1 while the GPU runs step N (vLLM's default with CUDA graphs).
    async_scheduling = True
    default_block_size = 16           # vLLM's GPU default: prefixes cached in finer blocks
    shares_devices = False

    def __init__(self, options: CudaOptions) -> None:
        # Built in the process that reads the config too: nothing here may touch CUDA.
        super().__init__(options)
        self._start: dict[int, MemorySnapshot] = {}

    # ------------------------------------------------------------------ devices
    def device(self, local_rank: int = 0) -> torch.device:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError([("parallel.tensor_parallel_size",
                                f"local rank {local_rank} needs CUDA device {local_rank}, but "
                                f"{count} are visible (CUDA_VISIBLE_DEVICES)")])
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        if local_rank not in self._start:
            # Before the model is built: the non-torch memory in use now (other processes,
            # this one's CUDA context) is not this engine's to count against its share.
            self._start[local_rank] = snapshot(dev)
        return dev

    def device_count(self) -> int:
        return torch.cuda.device_count()

    @property
    def ops(self) -> DeviceOps:
        """The reference's, with ``triton_ops`` the element-wise ops as Triton kernels."""
        if self.options.triton_ops:
            from corellm_plugins.platform_cuda.ops import TRITON_OPS
            return TRITON_OPS
        return super().ops

    def device_names(self) -> list[str]:
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    # ------------------------------------------------------------------ memory
    def free_memory(self, device: torch.device, local_world_size: int = 1) -> int | None:
        """The device's free memory plus what torch holds reserved but unused."""
        return snapshot(device).allocatable

    def kv_cache_budget(self, device: torch.device, local_world_size: int,
                        profile: Callable[[], int]) -> int:
        """``gpu_memory_utilization`` of the device's memory, less the peak of a forward of the
        largest step (weights included; the profile's scratch KV cache, which ``profile``
        returns the size of, left out) and the non-torch memory this process added
        (``memory.kv_budget_bytes``)."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)     # the peak restarts at the weights
        scratch = profile() or 0
        torch.cuda.synchronize(device)
        peak = max(0, torch.cuda.max_memory_allocated(device) - scratch)
        torch.cuda.empty_cache()                       # the profile's scratch is free again
        after = snapshot(device)
        budget = kv_budget_bytes(self.options.gpu_memory_utilization, after, peak,
                                 self._start.get(device.index or 0))
        logger.info("KV cache budget on %s: %.2f GiB (gpu_memory_utilization %g of %.2f GiB; "
                    "profiled peak %.2f GiB)", device, budget / 2**30,
                    self.options.gpu_memory_utilization, after.total / 2**30, peak / 2**30)
        return budget

    def memory_usage(self, device: torch.device) -> dict[str, int]:
        return {"cuda_peak_allocated": torch.cuda.max_memory_allocated(device)}

    def shutdown(self) -> None:
        """The worker dropped its model, KV cache and graphs: return the memory the caching
        allocator keeps, so the next engine of this process (or another process) can take it."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    # ------------------------------------------------------------------ models
    def make_stepper(self, model: Any, device: torch.device,
                     limits: AttentionBuildLimits) -> CudaStepper:
        return CudaStepper(model, device, limits)

    def warm_up(self, stepper: ModelStepper) -> None:
        """Capture the decode graphs (``cuda_graphs``), or say why none are."""
        if not isinstance(stepper, CudaStepper):
            return
        refused = graphs_refused(self.options.cuda_graphs, stepper.attn_builder, world_size())
        if refused:
            logger.info("CUDA graphs: none captured (%s)", refused)
            return
        lim = stepper.limits
        sizes = capture_sizes(self.options.cuda_graph_batch_sizes, lim.max_num_seqs,
                              lim.max_num_batched_tokens)
        if not sizes:
            logger.info("CUDA graphs: none captured (no size of "
                        "platform.cuda_graph_batch_sizes is at most max_num_seqs, %d)",
                        lim.max_num_seqs)
            return
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(stepper.device)
        stepper.capture(sizes)
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1f s, %.0f MiB",
                    len(sizes), _ranges(sizes), time.perf_counter() - t0,
                    (torch.cuda.memory_reserved(stepper.device) - reserved) / 2**20)


def _ranges(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else \
        f"{', '.join(map(str, sizes[:4]))}, ..., {sizes[-1]}"
