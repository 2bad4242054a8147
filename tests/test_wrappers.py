"""Wrapping a component: a ``delegate`` sub-section validated against the delegate's own
options, built with ``ctx.build_delegate``, for a wrapper of each kind; and factory errors of
every kind attributed to their plugin and key path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import Field

from corellm import LLM, SamplingParams
from corellm.components import (AttentionBackendSpec, AttentionOptions, BuildContext,
                                ExecutorOptions, ExecutorSpec, FrontendOptions, FrontendSpec,
                                KVCacheManagerSpec, KVCacheOptions, PlatformOptions, PlatformSpec,
                                SamplerOptions, SamplerSpec, SchedulerOptions, SchedulerSpec,
                                delegate_field)
from corellm.config.compose import load_config
from corellm.errors import ConfigError, OptionError, PluginError
from corellm.interfaces import Frontend
from corellm.plugins.discovery import load_registry
from corellm.platforms import ModelStepper
from corellm.wrappers import (AttentionBackendWrapper, ExecutorWrapper, FrontendWrapper,
                              KVCacheManagerWrapper, PlatformWrapper, SamplerWrapper,
                              SchedulerWrapper)
from tests.conftest import assert_pool_whole, engine_config

REPO = Path(__file__).resolve().parents[1]
TIMING = REPO / "examples" / "corellm-timing-executor"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + (i * 7 + j * 3) % 200 for j in range(6 + 5 * i)]}
           for i in range(5)]


# --------------------------------------------------------------------------- wrappers of each kind
class Counting:
    """Wrappers of every kind, each counting the calls it adds to."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def corellm_schedulers(self):
        class Options(SchedulerOptions):
            name: str = "counting"
            delegate: SchedulerOptions = delegate_field("scheduler")

        outer = self

        class Wrapped(SchedulerWrapper):
            def schedule(self):
                outer.count("schedule")
                return super().schedule()

        yield SchedulerSpec(name="counting", options=Options,
                            factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))

    def corellm_kv_cache_managers(self):
        class Options(KVCacheOptions):
            name: str = "counting"
            delegate: KVCacheOptions = delegate_field("kv_cache")

        outer = self

        class Wrapped(KVCacheManagerWrapper):
            def allocate_slots(self, request, num_new_tokens, prefix=None):
                outer.count("allocate_slots")
                return super().allocate_slots(request, num_new_tokens, prefix)

        yield KVCacheManagerSpec(name="counting", options=Options,
                                 factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))

    def corellm_attention_backends(self):
        class Options(AttentionOptions):
            name: str = "counting"
            delegate: AttentionOptions = delegate_field("attention", default="torch_sdpa")

        outer = self

        class Wrapped(AttentionBackendWrapper):
            def forward(self, layer, query, key, value, kv_cache, metadata):
                outer.count("attention")
                return super().forward(layer, query, key, value, kv_cache, metadata)

        yield AttentionBackendSpec(name="counting", options=Options,
                                   factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))

    def corellm_executors(self):
        class Options(ExecutorOptions):
            name: str = "counting"
            delegate: ExecutorOptions = delegate_field("executor")

        outer = self

        class Wrapped(ExecutorWrapper):
            def execute_model(self, plan):
                outer.count("execute_model")
                return super().execute_model(plan)

        yield ExecutorSpec(name="counting", options=Options,
                           factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))

    def corellm_samplers(self):
        class Options(SamplerOptions):
            name: str = "counting"
            delegate: SamplerOptions = delegate_field("sampler")

        outer = self

        class Wrapped(SamplerWrapper):
            def __call__(self, logits, md):
                outer.count("sample")
                return super().__call__(logits, md)

        yield SamplerSpec(name="counting", options=Options,
                          factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))

    def corellm_frontends(self):
        class Echo(Frontend):
            def __init__(self, status):
                self.status = status

            def run(self):
                return self.status

        class EchoOptions(FrontendOptions):
            name: str = "echo"
            status: int = Field(0, ge=0, le=255)

        class Options(FrontendOptions):
            name: str = "counting"
            delegate: FrontendOptions = delegate_field("frontend", default="echo")

        outer = self

        class Wrapped(FrontendWrapper):
            def run(self):
                outer.count("run")
                return super().run()

        yield FrontendSpec(name="echo", options=EchoOptions, factory=lambda o, ctx: Echo(o.status))
        yield FrontendSpec(name="counting", options=Options,
                           factory=lambda o, ctx: Wrapped(ctx.build_delegate(o)))


