"""Device platforms: the interface a device kind implements, and how one is chosen.

A platform is everything the engine needs to know about one kind of device: whether it is
available here (and why not), which ``torch.device`` a worker of a given local rank uses, how
much memory is free there, its ``torch.distributed`` backend, its dtype rules, its default KV
block size, how a step's inputs reach the device and how the model runs on them
(``ModelStepper``), and the kernels it gives models (``DeviceOps``: the core's
``corellm.ops.DeviceOps`` is the plain-torch reference every platform starts from).

Platforms are plugins like any other component (``corellm_platforms`` in
``corellm.hookspecs``), selected by the ``platform`` config section; ``platform: {name: auto}``
(the default) picks the available platform of the highest ``auto_priority`` when the config is
loaded, and says why the others were passed over. The core never branches on a device type: the
one function that knows which device is the host's memory is
``corellm.platforms.devices.host_visible``
(re-exported here), and everything else asks the platform.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from corellm.platforms.devices import (HOST_DEVICE_TYPE, host_memory_available,  # noqa: F401
                                       host_visible)
from corellm.errors import ConfigError, PluginError
from corellm.specs import PLATFORM_INTERFACE_VERSION  # noqa: F401  (public here)

if TYPE_CHECKING:
    import ctypes
    from pathlib import Path

    import numpy as np
    import torch

    from corellm.specs import PlatformOptions
    from corellm.ops import DeviceOps
    from corellm.plugins.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs as host arrays, built by the model runner.

    ``input_ids`` and ``positions`` [T] int64, ``logits_indices`` [S] int64 (the rows of the
    hidden states that sample), ``attn_metadata`` what the attention backend's builder returned
    for the step, ``num_reqs`` / ``num_decodes`` the batch's requests and how many of them (the
    first) decode one token: ``decode_only`` when all do and no LoRA adapter runs (``lora``: the
    steps a platform may replay from a captured graph)."""

    input_ids: np.ndarray
    positions: np.ndarray
    logits_indices: np.ndarray
    attn_metadata: Any
    num_reqs: int
    num_decodes: int
    lora: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_reqs == self.num_tokens and not self.lora


class ModelStepper:
    """Runs the model on one step's inputs: the reference, which copies the host arrays to the
    device each step and runs the model eagerly. A platform returns its own from
    ``Platform.make_stepper`` (the CUDA platform: persistent pinned buffers, one copy per step
    without a host sync, graphs replayed for decode-only steps)."""

    #: The attention metadata builder whose metadata the steps carry, set by the model runner
    #: once the stepper is made: a stepper that captures CUDA graphs builds its capture batches
    #: with it (so that the graphs read its buffers), where its ``cuda_graphs`` allows.
    attn_builder: Any = None

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of ``inputs.logits_indices`` [S, vocab] (None on tensor-parallel ranks
        other than 0)."""
        import torch
        dev = self.device
        input_ids = torch.from_numpy(inputs.input_ids).to(dev)
        positions = torch.from_numpy(inputs.positions).to(dev)
        hidden = self.model(input_ids, positions, inputs.attn_metadata)
        return self.model.compute_logits(hidden[torch.from_numpy(inputs.logits_indices).to(dev)])

    def to_host(self, token_ids: torch.Tensor) -> list[int]:
        """The sampled ids as a list: the step's one device-to-host transfer."""
        return token_ids.tolist()


def steps_refused(option: str, enabled: bool, builder: Any, promise: str,
                  tp_size: int) -> str | None:
    """Why a stepper captures or records no decode steps (None: it does), the same reasons on
    every platform: its option ``option`` is off; the model runner gave it no attention
    metadata builder; the builder does not declare ``promise`` (the attribute that says its
    metadata is where a replay reads it: ``cuda_graphs``, ``replayable``); tensor parallelism
    (collectives are not captured)."""
    if not enabled:
        return f"{option} is false"
    if builder is None:
        return "the model runner gave the stepper no attention metadata builder"
    if not getattr(builder, promise, False):
        return (f"the attention backend's metadata builder ({type(builder).__name__}) does not "
                f"declare {promise}")
    if tp_size > 1:
        return f"tensor parallelism ({tp_size} ranks): collectives are not captured"
    return None


