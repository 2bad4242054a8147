"""What a plugin hands corellm and what its factories get back: the component specs and option
models (``corellm.specs``, re-exported here) and the ``BuildContext`` every factory receives.

A plugin registers a component by yielding a spec, e.g.::

    SchedulerSpec(name="fcfs", factory=make_fcfs, options=FCFSOptions, summary="...")

The factory is called only if the config selects the component, so heavy imports belong inside it.
Each options model is pydantic with ``extra="forbid"``: its fields are the section's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from corellm.platforms.distributed import SINGLE, ParallelContext
from corellm.errors import ConfigError
from corellm.plugins.registry import call_factory
from corellm.specs import (  # noqa: F401  (public here)
    ComponentOptions, SchedulerOptions, KVCacheOptions, AttentionOptions, ExecutorOptions,
    SamplerOptions, FrontendOptions, PlatformOptions, NoOptions, SECTION_OF_OPTIONS,
    DELEGATE_MARK, DELEGATE_DEFAULT, section_of, delegate_field, delegate_fields, ComponentSpec,
    SchedulerSpec, KVCacheManagerSpec, AttentionBackendSpec, ExecutorSpec, SamplerSpec,
    FrontendSpec, ModelSpec, PlatformSpec, CommandSpec, LogitsProcessorSpec, SECTION_SPECS,
    ToolParserSpec, ReasoningParserSpec, CoreLauncherOptions, CoreLauncherSpec,
    DType)

if TYPE_CHECKING:
    from corellm.arch import ModelArchConfig
    from corellm.config.schema import EngineConfig
    from corellm.interfaces import AttentionBackend, KVCacheManager
    from corellm.platforms.interface import Platform
    from corellm.plugins.discovery import Registry
    from corellm.config.setup import EngineSetup


@dataclass
class BuildContext:
    """Handed to every factory. Fields a component kind cannot use yet are None."""

    config: EngineConfig
    registry: Registry
    arch: ModelArchConfig | None = None
    # The worker's platform (corellm.platforms.Platform), for worker-side components: its ops
    # (a sampler's argmax), its native kernels (an attention backend's), its device facts.
    platform: Platform | None = None
    # What the config and checkpoint resolved to (corellm.config.setup.EngineSetup): set for the
    # executor and every worker-side component.
    setup: EngineSetup | None = None
    device: Any = None                 # torch.device, for worker-side components
    dtype: Any = None                  # torch.dtype
    kv_cache_manager: KVCacheManager | None = None
    num_kv_blocks: int | None = None
    attention_backend: AttentionBackend | None = None
    max_model_len: int | None = None
    # This worker's rank among parallel.tensor_parallel_size (corellm.platforms.distributed);
    # the one-rank context outside workers and without tensor parallelism.
    parallel: ParallelContext = field(default_factory=lambda: SINGLE)
    # The key path of the component being built ("executor", "executor.delegate", ...), set
    # while its factory runs: what build_delegate extends and error messages name.
    path: str | None = None

    def tokenizer(self) -> Any:
        """The model's tokenizer (``model.tokenizer``, else the checkpoint's), as the engine
        loads it: for components that read the vocabulary (a logits processor's words or
        grammar). Loaded on each call: keep what is needed of it."""
        from corellm.checkpoint.reader import load_tokenizer, model_path

        given = self.config.model.tokenizer
        return load_tokenizer(given or model_path(self.config),
                              "model.tokenizer" if given else "model.path")

    def build(self, options: ComponentOptions, *, path: str | None = None) -> Any:
        """Build the component ``options`` selects (``options.name`` in the section the options
        belong to) with this context: its factory's errors name the plugin, its distribution
        and, for an ``OptionError``, the option's key path (``path``, default the section)."""
        return build_component(self, options, path)

    def build_delegate(self, options: ComponentOptions, field_name: str = "delegate") -> Any:
        """The component a wrapper wraps: ``options.<field_name>`` (a ``delegate_field``),
        built with this context, its key path under the wrapper's."""
        inner = getattr(options, field_name)
        base = self.path or section_of(options)
        return self.build(inner, path=f"{base}.{field_name}")


def build_component(ctx: BuildContext, options: ComponentOptions, path: str | None = None) -> Any:
    """``ctx.build(options)``: the component ``options.name`` selects in the options' section,
    from its factory, called with ``options`` and ``ctx``. What the factory raises is
    attributed: an ``OptionError`` becomes a ConfigError at the option's key path, any other
    exception a PluginError naming the component, its plugin and distribution (corellm's own
    errors, which already say what is wrong, pass unchanged). Deprecated interfaces the
    factory uses are reported naming the plugin."""
    section = section_of(options)
    entry = ctx.registry.get(section, options.name)
    path = path or section
    if not isinstance(options, entry.spec.options):
        # Options made in code rather than by load_config (a delegate's default is the
        # section's base options): read them with the component's own model.
        try:
            options = entry.spec.options.model_validate(
                {**options.model_dump(exclude_unset=True, serialize_as_any=True),
                 "name": options.name})
        except ValidationError as exc:
            raise ConfigError([(f"{path}.{'.'.join(map(str, e['loc']))}", e["msg"])
                               for e in exc.errors()]) from None
    outer, ctx.path = ctx.path, path
    try:
        return call_factory(entry, path, options, ctx)
    finally:
        ctx.path = outer