def _outputs(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_wrapper_of_each_kind_changes_nothing_it_does_not_add(llama_path):
    base = engine_config(llama_path, scheduler={"max_num_seqs": 3})
    with LLM(base) as llm:
        ref = _outputs(llm)
    plugin = Counting()
    cfg = engine_config(
        llama_path, scheduler={"name": "counting", "max_num_seqs": 3},
        kv_cache={"name": "counting", "delegate": {"name": "paged",
                                                   "enable_prefix_caching": False}},
        attention={"name": "counting"}, executor={"name": "counting"},
        sampler={"name": "counting", "delegate": {"name": "default"}})
    with LLM(cfg, plugins=[plugin]) as llm:
        assert _outputs(llm) == ref
        assert_pool_whole(llm)
        llm.engine.kv_cache_manager.check_invariants()     # forwarded to the paged manager
        config = llm.config
    for what in ("schedule", "allocate_slots", "attention", "execute_model", "sample"):
        assert plugin.calls.get(what, 0) > 0, (what, plugin.calls)
    # The delegates got their own options, and the section's shared keys.
    assert config.kv_cache.delegate.enable_prefix_caching is False
    assert config.kv_cache.delegate.block_size == config.kv_cache.block_size == 16
    assert config.scheduler.delegate.name == "fcfs"
    assert config.scheduler.delegate.max_num_seqs == 3
    assert config.attention.delegate.name == "torch_sdpa"
    dumped = config.to_dict()
    assert dumped["kv_cache"]["delegate"]["enable_prefix_caching"] is False


def test_the_delegates_own_options_are_validated_with_key_paths(llama_path):
    reg = load_registry(plugins=[Counting()])
    with pytest.raises(ConfigError) as info:
        load_config(engine_config(
            llama_path,
            scheduler={"name": "counting", "delegate": {"name": "priority",
                                                        "preempt_lower_priorty": False}},
            kv_cache={"name": "counting", "delegate": {"name": "paged", "block_size": 32}},
            sampler={"name": "counting", "delegate": {"name": "defualt"}},
            executor={"name": "counting", "delegate": [1]}), registry=reg)
    problems = dict(info.value.problems)
    assert "did you mean preempt_lower_priority?" in problems[
        "scheduler.delegate.preempt_lower_priorty"]
    assert "scheduler_priority" in problems["scheduler.delegate.preempt_lower_priorty"]
    assert "differs from the wrapper's kv_cache.block_size=16" in problems[
        "kv_cache.delegate.block_size"]
    assert "did you mean 'default'?" in problems["sampler.delegate.name"]
    assert "expected a mapping" in problems["executor.delegate"]
    # A shared key set on the delegate alone must agree with the wrapper's value, its default
    # included: the engine reads the section's (the wrapper's) one.
    with pytest.raises(ConfigError) as info:
        load_config(engine_config(llama_path, scheduler={
            "name": "counting", "delegate": {"name": "fcfs", "max_num_seqs": 8}}), registry=reg)
    assert "differs from the wrapper's scheduler.max_num_seqs=64" in dict(
        info.value.problems)["scheduler.delegate.max_num_seqs"]
    # The same value, spelled as the model reads it, is no contradiction.
    cfg = load_config(engine_config(llama_path, scheduler={
        "name": "counting", "max_num_seqs": "8", "delegate": {"name": "fcfs", "max_num_seqs": 8}}),
        registry=reg)
    assert cfg.scheduler.max_num_seqs == cfg.scheduler.delegate.max_num_seqs == 8
    # Nested wrappers: each level validated against its own component.
    cfg = load_config(engine_config(
        llama_path, sampler={"name": "counting", "delegate": {
            "name": "counting", "delegate": {"name": "default"}}}), registry=reg)
    assert cfg.sampler.delegate.delegate.name == "default"


def test_the_config_schema_points_a_delegate_at_its_section():
    from corellm.config.compose import config_schema
    schema = config_schema(load_registry(plugins=[Counting()]))
    [variant] = [v for v in schema["properties"]["sampler"]["oneOf"]
                 if v["title"] == "sampler: counting"]
    assert variant["properties"]["delegate"]["$ref"] == "#/properties/sampler"


def test_a_frontend_wrapper_builds_and_runs_its_delegate(llama_path):
    plugin = Counting()
    reg = load_registry(plugins=[plugin])
    cfg = load_config(engine_config(llama_path, frontend={
        "name": "counting", "delegate": {"name": "echo", "status": 7}}), registry=reg)
    assert BuildContext(config=cfg, registry=reg).build(cfg.frontend).run() == 7
    assert plugin.calls == {"run": 1}


# --------------------------------------------------------------------------- the example package
@pytest.fixture
def timing_module(monkeypatch):
    # On sys.path, not only imported: the multiproc ranks unpickle the config's options class.
    monkeypatch.syspath_prepend(str(TIMING))
    import corellm_timing
    yield corellm_timing
    sys.modules.pop("corellm_timing", None)


def test_example_timing_executor_in_process(llama_path, tmp_path, timing_module):
    report = tmp_path / "steps.json"
    base = engine_config(llama_path, scheduler={"max_num_seqs": 3})
    with LLM(base) as llm:
        ref = _outputs(llm)
    cfg = {**base, "executor": {"name": "timing", "report": str(report)},
           "plugins": {"disable": ["executor_timing"]}}
    llm = LLM(cfg, plugins=[timing_module])
    try:
        assert _outputs(llm) == ref
        steps = llm.engine.num_steps
    finally:
        llm.shutdown()
    summary = json.loads(report.read_text())
    assert summary["steps"] == steps > 0 and summary["total_s"] > 0


def test_example_timing_executor_wraps_multiproc_under_tensor_parallelism(
        llama_path, tmp_path, timing_module):
    report = tmp_path / "steps.json"
    base = engine_config(llama_path, scheduler={"max_num_seqs": 3})
    with LLM(base) as llm:
        ref = _outputs(llm)
    cfg = {**base, "parallel": {"tensor_parallel_size": 2},
           "executor": {"name": "timing", "report": str(report)},
           "plugins": {"disable": ["executor_timing"]}}
    reg = load_registry(disable=["executor_timing"], plugins=[timing_module])
    config = load_config(cfg, registry=reg)
    assert config.executor.delegate.name == "multiproc"          # TP's default executor
    # A delegate that runs one worker cannot take two ranks, wrapped or not.
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size: 2 needs an executor "
                                          "that runs one worker per rank; executor 'timing'"):
        load_config({**cfg, "executor": {"name": "timing", "delegate": {"name": "uniproc"}}},
                    registry=reg)
    with LLM(cfg, plugins=[timing_module]) as llm:
        assert _outputs(llm) == ref
        assert_pool_whole(llm)
    assert json.loads(report.read_text())["steps"] > 0