class Platform(ABC):
    """One kind of device, as the engine sees it. Built by its spec's factory with the validated
    ``platform`` options, once in each process that runs or plans for the device (the config
    loader, the engine core, every worker).

    Subclasses set the class attributes and implement the abstract methods; the rest has the
    core's reference behaviour (plain torch ops, eager forward, ``torch.zeros``)."""

    #: ``torch.device`` type of the devices (``"cpu"``, ``"cuda"``, ``"xpu"``...).
    device_type: ClassVar[str]
    #: ``torch.distributed`` backend of ``parallel.backend: auto`` on this device.
    dist_backend: ClassVar[str] = "gloo"
    #: ``kv_cache.block_size`` when a config leaves it out.
    default_block_size: ClassVar[int] = 16
    #: The dtypes models run in here (a ``model.dtype`` outside them is a config error).
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16")
    #: Plugin API 1.6: ``scheduler.async_scheduling`` when a config leaves it out (overlapped
    #: steps: on where they measured faster on this device).
    async_scheduling: ClassVar[bool] = False

    def __init__(self, options: PlatformOptions) -> None:
        self.options = options

    @property
    def name(self) -> str:
        return self.options.name

    # ------------------------------------------------------------------ devices
    @abstractmethod
    def device(self, local_rank: int = 0) -> torch.device:
        """The device of the worker of ``local_rank`` on this machine; make it the process's
        current one where the device kind has such a notion."""

    def device_count(self) -> int:
        """Devices visible to this process (tensor-parallel ranks on one machine need one
        each, unless ``shares_devices``)."""
        return 1

    #: Several ranks may share one device (the CPU: each takes a share of the cores).
    shares_devices: ClassVar[bool] = False

    def device_names(self) -> list[str]:
        """Human-readable names of the visible devices, for reports and benchmarks."""
        return [self.device_type]

    def prepare_process(self, local_world_size: int = 1) -> None:
        """Called once in each worker process before the model is built (process-wide tuning:
        threads, allocator)."""

    # ------------------------------------------------------------------ memory
    @abstractmethod
    def free_memory(self, device: torch.device, local_world_size: int = 1) -> int | None:
        """Bytes a worker on ``device`` may still allocate (its share when
        ``local_world_size`` workers share the device's memory), or None where unknown."""

    def kv_cache_budget(self, device: torch.device, local_world_size: int,
                        profile: Callable[[], int]) -> int:
        """Bytes of KV cache a worker allocates when the config sets neither
        ``kv_cache.num_blocks`` nor ``kv_cache.memory_gib``. ``profile`` runs one forward of the
        largest step the scheduler can plan (``max_num_batched_tokens`` tokens) and returns the
        bytes of the scratch KV cache it ran over (part of a peak measured around it), for a
        platform that sizes the cache from the memory that forward leaves (the CUDA platform's
        ``gpu_memory_utilization``, vLLM's rule). The reference: 1 GiB, no profiling."""
        return 1 << 30

    def memory_usage(self, device: torch.device) -> dict[str, int]:
        """Device-side memory facts for ``corellm bench`` (bytes), if the platform has any."""
        return {}

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """A zero-filled buffer for the KV pool."""
        import torch
        return torch.zeros(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------------ dtypes
    def resolve_dtype(self, requested: str, checkpoint_dtype: str) -> str:
        """The dtype a model runs in: ``model.dtype``, or for ``auto`` the checkpoint's
        (``checkpoint_dtype``, already one of float32/bfloat16/float16)."""
        dtype = checkpoint_dtype if requested == "auto" else requested
        if dtype not in self.supported_dtypes:
            key = "model.dtype"
            raise ConfigError([(key, f"{dtype!r} is not supported on platform {self.name!r} "
                                     f"(supported: {', '.join(self.supported_dtypes)})")])
        return dtype

    # ------------------------------------------------------------------ models
    @property
    def ops(self) -> DeviceOps:
        """The kernels this platform gives models (``corellm.layers.bind_ops`` hands them to
        every core layer). The reference: plain torch."""
        from corellm.ops import REFERENCE_OPS
        return REFERENCE_OPS

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Called once after the weights are loaded, before the first step: give the layers
        this platform's ops (the reference does only that); a platform may also repack
        weights for its kernels here (``DeviceOps.prepare``)."""
        from corellm.ops import bind_ops
        ops = self.ops
        bind_ops(model, ops)
        ops.prepare(model)

    def make_stepper(self, model: Any, device: torch.device, limits: Any) -> ModelStepper:
        """How the model runs one step (``limits``: the step's bounds, a
        ``corellm.attention.AttentionBuildLimits``). The reference: eager, inputs copied each
        step."""
        return ModelStepper(model, device)

    def warm_up(self, stepper: ModelStepper) -> None:
        """Called once after the KV cache is bound, before serving (a CUDA platform captures
        its graphs here)."""

    def shutdown(self) -> None:
        """Called once when the worker that built this platform shuts down, after it dropped
        its model, KV cache and stepper: release what the platform holds for the process (a
        CUDA platform returns its cached device memory). The reference holds nothing."""

    # ------------------------------------------------------------------ native kernels
    def native_library(self, name: str, source: str | Path, flags: tuple[str, ...] = ()
                       ) -> ctypes.CDLL:
        """A C library built from ``source`` for this platform's devices, loaded with ctypes:
        the way a plugin (an attention backend) ships kernels for a platform that can build
        them (the CPU platform compiles with the host's compiler and puts its shared headers,
        ``corellm_tile.h`` and ``corellm_bf16.h``, on the include path). The reference
        builds none: raises ``NativeUnavailable`` with the reason."""
        raise NativeUnavailable(f"platform {self.name!r} builds no native C kernels")

    def describe(self) -> str:
        return f"{self.name} ({', '.join(self.device_names())})"


class NativeUnavailable(PluginError):
    """A platform cannot build or load a native library here (no compiler, a build error, or a
    platform that builds none)."""


def platform_availability(registry: Registry, name: str) -> str | None:
    """Why the registered platform ``name`` cannot run here, or None."""
    entry = registry.get("platform", name, usable=False)
    spec = entry.spec
    if spec.unavailable:
        return spec.unavailable
    try:
        return spec.availability()
    except Exception as exc:       # a probe that breaks is a reason, not a crash
        return f"its availability check raised {exc!r}"


def choose_platform(registry: Registry) -> tuple[str, list[str]]:
    """``platform: auto``: the available platform of the highest ``auto_priority`` (ties: by
    name), and why each other platform was passed over."""
    candidates, skipped = [], []
    for name, entry in sorted(registry.components.get("platform", {}).items()):
        spec = entry.spec
        if spec.auto_priority is None:
            skipped.append(f"{name}: chosen by name only")
            continue
        reason = platform_availability(registry, name)
        if reason:
            skipped.append(f"{name}: {reason}")
        else:
            candidates.append((spec.auto_priority, name))
    if not candidates:
        raise ConfigError([("platform.name", "auto: no installed platform is available here"
                                             + "".join(f"; {s}" for s in skipped))])
    candidates.sort(key=lambda c: (-c[0], c[1]))
    chosen = candidates[0][1]
    skipped += [f"{n}: lower auto_priority ({p})" for p, n in candidates[1:]]
    return chosen, skipped


def available_platforms(registry: Registry) -> list[Platform]:
    """Every registered platform that is available here, built with its default options (for
    reports: ``corellm bench``'s environment record)."""
    out = []
    for name in registry.components.get("platform", {}):
        if platform_availability(registry, name) is None:
            spec = registry.get("platform", name).spec
            out.append(build_platform(spec.options(name=name), registry))
    return out


def build_platform(options: PlatformOptions, registry: Registry) -> Platform:
    """The platform the (validated, resolved) ``platform`` section names, made by its plugin's
    factory (``factory(options)``, or for a wrapper ``factory(options, inner)``, ``inner`` the
    platform its ``delegate`` section names); a plugin whose factory returns something else is
    a PluginError naming it."""
    from corellm.plugins.registry import call_factory
    from corellm.specs import delegate_fields
    entry = registry.get("platform", options.name)
    # A wrapper (``corellm.wrappers.PlatformWrapper``) gets the platform it wraps, built first.
    inner = [build_platform(getattr(options, key), registry)
             for key in delegate_fields(type(options))]
    platform = call_factory(entry, "platform", options, *inner)
    if not isinstance(platform, Platform):
        raise PluginError(f"{entry.plugin.describe()}: the platform factory of {options.name!r} "
                          f"returned {type(platform).__name__}, not a corellm.platforms.Platform")
    return platform
