"""Choosing the attention backend a worker runs: the first of the setup's candidates that
builds here and takes every attention layer of the model, and the layers a checkpoint is
expected to have before its model is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from corellm.arch import ModelArchConfig
from corellm.components import BuildContext
from corellm.platforms.distributed import ParallelContext
from corellm.config.schema import EngineConfig
from corellm.errors import ConfigError, PluginError
from corellm.interfaces import AttentionLayerSpec
from corellm.plugins.registry import RegisteredComponent, Registry
from corellm.config.setup import EngineSetup
from corellm.specs import AttentionOptions


@dataclass
class SelectedAttention:
    entry: RegisteredComponent
    options: AttentionOptions
    why: str                     # how it was chosen, for the start-up log line
    backend: Any = None          # the instance, once made


_OLD_INTERFACE = ("It was written for an attention interface older than plugin API 1.0, "
                  "which replaced kv_cache_shape(...) with kv_cache_spec(layer, num_blocks, "
                  "block_size, dtype) -> KVCacheSpec and build_metadata(common) with "
                  "make_metadata_builder(limits) (docs/plugins.md, \"An attention backend\"; "
                  "CHANGELOG.md)")


def select_attention_backend(config: EngineConfig, registry: Registry, setup: EngineSetup,
                             ctx: BuildContext, layers: Sequence[AttentionLayerSpec] = (),
                             ) -> SelectedAttention:
    """The backend to run: the first of the setup's candidates (``EngineSetup.
    attention_candidates``: the named backend, or ``auto``'s by priority for the platform's
    device) that accepts every one of ``layers`` in the setup's dtype (the layers the
    checkpoint's config predicts, so a head size the best backend lacks falls back to the next
    one), made with ``ctx``."""
    auto = config.attention.name == "auto"
    skipped = list(setup.attention_skipped)
    device, dtype = ctx.device, ctx.dtype
    for name in setup.attention_candidates:
        entry = registry.get("attention", name)
        options = config.attention if not auto else entry.spec.options(name=name)
        why = (f"attention.name: auto -> {name} on {device}" if auto
               else f"attention.name: {name}")
        cand = SelectedAttention(entry, options, why)
        cand.backend = _make_backend(cand, ctx)
        refusal = None
        if auto and layers:
            refusal = next((r for layer in layers
                            if (r := cand.backend.supports(layer, dtype, device))), None)
        if refusal is None:
            if skipped:
                cand.why += f" (not {'; not '.join(skipped)})"
            return cand
        skipped.append(f"{name}: {refusal}")
    raise ConfigError([("attention.name", f"auto: no installed attention backend can run this "
                                          f"model on {device}"
                                          + "".join(f"; {s}" for s in skipped))])


def _make_backend(selected: SelectedAttention, ctx: BuildContext) -> Any:
    """The backend from its factory; a class still written for an attention interface older than
    plugin API 1.0 (no ``kv_cache_spec``, or a ``build_metadata`` the runner would ignore) is a PluginError
    that names the plugin and the fix."""
    owner = selected.entry.describe()
    try:
        backend = ctx.build(selected.options)
    except PluginError as exc:
        cause = exc.__cause__
        if not (isinstance(cause, TypeError) and "abstract" in str(cause)):
            raise
        raise PluginError(f"{owner}: {cause}. {_OLD_INTERFACE}") from cause
    if hasattr(backend, "build_metadata"):
        raise PluginError(f"{owner}: {type(backend).__name__} defines build_metadata(), which "
                          f"nothing calls any more. {_OLD_INTERFACE}")
    return backend


def predicted_attention_layers(arch: ModelArchConfig, parallel: ParallelContext,
                               max_model_len: int) -> list[AttentionLayerSpec]:
    """The attention layers a checkpoint's config implies for one rank (its heads, KV heads,
    head size, windows shorter than ``max_model_len``), before any model is built: what
    ``auto`` checks its candidates against. The built model's own specs are checked again."""
    tp = parallel.tp_size
    heads = max(1, arch.num_attention_heads // tp)
    kv_heads = max(1, arch.num_key_value_heads // tp)
    layers = []
    for i in range(arch.num_hidden_layers):
        window = arch.layer_sliding_window(i)
        layers.append(AttentionLayerSpec(
            i, heads, kv_heads, arch.head_dim, arch.head_dim ** -0.5,
            sliding_window=window if window is not None and window < max_model_len else None))
    return layers
