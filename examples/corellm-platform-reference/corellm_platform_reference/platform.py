"""The reference platform's implementation: the methods of ``corellm.platforms.Platform`` a port
changes, each written out with the core's reference behaviour and a note on what a real device
changes there (the rest, ``native_library``, ``resolve_dtype``, ``device_count`` and
``memory_usage``, are the base class's). The engine calls them in this order: ``device`` and
``prepare_process`` when a worker starts, ``prepare_model`` after the weights are loaded,
``make_stepper``, then ``kv_cache_budget`` / ``free_memory`` to size the KV cache, ``zeros`` to
allocate it, and ``warm_up`` before the first request."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from corellm.ops import REFERENCE_OPS, DeviceOps, bind_ops
from corellm.platforms import ModelStepper, Platform, host_memory_available


class ReferencePlatform(Platform):
    # The torch device type the port's tensors live on ("cuda", "xpu", "npu", ...). Only the
    # platform knows it: the core asks the platform instead of testing device types.
    device_type = "cpu"
    # The torch.distributed backend of `parallel.backend: auto` (a GPU port: "nccl", or its
    # vendor's collective library). Tensor-parallel ranks exchange activations through it.
    dist_backend = "gloo"
    # KV block size when the config leaves it out. Small blocks share prefixes finely; a device
    # whose attention reads long contiguous runs faster prefers larger ones (the CPU platform
    # uses 128).
    default_block_size = 16
    # The dtypes `model.dtype` may name here; a device without fast bfloat16 or float16 drops
    # them, and a config asking for one is then refused at start-up.
    supported_dtypes = ("float32", "bfloat16", "float16")
    # Tensor-parallel ranks share the host's memory and cores. A device port gives each rank a
    # device of its own (False) and reports how many there are in device_count().
    shares_devices = True

    # ------------------------------------------------------------------ devices
    def device(self, local_rank: int = 0) -> torch.device:
        # A port returns torch.device(self.device_type, local_rank) and makes it the process's
        # current device (torch.cuda.set_device and its kin), so that kernels launched without
        # an explicit device land on the rank's own.
        return torch.device("cpu")

    def device_names(self) -> list[str]:
        # For reports (`corellm bench` records an accelerator platform's device names): a port
        # returns the product name of each visible device.
        return [f"cpu ({os.cpu_count() or '?'} logical cores, reference ops)"]

    def prepare_process(self, local_world_size: int = 1) -> None:
        # Process-wide settings of a worker, before its model is built: a port sets its
        # runtime's per-process knobs here (allocator, streams, thread pools). The executor has
        # already given each tensor-parallel rank its share of the cores; `threads` overrides it.
        if self.options.threads is not None:
            torch.set_num_threads(self.options.threads)

    # ------------------------------------------------------------------ memory
    def free_memory(self, device: torch.device, local_world_size: int = 1) -> int | None:
        # The bytes a worker may still allocate; a KV cache larger than this is refused at
        # start-up with both numbers. A port asks its runtime (torch.cuda.mem_get_info and its
        # kin) for the device's free memory; ranks sharing the host divide what the kernel
        # reports as available (free plus reclaimable page cache).
        available = host_memory_available()
        return None if available is None else available // max(1, local_world_size)

    def kv_cache_budget(self, device: torch.device, local_world_size: int,
                        profile: Callable[[], None]) -> int:
        # The KV cache size when the config sets neither kv_cache.num_blocks nor memory_gib.
        # The reference takes a fixed 1 GiB and never calls `profile`. A device port runs
        # profile() (one forward of the largest step the scheduler can plan), reads its peak
        # memory, and returns a fraction of what is left (the CUDA platform's
        # gpu_memory_utilization).
        return super().kv_cache_budget(device, local_world_size, profile)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        # A zero-filled KV pool buffer. A port may allocate it from a special pool (the CPU
        # platform maps fresh pages that the kernel zeroes on first touch).
        return torch.zeros(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------------ models
    @property
    def ops(self) -> DeviceOps:
        # The kernels models run: the core's plain torch ops. A port subclasses DeviceOps and
        # overrides the ops it runs faster (linear, rms_norm, silu_and_mul, rotary, argmax),
        # falling back to super() for inputs its kernels cannot take, and the fusions
        # (linear_normed, linear_silu_mul) where it has a fused kernel, returning None
        # elsewhere. Return one instance: every layer shares it.
        return REFERENCE_OPS

    def prepare_model(self, model: torch.nn.Module) -> None:
        # After the weights are loaded: every core layer gets this platform's ops, then the ops
        # prepare per-layer state. A port's DeviceOps.prepare repacks weights for its kernels
        # into each layer's `kernel` attribute; the reference has nothing to prepare.
        ops = self.ops
        bind_ops(model, ops)
        ops.prepare(model)

    def make_stepper(self, model: Any, device: torch.device, limits: Any) -> ModelStepper:
        # How one step runs: the reference copies the step's host arrays to the device and runs
        # the model eagerly. A port with graph capture returns a ModelStepper subclass that
        # keeps persistent input buffers sized from `limits` (an AttentionBuildLimits) and
        # replays a captured graph for decode-only steps (StepInputs.decode_only).
        return ModelStepper(model, device)

    def warm_up(self, stepper: ModelStepper) -> None:
        # Called once after the KV cache is bound, before serving: a port captures its graphs
        # or compiles its kernels here, so the first request pays nothing for them.
        pass

    # native_library is the base class's: it raises NativeUnavailable, so a plugin that ships C
    # kernels (the torch_sdpa attention backend) takes its torch path here. A port that can
    # build kernels for its device overrides it to compile `source` with its toolchain and
    # return the loaded ctypes library.