def test_torchrun_ranks_find_the_launcher_worker_through_a_wrapper(llama_path, timing_module):
    from corellm.plugins.discovery import executor_launcher_worker
    reg = load_registry(disable=["executor_timing"], plugins=[timing_module])
    cfg = load_config(engine_config(llama_path, executor={"name": "timing"},
                                    parallel={"tensor_parallel_size": 2,
                                              "init_method": "env://"}), registry=reg)
    run = executor_launcher_worker(cfg.executor, reg)
    assert run is reg.get("executor", "multiproc").spec.launcher_worker


# --------------------------------------------------------------------------- factory errors
class Failing:
    """A component of each kind whose factory raises, one of them with an OptionError."""

    def corellm_executors(self):
        yield ExecutorSpec(name="bad", factory=_raise("executor"))

    def corellm_kv_cache_managers(self):
        yield KVCacheManagerSpec(name="bad", factory=_raise("kv"))

    def corellm_schedulers(self):
        yield SchedulerSpec(name="bad", factory=_raise("scheduler"))

    def corellm_samplers(self):
        yield SamplerSpec(name="bad", factory=_raise("sampler"))

    def corellm_attention_backends(self):
        yield AttentionBackendSpec(name="bad", factory=_raise("attention"))

    def corellm_frontends(self):
        yield FrontendSpec(name="bad", factory=_raise("frontend"))


