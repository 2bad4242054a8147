"""The resolved setup: what a config and a checkpoint come to, worked out once.

The config is validated once, where it is read (``LLM``, ``AsyncLLM``, ``corellm serve``), and
travels validated (pickled, when the engine core runs in its own process). The engine core then
calls ``resolve_setup`` once: it reads the checkpoint's config, picks the model plugin, and fixes
the platform, dtype, ``max_model_len``, KV block size, batch limits and the attention backends to
try. The immutable ``EngineSetup`` goes to the executor and every worker
(``BuildContext.setup``), which take these facts from it rather than reading the checkpoint,
resolving ``auto`` values or guessing defaults again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from corellm.errors import ConfigError

if TYPE_CHECKING:
    from corellm.config.schema import EngineConfig
    from corellm.arch import ModelArchConfig
    from corellm.platforms.interface import Platform
    from corellm.plugins.discovery import Registry


@dataclass(frozen=True)
class EngineSetup:
    """Facts every process of one engine shares (picklable: it is shipped to workers)."""

    model_path: str
    source: str                        # where the checkpoint config was read, for messages
    arch: ModelArchConfig              # as parsed by the model plugin's config_class
    model_plugin: str                  # the ModelSpec name the architectures chose
    platform: str                      # platform.name, resolved
    device_type: str                   # the platform's torch device type
    dtype: str                         # float32 / bfloat16 / float16
    max_model_len: int
    block_size: int
    max_num_seqs: int                  # the scheduler's own options
    max_num_batched_tokens: int
    # The attention backends a worker tries, best first (one when attention.name is given), and
    # why others were passed over: each worker takes the first that accepts every layer.
    attention_candidates: tuple[str, ...]
    attention_skipped: tuple[str, ...] = ()
    quantization: str = "none"         # model.quantization, resolved: gguf / none / int8

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


def resolve_setup(config: EngineConfig, registry: Registry,
                  platform: Platform | None = None) -> EngineSetup:
    """Resolve ``config`` against its checkpoint and the installed plugins, once."""
    from corellm.checkpoint.reader import (model_path, parse_arch_config, read_checkpoint_config,
                                      resolve_dtype_name, resolve_max_model_len,
                                      resolve_quantization)
    from corellm.platforms.interface import build_platform

    path = model_path(config)
    cfg, source = read_checkpoint_config(path)
    arch, model_entry = parse_arch_config(cfg, source, registry,
                                       config.model.implementation)
    max_len = resolve_max_model_len(arch, config.model.max_model_len)
    sched = config.scheduler
    common = dict(model_path=path, source=source, arch=arch, model_plugin=model_entry.spec.name,
                  max_model_len=max_len, block_size=config.kv_cache.block_size,
                  max_num_seqs=sched.max_num_seqs,
                  max_num_batched_tokens=sched.max_num_batched_tokens,
                  quantization=resolve_quantization(config.model.quantization, path))
    if platform is None and not runs_model(config.executor, registry):
        # No device is used here: neither the platform (torch, its kernels) nor attention.
        return EngineSetup(**common, platform=config.platform.name, device_type="none",
                           dtype=resolve_dtype_name(config.model.dtype, arch),
                           attention_candidates=(), attention_skipped=())
    platform = platform or build_platform(config.platform, registry)
    dtype = platform.resolve_dtype(config.model.dtype, resolve_dtype_name("auto", arch))
    candidates, skipped = attention_candidates(config, registry, platform.device_type)
    return EngineSetup(**common, platform=platform.name, device_type=platform.device_type,
                       dtype=dtype, attention_candidates=tuple(candidates),
                       attention_skipped=tuple(skipped))


def runs_model(options: Any, registry: Registry) -> bool:
    """Whether the executor ``options`` select runs a model on this machine: its spec's
    ``runs_model``, or for a wrapper, its delegate's."""
    from corellm.specs import delegate_fields

    entry = registry.get("executor", options.name)
    delegates = delegate_fields(type(options))
    if delegates:
        return any(runs_model(getattr(options, key), registry) for key in delegates)
    return getattr(entry.spec, "runs_model", True)


def attention_candidates(config: EngineConfig, registry: Registry,
                         device_type: str) -> tuple[list[str], list[str]]:
    """The attention backends to try on ``device_type``, best first, and why others were
    passed over. A named backend is the only candidate (one that cannot run on the device is a
    ConfigError). For ``auto``: the available backends with an ``auto_priority`` that can run
    on the device and list its type among their ``auto_device_types``, by priority."""
    import torch

    device = torch.device(device_type)
    name = config.attention.name
    if name != "auto":
        entry = registry.get("attention", name)
        reason = entry.spec.check_device(device)
        if reason:
            raise ConfigError([("attention.name", f"{name!r} ({entry.plugin.describe()}) cannot "
                                                  f"run on {device_type}: {reason}")])
        return [name], []
    skipped, found = [], []
    for cand, entry in sorted(registry.components.get("attention", {}).items()):
        spec = entry.spec
        if spec.auto_priority is None:
            continue
        reason = (spec.unavailable or spec.check_device(device)
                  or (None if spec.auto_device_types is None
                      or device_type in spec.auto_device_types
                      else f"auto picks it only on {', '.join(spec.auto_device_types)}"))
        if reason:
            skipped.append(f"{cand}: {reason}")
        else:
            found.append((spec.auto_priority, cand))
    found.sort(key=lambda c: (-c[0], c[1]))
    if not found:
        raise ConfigError([("attention.name", f"auto: no installed attention backend can run on "
                                              f"{device_type}"
                                              + "".join(f"; {s}" for s in skipped))])
    return [cand for _, cand in found], skipped
