"""Typed objects that registration hooks yield, and the option models of each section.

Public through ``corellm.components``, which adds the ``BuildContext`` their factories receive.
A plugin registers a component by yielding a spec, e.g.::

    SchedulerSpec(name="fcfs", factory=make_fcfs, options=FCFSOptions, summary="...")

The factory is called only if the config selects the component, so heavy imports belong inside it.
Each options model is pydantic with ``extra="forbid"``: its fields are the section's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from corellm.arch import ModelArchConfig


# --------------------------------------------------------------------------- option models
class ComponentOptions(BaseModel):
    """Base of every section's options: ``name`` selects the plugin, the rest is the plugin's."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str


class SchedulerOptions(ComponentOptions):
    """Options every scheduler understands (the shared batching mechanism's knobs)."""

    name: str = "fcfs"
    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step, prefill and decode together.")
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts across steps to fit the token budget.")
    max_num_seqs_per_request: int | None = Field(
        None, ge=1, description=(
            "Seats one client request (its n samples and prompts) keeps while other requests "
            "wait for one: beyond it, its waiting samples let the others go first and its "
            "newest running ones are preempted to seat them. Alone, a request may use every "
            "seat. Left out: half of max_num_seqs; max_num_seqs turns the share off."))
    async_scheduling: bool | None = Field(
        None, description=(
            "Overlap steps: plan and prepare step N+1 while the executor runs step N, the "
            "host learning step N's tokens one step later (vLLM's --async-scheduling). "
            "Outputs are the same as the synchronous loop's. Left out: the executor's "
            "default (on where it measured faster: see docs/architecture.md, 'Overlapped "
            "steps'). A scheduler or executor that cannot overlap runs synchronously, "
            "and says why in the log."))

    @property
    def seats_per_request(self) -> int:
        """``max_num_seqs_per_request``, or its default: half the seats (at least one)."""
        share = self.max_num_seqs_per_request
        return share if share is not None else max(1, self.max_num_seqs // 2)


class KVCacheOptions(ComponentOptions):
    name: str = "paged"
    block_size: int = Field(16, ge=1, le=1024, description=(
        "Tokens per KV block. Left out of a config: the platform's default_block_size (128 on "
        "the CPU, 16 on CUDA: vLLM's defaults; longer runs of a request's K/V read faster on a "
        "CPU, shorter ones cache prefixes more finely)."))
    num_blocks: int | None = Field(
        None, ge=1, description="KV blocks in the pool; when absent, sized from memory_gib.")
    memory_gib: float | None = Field(
        None, gt=0, description=(
            "KV-cache memory budget (GiB) used when num_blocks is absent. Left out: the "
            "platform's (1 GiB on the CPU; on CUDA what platform.gpu_memory_utilization "
            "leaves after the weights and a profiling forward at the largest batch)."))


class AttentionOptions(ComponentOptions):
    """``auto`` (the default) lets each worker pick, for its device, the available backend of
    the highest ``auto_priority`` (Triton on CUDA when it is installed, torch SDPA elsewhere);
    naming a backend selects it and its options."""

    name: str = "auto"


class ExecutorOptions(ComponentOptions):
    name: str = "uniproc"


class SamplerOptions(ComponentOptions):
    name: str = "default"


class FrontendOptions(ComponentOptions):
    name: str = "openai"


class CoreLauncherOptions(ComponentOptions):
    """Where the engine core of a client that runs it apart (``corellm serve``, ``AsyncLLM``,
    ``LLM(engine_process=True)``) runs: ``mp``, a process of this machine (the default), or a
    launcher plugin's place (``ray``: a Ray actor somewhere in a cluster)."""

    name: str = "mp"


class PlatformOptions(ComponentOptions):
    """``auto`` (the default) picks, when the config is loaded, the available platform of the
    highest ``auto_priority`` (CUDA where a GPU is visible, else the CPU); naming a platform
    selects it. Options given with ``auto`` are checked against the platform it picks."""

    name: str = "auto"


class NoOptions(ComponentOptions):
    """For components with nothing to configure beyond their name."""


# Each section's base options class -> the section it configures.
SECTION_OF_OPTIONS: dict[type[ComponentOptions], str] = {
    PlatformOptions: "platform", SchedulerOptions: "scheduler", KVCacheOptions: "kv_cache",
    AttentionOptions: "attention", ExecutorOptions: "executor", SamplerOptions: "sampler",
    FrontendOptions: "frontend", CoreLauncherOptions: "core_launcher"}
DELEGATE_MARK = "corellm_delegate"
DELEGATE_DEFAULT = "corellm_delegate_default"


def section_of(options: ComponentOptions | type[ComponentOptions]) -> str:
    """The config section an options object (or class) belongs to, from its section base."""
    cls = options if isinstance(options, type) else type(options)
    for klass in cls.__mro__:
        section = SECTION_OF_OPTIONS.get(klass)
        if section is not None:
            return section
    raise TypeError(f"{cls.__name__} does not subclass one of the section options bases "
                    f"({', '.join(b.__name__ for b in SECTION_OF_OPTIONS)})")


def delegate_field(section: str, *, default: str | None = None,
                   description: str | None = None) -> Any:
    """The ``delegate`` option of a wrapper: the options of the component it wraps, a
    sub-section of the same kind (``{name: <component>, ...its own options}``) that the config
    loader validates against the delegate's own options model, with key paths such as
    ``sampler.delegate.top_k``. Declare it as::

        class TimingOptions(ExecutorOptions):
            name: str = "timing"
            delegate: ExecutorOptions = delegate_field("executor")

    and build the delegate in the factory with ``ctx.build_delegate(options)``. Left out of a
    config, the delegate is the section's default component (``default`` names another); the
    section's shared keys (those of its base options, such as ``kv_cache.block_size`` or
    ``scheduler.max_num_seqs``) are the wrapper's, and the delegate inherits them.
    """
    bases = {v: k for k, v in SECTION_OF_OPTIONS.items()}
    if section not in bases:
        raise ValueError(f"delegate_field: unknown section {section!r}; one of "
                         f"{', '.join(bases)}")
    if section == "attention" and default is None:
        # attention's own default, auto, is chosen per device for the section only
        raise ValueError("delegate_field: an attention delegate needs a default backend "
                         "(default='torch_sdpa', say)")
    base = bases[section]

    def make() -> ComponentOptions:
        return base() if default is None else base(name=default)

    return Field(default_factory=make, description=description or (
        f"The {section} component this one wraps, with its own options "
        f"({{name: ..., ...}}); default: {default or base.model_fields['name'].default}."),
        json_schema_extra={DELEGATE_MARK: section, DELEGATE_DEFAULT: default})


def delegate_fields(options: type[ComponentOptions]) -> dict[str, tuple[str, str | None]]:
    """The options model's delegate fields (see ``delegate_field``) -> (their section, the
    component name they default to, or None for the section's default)."""
    out = {}
    for name, info in options.model_fields.items():
        extra = info.json_schema_extra
        if isinstance(extra, dict) and DELEGATE_MARK in extra:
            default = extra.get(DELEGATE_DEFAULT)
            out[name] = (str(extra[DELEGATE_MARK]), None if default is None else str(default))
    return out


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    """A component a plugin offers. ``name`` is unique per kind, lower-case."""

    kind: ClassVar[str] = ""
    section: ClassVar[str] = ""
    name: str
    factory: Callable[..., Any]
    options: type[ComponentOptions] = NoOptions
    summary: str = ""
    # Why the component cannot be used here (say, an optional dependency is missing), or None.
    # It is still listed (``corellm plugins`` shows the reason) and selecting it is a config
    # error that gives the reason.
    unavailable: str | None = None


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec(ComponentSpec):
    """``factory(options, ctx) -> Scheduler``; ``ctx.kv_cache_manager`` is set."""

    kind: ClassVar[str] = "scheduler"
    section: ClassVar[str] = "scheduler"
    options: type[ComponentOptions] = SchedulerOptions


@dataclass(frozen=True, kw_only=True)
class KVCacheManagerSpec(ComponentSpec):
    """``factory(options, ctx) -> KVCacheManager``; ``ctx.num_kv_blocks`` is set."""

    kind: ClassVar[str] = "kv_cache_manager"
    section: ClassVar[str] = "kv_cache"
    options: type[ComponentOptions] = KVCacheOptions


def _any_device(device: Any) -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class AttentionBackendSpec(ComponentSpec):
    """``factory(options, ctx) -> AttentionBackend``; called in each worker.

    ``check_device(device) -> reason or None``: why the backend cannot run on a
    ``torch.device`` (checked in each worker before the factory is called). ``auto_priority``:
    ``attention.name: auto`` picks, among the available backends that can run on the device
    and list its type in ``auto_device_types`` (None: any), the one of the highest priority;
    None keeps a backend out of ``auto`` (selected by name only).
    """

    kind: ClassVar[str] = "attention_backend"
    section: ClassVar[str] = "attention"
    options: type[ComponentOptions] = AttentionOptions
    check_device: Callable[[Any], str | None] = _any_device
    auto_priority: int | None = None
    auto_device_types: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ExecutorSpec(ComponentSpec):
    """``factory(options, ctx) -> Executor``.

    ``tensor_parallel``: the executor runs ``parallel.tensor_parallel_size`` workers (one per
    rank); otherwise a size above 1 is a config error, except for a wrapper (options with a
    ``delegate_field``), which runs as many as its delegate does. ``launcher_worker(config, registry) ->
    exit status``: what a process of rank > 0 runs when a launcher such as ``torchrun`` started
    every rank (``parallel.init_method: env://``): ``corellm serve`` and ``corellm generate``
    call it there instead of building an engine. ``runs_model`` (plugin API 1.3): False for an
    executor that runs no model on this machine (a simulator): the engine then neither builds
    the platform nor resolves attention backends, whose devices it never uses, and its
    ``EngineSetup`` has ``device_type`` "none", no attention candidates and the checkpoint's
    dtype. A wrapper runs a model when its delegate does.
    """

    kind: ClassVar[str] = "executor"
    section: ClassVar[str] = "executor"
    options: type[ComponentOptions] = ExecutorOptions
    tensor_parallel: bool = False
    launcher_worker: Callable[..., int] | None = None
    runs_model: bool = True


@dataclass(frozen=True, kw_only=True)
class CoreLauncherSpec(ComponentSpec):
    """Plugin API 1.13: ``factory(options, config) -> corellm.engine.core_process.CoreLauncher``,
    called by a client that runs the engine core apart from itself (``corellm serve``,
    ``AsyncLLM``, ``LLM(engine_process=True)``), once per engine core it starts (each
    data-parallel replica, and each restart of one). The launcher places the core, binds the
    client's two sockets where the core can reach them, and watches and stops it.
    ``on_this_machine``: its cores run on the client's machine (a data-parallel server then
    gives each CPU replica its own slice of the CPUs).
    """

    kind: ClassVar[str] = "core_launcher"
    section: ClassVar[str] = "core_launcher"
    options: type[ComponentOptions] = CoreLauncherOptions
    on_this_machine: bool = True


@dataclass(frozen=True, kw_only=True)
class SamplerSpec(ComponentSpec):
    """``factory(options, ctx) -> Sampler``; called in each worker."""

    kind: ClassVar[str] = "sampler"
    section: ClassVar[str] = "sampler"
    options: type[ComponentOptions] = SamplerOptions


def _no_check(params: Any) -> None:
    return None


@dataclass(frozen=True, kw_only=True)
class LogitsProcessorSpec(ComponentSpec):
    """Plugin API 1.4: ``factory(options, ctx) -> LogitsProcessor``, called in the worker that
    samples (``ctx.setup``, ``ctx.device`` and ``ctx.platform`` are set).

    Every available logits processor is enabled unless the config's ``logits_processors.enable``
    lists the ones to use (or ``plugins.disable`` removes its plugin); each constrains only the
    requests that ask for it, so an enabled processor costs the others nothing.
    ``validate(params)`` runs where requests come in, before one enters the engine: it raises
    ``ValueError`` (or ``corellm.errors.InvalidRequestError`` naming the field) for parameters
    this processor would refuse, which the caller gets as a 400 / ``InvalidRequestError`` (any
    other exception is the plugin's fault: a ``PluginError``); it may be called off the event
    loop, in a thread, or (the server) in a child process that is killed when it takes longer
    than ``frontend.limits.constraints.check_timeout_s``. ``validate_imports`` (plugin API
    1.5): modules ``validate`` imports, which such a process imports ahead (once, in its fork
    server). ``structured_outputs``:
    the processor implements ``SamplingParams.structured_outputs`` (JSON schema, regex,
    choice, grammar); the enabled one of the highest ``priority`` serves them. ``constrains``
    (plugin API 1.6): ``constrains(params) -> bool``, the requests it constrains, which the
    engine runs without overlapped steps (``constrains_request``). ``extra_args`` (plugin API
    1.7): the keys of ``SamplingParams.extra_args`` it reads; a request that uses one while the
    processor is installed but not enabled is refused, naming the key and the processor,
    instead of running unconstrained.
    """

    kind: ClassVar[str] = "logits_processor"
    section: ClassVar[str] = "logits_processors"
    validate: Callable[[Any], None] = _no_check
    validate_imports: tuple[str, ...] = ()
    structured_outputs: bool = False
    priority: int = 0
    constrains: Callable[[Any], bool] | None = None
    extra_args: tuple[str, ...] = ()

    def constrains_request(self, params: Any) -> bool:
        """Whether this processor may constrain a request with these ``SamplingParams``:
        ``constrains(params)`` (plugin API 1.6), or, left out, the requests with
        ``structured_outputs`` for a structured-output processor and every request for
        another. The engine runs the steps of such requests synchronously (a processor may
        defer a row or fail a request, and an overlapped step is planned before either is
        known)."""
        if self.constrains is not None:
            return bool(self.constrains(params))
        return params.structured_outputs is not None or not self.structured_outputs


@dataclass(frozen=True, kw_only=True)
class FrontendSpec(ComponentSpec):
    """``factory(options, ctx) -> Frontend``."""

    kind: ClassVar[str] = "frontend"
    section: ClassVar[str] = "frontend"
    options: type[ComponentOptions] = FrontendOptions


@dataclass(frozen=True, kw_only=True)
class ModelSpec(ComponentSpec):
    """A model implementation, chosen by the checkpoint's ``architectures`` (config.json).

    ``config_class`` parses the checkpoint's config: a ``corellm.arch.ModelArchConfig``
    subclass (its ``from_dict``), by default the core's Llama-family ``LlamaArchConfig``.
    ``factory(arch, ctx) -> CausalLM`` receives that parsed config; ``ctx.device``,
    ``ctx.dtype``, ``ctx.attention_backend`` and ``ctx.max_model_len`` are set and the factory
    builds the module on them.
    """

    kind: ClassVar[str] = "model"
    section: ClassVar[str] = "model"
    architectures: Sequence[str] = field(default=())
    config_class: type[ModelArchConfig] | None = None


@dataclass(frozen=True, kw_only=True)
class ToolParserSpec(ComponentSpec):
    """A tool-call format (plugin API 1.8): ``factory(tools) -> ToolParser``, called once for
    each choice (of ``n``) of a chat request that may call tools
    (``corellm.interfaces.ToolParser``), with the request's ``tools``. Selected by name
    (``frontend.tool_call_parser``, vLLM's ``--tool-call-parser``). ``special_tokens``: the
    format's tags are special tokens (Mistral's ``[TOOL_CALLS]``), so requests it parses are
    detokenized with ``skip_special_tokens`` off."""

    kind: ClassVar[str] = "tool_parser"
    section: ClassVar[str] = "tool_parser"
    special_tokens: bool = False


@dataclass(frozen=True, kw_only=True)
class ReasoningParserSpec(ComponentSpec):
    """A reasoning format (plugin API 1.8): ``factory() -> ReasoningParser``, once for each
    choice of a chat request (``corellm.interfaces.ReasoningParser``). Selected by name
    (``frontend.reasoning_parser``, vLLM's ``--reasoning-parser``). ``special_tokens`` as
    ``ToolParserSpec``'s."""

    kind: ClassVar[str] = "reasoning_parser"
    section: ClassVar[str] = "reasoning_parser"
    special_tokens: bool = False


#: The version of the platform interface (``Platform``, ``DeviceOps``, ``ModelStepper``). A
#: platform plugin may declare the version it was written for in its spec
#: (``PlatformSpec.interface_version``); another major version is refused at start-up with the
#: plugin's name, rather than failing mid-serving on a missing method.
PLATFORM_INTERFACE_VERSION: tuple[int, int] = (1, 2)


def _available(*_: Any) -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class PlatformSpec(ComponentSpec):
    """A device platform (``corellm.platforms.Platform``): ``factory(options) -> Platform``.

    ``availability() -> reason or None``: why the platform cannot run on this machine (no
    device, no driver), asked lazily (``platform: auto``, ``corellm plugins``), so a probe that
    imports torch costs nothing at discovery. ``auto_priority``: ``platform: auto`` picks the
    available platform of the highest one; None keeps it out of ``auto`` (selected by name
    only, as a reference or test platform should be). ``interface_version``: the major.minor
    of ``corellm.platforms.PLATFORM_INTERFACE_VERSION`` the plugin was written for.
    ``default_block_size`` (plugin API 1.3): the platform's ``Platform.default_block_size``,
    declared here so that a config is validated without building the platform (building one
    imports torch and its kernels; a run that executes no model, such as the simulator's, never
    needs it). None: the platform is built to ask it. ``visible_devices_env`` (plugin API 1.13):
    the environment variable that limits a process to some of the machine's devices
    (``CUDA_VISIBLE_DEVICES``), read before the device runtime starts; an engine-core process
    given ``parallel.device_ids`` sets it, so a data-parallel server's replicas on this machine
    each have devices of their own. None: devices are not split between processes.
    """

    kind: ClassVar[str] = "platform"
    section: ClassVar[str] = "platform"
    options: type[ComponentOptions] = PlatformOptions
    availability: Callable[[], str | None] = _available
    auto_priority: int | None = None
    interface_version: tuple[int, int] = (1, 0)
    default_block_size: int | None = None
    visible_devices_env: str | None = None


@dataclass(frozen=True, kw_only=True)
class CommandSpec(ComponentSpec):
    """A sub-command of the ``corellm`` command line: ``corellm NAME``.

    ``factory(parser)`` declares the command's arguments on the ``argparse.ArgumentParser``
    corellm made for it (``prog`` is ``corellm NAME``; ``summary`` is its line in ``corellm
    --help`` and its description unless the factory sets another) and names the function that
    runs it: ``parser.set_defaults(func=run)`` with ``run(args) -> int``, the exit status. It may
    add nested sub-commands, each setting its own ``func``. The parser is a
    ``corellm.cli.parser.Parser``, as are the nested ones it makes, so a misspelt flag is answered
    with the closest one; give every argument a ``help``. Heavy imports belong inside ``run``:
    every ``corellm`` invocation builds every command's parser. A ``CorellmError`` that ``run``
    raises is printed as ``corellm: error: ...`` with exit status 2, as the built-in commands'
    errors are. The built-in commands' names (``generate``, ``serve``, ``plugins``, ``config``)
    cannot be taken.
    """

    kind: ClassVar[str] = "command"
    section: ClassVar[str] = "command"


SECTION_SPECS: dict[str, type[ComponentSpec]] = {
    spec.section: spec
    for spec in (PlatformSpec, SchedulerSpec, KVCacheManagerSpec, AttentionBackendSpec,
                 ExecutorSpec, SamplerSpec, FrontendSpec, CoreLauncherSpec)
}

DType = Literal["auto", "float32", "bfloat16", "float16"]