def _raise(what):
    def factory(options, ctx):
        raise RuntimeError(f"{what} factory broke")
    return factory


class _OptionFailing:
    def corellm_samplers(self):
        class Options(SamplerOptions):
            name: str = "picky"
            vocab_file: str = "missing.txt"

        def make(options, ctx):
            raise OptionError("vocab_file", f"{options.vocab_file!r} does not exist")

        class Outer(SamplerOptions):
            name: str = "outer"
            delegate: SamplerOptions = delegate_field("sampler", default="picky")

        yield SamplerSpec(name="picky", options=Options, factory=make)
        yield SamplerSpec(name="outer", options=Outer,
                          factory=lambda o, ctx: SamplerWrapper(ctx.build_delegate(o)))


@pytest.mark.parametrize("section", ["executor", "kv_cache", "scheduler", "sampler",
                                     "attention"])
def test_factory_errors_name_plugin_and_key_path(llama_path, section):
    class Plugin(Failing):
        pass
    plugin = Plugin()
    cfg = engine_config(llama_path, **{section: {"name": "bad"}})
    with pytest.raises(PluginError) as info:
        LLM(cfg, plugins=[plugin])
    msg = str(info.value)
    assert msg.startswith(f"{section}: "), msg
    assert "'bad' of plugin 'Plugin-" in msg and "registered in-process" in msg, msg
    assert "factory broke" in msg and "could not be built" in msg, msg


def test_frontend_factory_error_is_attributed(llama_path):
    reg = load_registry(plugins=[Failing()])
    cfg = load_config(engine_config(llama_path, frontend={"name": "bad"}), registry=reg)
    with pytest.raises(PluginError, match=r"^frontend: frontend 'bad' of plugin 'Failing-.*"
                                          r"could not be built: RuntimeError\('frontend "):
        BuildContext(config=cfg, registry=reg).build(cfg.frontend)


def test_an_option_error_is_a_config_error_at_its_key_path(llama_path):
    with pytest.raises(ConfigError) as info:
        LLM(engine_config(llama_path, sampler={"name": "outer"}), plugins=[_OptionFailing()])
    [(path, msg)] = info.value.problems
    assert path == "sampler.delegate.vocab_file"
    assert "'missing.txt' does not exist" in msg and "sampler 'picky' of plugin" in msg


def test_example_config_file_validates(timing_module, tmp_path):
    data = yaml.safe_load((TIMING / "config.yaml").read_text())
    reg = load_registry(disable=["executor_timing"], plugins=[timing_module])
    cfg = load_config({**data, "model": {}}, registry=reg)
    assert cfg.executor.name == "timing" and cfg.executor.delegate.name == "uniproc"


def test_platform_factory_error_is_attributed(llama_path):
    from corellm.components import PlatformSpec

    class Boom:
        def corellm_platforms(self):
            yield PlatformSpec(name="boom", factory=lambda options: _raise("platform")(
                options, None))

    reg = load_registry(plugins=[Boom()])
    with pytest.raises(PluginError, match=r"^platform: platform 'boom' of plugin 'Boom-.*could "
                                          r"not be built: RuntimeError\('platform factory broke"):
        # kv_cache.block_size left out: its default is the platform's, so the platform is built
        load_config({"model": {"path": str(llama_path)}, "platform": {"name": "boom"}},
                    registry=reg)


def test_model_factory_error_is_attributed(llama_path):
    from corellm.components import ModelSpec

    class Models:
        def corellm_models(self):
            yield ModelSpec(name="broken-llama", architectures=["LlamaForCausalLM"],
                            factory=lambda arch, ctx: 1 / 0)

    with pytest.raises(PluginError, match=r"model 'broken-llama' of plugin 'Models-.*could not "
                                          r"be built for .*ZeroDivisionError"):
        LLM(engine_config(llama_path), plugins=[Models()])


def test_an_attention_delegate_needs_a_named_default():
    with pytest.raises(ValueError, match="attention delegate needs a default backend"):
        delegate_field("attention")


