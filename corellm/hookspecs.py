"""Hook specifications: the contract between corellm and its plugins.

A plugin is a module (or object) with functions named after these hooks and decorated with
``corellm.hookimpl``. It is found through the ``corellm`` entry-point group::

    # pyproject.toml of a plugin package
    [project.entry-points.corellm]
    my_policy = "my_package.plugin"

Registration hooks (``corellm_platforms`` ... ``corellm_commands``) are called once, when the
plugin registry is built; each returns an iterable of spec objects from ``corellm.components``.
Every implementation is called and all results are collected (none is "first wins"). Two plugins
may provide one name: selecting it picks an installed plugin over a built-in, and is an error
naming both distributions when two installed plugins provide it (``corellm.plugins.Registry.get``;
``distribution:name`` selects one).

Observer hooks (``corellm_engine_started``, ``corellm_step_finished``, ``corellm_engine_stopped``)
are called by the engine while it runs; they must be cheap, and their return value is ignored.
pluggy stays off the per-token path: no hook is ever called per request or per token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from corellm.specs import (AttentionBackendSpec, CommandSpec, CoreLauncherSpec,
                               ExecutorSpec, FrontendSpec,
                               KVCacheManagerSpec, LogitsProcessorSpec, ModelSpec, PlatformSpec,
                               ReasoningParserSpec, SamplerSpec, SchedulerSpec,
                               ToolParserSpec)
    from corellm.config.schema import EngineConfig
    from corellm.outputs import StepStats

PROJECT_NAME = "corellm"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- registration hooks
@hookspec
def corellm_platforms() -> Iterable[PlatformSpec]:
    """Register device platforms, selected by ``platform.name`` in the config.

    Called once when the registry is built. Return an iterable of ``PlatformSpec``. The factory
    receives the validated options (a subclass of ``PlatformOptions``) and returns a
    ``corellm.platforms.Platform``: the device, its memory, its distributed backend, its dtype
    rules, how a step runs (``ModelStepper``) and the kernels it gives models
    (``corellm.ops.DeviceOps``). ``availability()`` says why it cannot run here;
    ``platform.name: auto`` (the default) picks the available one of the highest
    ``auto_priority``::

        @hookimpl
        def corellm_platforms():
            yield PlatformSpec(name="npu", factory=NpuPlatform, options=NpuOptions,
                               availability=npu_missing_reason, auto_priority=30,
                               summary="Ascend NPUs through torch_npu.")
    """


@hookspec
def corellm_schedulers() -> Iterable[SchedulerSpec]:
    """Register schedulers, selected by ``scheduler.name`` in the config.

    Called once when the registry is built. Return an iterable of ``SchedulerSpec``. The factory
    receives the validated options (a subclass of ``SchedulerOptions``) and a ``BuildContext``
    whose ``kv_cache_manager`` is set; it returns a ``corellm.interfaces.Scheduler``. Most
    policies compose the core's ``BatchScheduler`` with a ``SchedulingPolicy``::

        @hookimpl
        def corellm_schedulers():
            yield SchedulerSpec(
                name="shortest_prompt_first",
                factory=lambda opts, ctx: BatchScheduler(opts, ctx.kv_cache_manager, SPF()),
                summary="Admit the shortest waiting prompt first.",
            )
    """


@hookspec
def corellm_kv_cache_managers() -> Iterable[KVCacheManagerSpec]:
    """Register KV-cache managers, selected by ``kv_cache.name``.

    Called once when the registry is built. Return an iterable of ``KVCacheManagerSpec``. The
    factory receives options (a subclass of ``KVCacheOptions``) and a ``BuildContext`` whose
    ``num_kv_blocks`` is the size of the pool the workers allocated; it returns a
    ``corellm.interfaces.KVCacheManager``.
    """


@hookspec
def corellm_attention_backends() -> Iterable[AttentionBackendSpec]:
    """Register attention backends, selected by ``attention.name``.

    Called once when the registry is built (and once in every worker process). Return an
    iterable of ``AttentionBackendSpec``. The factory runs inside each worker with
    ``ctx.device``, ``ctx.dtype``, ``ctx.arch`` (the parsed checkpoint config) and
    ``ctx.max_model_len`` set, and returns a ``corellm.interfaces.AttentionBackend``.
    ``attention.name: auto`` (the default) picks among the specs with an ``auto_priority`` by
    device; a spec with ``unavailable="reason"`` (a missing optional dependency) is listed but
    refused with the reason.
    """


@hookspec
def corellm_executors() -> Iterable[ExecutorSpec]:
    """Register executors, selected by ``executor.name``.

    Called once when the registry is built. Return an iterable of ``ExecutorSpec``. The factory
    receives options (a subclass of ``ExecutorOptions``) and a ``BuildContext``; it returns a
    ``corellm.interfaces.Executor`` that creates and drives the workers.
    """


@hookspec
def corellm_core_launchers() -> Iterable[CoreLauncherSpec]:
    """Register engine-core launchers (plugin API 1.13), selected by ``core_launcher.name``
    (vLLM's ``--data-parallel-backend``).

    Called once when the registry is built. Return an iterable of ``CoreLauncherSpec``. The
    factory receives options (a subclass of ``CoreLauncherOptions``) and the ``EngineConfig``;
    it returns a ``corellm.engine.core_process.CoreLauncher``: where the engine core of a client
    that runs it apart runs (a process here, a Ray actor on some node), its start, watch and
    stop.
    """


@hookspec
def corellm_samplers() -> Iterable[SamplerSpec]:
    """Register samplers, selected by ``sampler.name``.

    Called once when the registry is built. Return an iterable of ``SamplerSpec``. The factory
    runs inside each worker and returns a ``corellm.interfaces.Sampler``.
    """


@hookspec
def corellm_logits_processors() -> Iterable[LogitsProcessorSpec]:
    """Register logits processors (plugin API 1.4): per-request constraints on the logits,
    applied before the sampler (structured outputs, banned words, biases).

    Called once when the registry is built. Return an iterable of ``LogitsProcessorSpec``. The
    factory runs in the worker that samples and returns a
    ``corellm.interfaces.LogitsProcessor``; ``validate`` runs where requests come in. Every
    available processor is enabled unless ``logits_processors.enable`` lists the ones to use::

        @hookimpl
        def corellm_logits_processors():
            yield LogitsProcessorSpec(name="banned_words", factory=make_banned_words,
                                      validate=check_banned_words,
                                      extra_args=("banned_words",),
                                      summary="Never generate the words extra_args names.")
    """


@hookspec
def corellm_tool_parsers() -> Iterable[ToolParserSpec]:
    """Register tool-call formats (plugin API 1.8): how a model family writes tool calls in
    its output. Called once when the registry is built. Return an iterable of
    ``ToolParserSpec``; the factory makes one ``corellm.interfaces.ToolParser`` for each choice
    of a chat request with ``tools``::

        @hookimpl
        def corellm_tool_parsers():
            yield ToolParserSpec(name="hermes", factory=HermesToolParser,
                                 summary="<tool_call>{json}</tool_call> (Qwen2.5, Qwen3)")
    """


@hookspec
def corellm_reasoning_parsers() -> Iterable[ReasoningParserSpec]:
    """Register reasoning formats (plugin API 1.8): where a reasoning model's thinking ends and
    its answer starts. Called once when the registry is built. Return an iterable of
    ``ReasoningParserSpec``; the factory makes one ``corellm.interfaces.ReasoningParser`` for
    each choice of a chat request."""


@hookspec
def corellm_models() -> Iterable[ModelSpec]:
    """Register model implementations for checkpoint architectures.

    Called once when the registry is built. Return an iterable of ``ModelSpec``; each lists the
    ``architectures`` strings (as in a Hugging Face ``config.json``) it implements. The model for
    a checkpoint is ``model.implementation`` when set, else the spec listing its architecture
    (an installed plugin's over a built-in's; two installed ones make ``model.implementation``
    necessary). The spec's ``config_class`` (a
    ``corellm.arch.ModelArchConfig`` subclass; default: the core's Llama-family
    ``LlamaArchConfig``) parses the checkpoint's config. The factory receives that parsed config
    and a ``BuildContext`` with ``device``, ``dtype``, ``attention_backend`` and
    ``max_model_len`` set, and returns a module implementing ``corellm.interfaces.CausalLM``
    (docs/plugins.md, "A model").
    """


@hookspec
def corellm_frontends() -> Iterable[FrontendSpec]:
    """Register front ends (servers), selected by ``frontend.name``.

    Called once when the registry is built. Return an iterable of ``FrontendSpec``. The factory
    receives options (a subclass of ``FrontendOptions``) and a ``BuildContext``; it returns a
    ``corellm.interfaces.Frontend``.
    """


@hookspec
def corellm_commands() -> Iterable[CommandSpec]:
    """Register sub-commands of the ``corellm`` command line (``corellm NAME``).

    Called once when the registry is built, as every registration hook is; only the command
    line calls the specs' factories. Return an iterable of ``CommandSpec``; its
    factory declares the command's arguments on the parser corellm made for it and sets the
    function that runs it (``parser.set_defaults(func=run)``)::

        @hookimpl
        def corellm_commands():
            yield CommandSpec(name="trace", factory=add_trace_arguments,
                              summary="record a step trace of one config")

    ``corellm bench`` is registered this way by the built-in ``bench`` plugin.
    """


# --------------------------------------------------------------------------- observer hooks
@hookspec
def corellm_engine_started(config: EngineConfig, engine_id: str) -> None:
    """Called once when an engine core has built its components and allocated its KV cache,
    before the first step. ``config`` is the fully validated configuration; ``engine_id`` names
    this engine (several can run in one process) and is repeated in every ``StepStats`` and in
    ``corellm_engine_stopped``. Return value ignored.
    """


@hookspec
def corellm_step_finished(stats: StepStats) -> None:
    """Called after every engine step that scheduled work, with that step's ``StepStats``
    (tokens scheduled, phase timings, a scheduler snapshot). Metrics sinks implement this.

    Runs on the engine's hot loop: keep it to microseconds (hand work to a thread if it is
    slower). Return value ignored. The engine does not call it at all when no plugin implements
    it.
    """


@hookspec
def corellm_engine_stopped(engine_id: str, config: EngineConfig,
                           error: BaseException | None) -> None:
    """Called once for every engine whose ``corellm_engine_started`` was called, when it shuts
    down: flush and close sinks here. ``error`` is None on a normal shutdown (``LLM.shutdown()``,
    the end of a ``with LLM(...)`` block, a server's exit, or interpreter exit for an engine
    never shut down), or the exception that brought the engine down (a failed step in an engine
    process). Every implementation is called even if another raises; exceptions are logged, never
    raised, so a sink cannot mask the engine's own error. Return value ignored.
    """
