"""The CUDA platform's implementation: the code that needs a GPU, kept small."""

from __future__ import annotations

from typing import Any

import torch

from corellm.platforms import ModelStepper, Platform, StepInputs
from corellm_plugins.platform_cuda.staging import StagingBuffer, kv_budget_bytes


class CudaStepper(ModelStepper):
    """The step on a GPU: token ids, positions and the sampling rows go through persistent
    pinned buffers (one non-blocking copy each, no host synchronisation before the forward is
    queued), and the sampled ids come back in one device-to-host copy."""

    def __init__(self, model: Any, device: torch.device, limits: Any) -> None:
        super().__init__(model, device)
        tokens, rows = limits.max_num_batched_tokens, limits.max_num_seqs
        event = torch.cuda.Event
        self.input_ids = StagingBuffer(tokens, torch.int64, device, event=event)
        self.positions = StagingBuffer(tokens, torch.int64, device, event=event)
        self.logits_indices = StagingBuffer(rows, torch.int64, device, event=event)
        self.sampled = torch.zeros(rows, dtype=torch.int64, pin_memory=True)
        self._done = torch.cuda.Event()

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        input_ids = self.input_ids.put(inputs.input_ids)
        positions = self.positions.put(inputs.positions)
        rows = self.logits_indices.put(inputs.logits_indices)
        hidden = self.model(input_ids, positions, inputs.attn_metadata)
        return self.model.compute_logits(hidden[rows])

    def to_host(self, token_ids: torch.Tensor) -> list[int]:
        n = token_ids.shape[0]
        if n > self.sampled.shape[0]:
            self.sampled = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        out = self.sampled[:n]
        out.copy_(token_ids, non_blocking=True)
        self._done.record()
        self._done.synchronize()             # the step's one wait for the device
        return out.tolist()


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    default_block_size = 16           # vLLM's GPU default: prefixes cached in finer blocks
    shares_devices = False

    def device(self, local_rank: int = 0) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_names(self) -> list[str]:
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]

    def free_memory(self, device: torch.device, local_world_size: int = 1) -> int | None:
        free, _ = torch.cuda.mem_get_info(device)
        return free

    def kv_cache_budget(self, device: torch.device, local_world_size: int, profile) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        profile()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        # Used outside torch's allocator: all that is used, less what torch holds reserved.
        non_torch = (total - free) - torch.cuda.memory_reserved(device)
        return kv_budget_bytes(total, self.options.gpu_memory_utilization, peak, non_torch)

    def memory_usage(self, device: torch.device) -> dict[str, int]:
        return {"cuda_peak_allocated": torch.cuda.max_memory_allocated(device)}

    def make_stepper(self, model: Any, device: torch.device, limits: Any) -> ModelStepper:
        return CudaStepper(model, device, limits)