def test_a_delegate_built_from_python_gets_its_own_options_class(llama_path):
    """An EngineConfig made in code holds the delegate's default as the section's base options;
    building it validates them with the delegate's own model (its defaults included)."""
    from corellm.components import SECTION_OF_OPTIONS
    from corellm.config.compose import EngineConfig
    seen = {}

    class Plugin(Counting):
        def corellm_samplers(self):
            yield from super().corellm_samplers()

            class Own(SamplerOptions):
                name: str = "own"
                knob: int = 3

            def make(options, ctx):
                seen["options"] = options
                return SamplerWrapper(ctx.build(SamplerOptions(name="default")))

            yield SamplerSpec(name="own", options=Own, factory=make)

    reg = load_registry(plugins=[Plugin()])
    base = load_config(engine_config(llama_path), registry=reg)
    sampler_base = next(k for k, v in SECTION_OF_OPTIONS.items() if v == "sampler")
    outer = reg.get("sampler", "counting").spec.options(delegate=sampler_base(name="own"))
    config = EngineConfig(**{**dict(base), "sampler": outer})
    assert type(config.sampler.delegate) is sampler_base
    with LLM(config, plugins=[Plugin()]) as llm:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert type(seen["options"]).__name__ == "Own" and seen["options"].knob == 3


def test_factory_errors_that_name_their_cause_keep_their_type(llama_path, tmp_path):
    """A checkpoint the executor cannot read is an OSError (with a note naming the component),
    not a PluginError blaming the executor plugin."""
    class Unreadable:
        def corellm_executors(self):
            def make(options, ctx):
                raise FileNotFoundError(2, "No such file", str(tmp_path / "missing.safetensors"))
            yield ExecutorSpec(name="reads", factory=make)

    with pytest.raises(FileNotFoundError) as info:
        LLM(engine_config(llama_path, executor={"name": "reads"}), plugins=[Unreadable()])
    assert any("while building executor: executor 'reads' of plugin 'Unreadable-" in note
               for note in info.value.__notes__)


def test_wrapper_attributes_can_be_assigned():
    from corellm.kv.paged import PagedKVCacheManager

    inner = PagedKVCacheManager(8, 4)
    wrapped = KVCacheManagerWrapper(inner)
    wrapped.prefix_cache_hits = 5
    assert inner.prefix_cache_hits == wrapped.prefix_cache_hits == 5
    assert wrapped.block_size == 4 and wrapped.num_free_blocks == 8


# --------------------------------------------------------------------------- a platform wrapper
# A third-party platform that extends the built-in CPU platform without its code: it wraps it
# (``delegate``), keeps its kernels and counts the steps it runs (docs/plugins.md quotes it).
class CountingStepper(ModelStepper):
    """Hands every step to the stepper it wraps, counting them."""

    def __init__(self, inner: ModelStepper) -> None:
        super().__init__(inner.model, inner.device)
        self.inner, self.steps = inner, 0

    def forward(self, inputs):
        self.steps += 1
        return self.inner.forward(inputs)


class TracingOptions(PlatformOptions):
    name: str = "tracing"
    delegate: PlatformOptions = delegate_field("platform", default="cpu")


class Tracing(PlatformWrapper):
    def make_stepper(self, model, device, limits):
        return CountingStepper(super().make_stepper(model, device, limits))


class TracingPlatformPlugin:
    def corellm_platforms(self):
        yield PlatformSpec(name="tracing", factory=Tracing, options=TracingOptions)


def test_a_platform_wrapper_keeps_the_platform_it_wraps(llama_path):
    with LLM(engine_config(llama_path, platform={"name": "cpu"})) as llm:
        ref = _outputs(llm)
        cpu_ops = type(llm.engine.executor.worker.platform.ops)
    cfg = engine_config(llama_path, platform={"name": "tracing", "delegate": {"name": "cpu"}})
    with LLM(cfg, plugins=[TracingPlatformPlugin()]) as llm:
        assert _outputs(llm) == ref
        platform = llm.engine.executor.worker.platform
        assert platform.name == "tracing" and platform.inner.name == "cpu"
        assert llm.engine.executor.worker.runner.stepper.steps > 0
        assert type(platform.ops) is cpu_ops          # the built-in's kernels, not the reference
        assert platform.device_type == "cpu" and platform.describe().startswith("tracing over cpu")
        assert llm.config.platform.delegate.name == "cpu"
