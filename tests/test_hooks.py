"""Every hook in corellm/hookspecs.py is documented and exercised here by an in-process plugin,
through the same registry the entry points feed. A new hook without a docstring or without a
`def <hook>` in this file fails test_every_hook_is_documented_and_tested."""

from __future__ import annotations

import inspect
import json
import math
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from corellm import LLM, SamplingParams, hookimpl, hookspecs
from corellm.kv.block_pool import BlockPool
from corellm.components import (AttentionBackendSpec, CommandSpec, ExecutorSpec, FrontendOptions,
                                FrontendSpec, KVCacheManagerSpec, LogitsProcessorSpec, ModelSpec,
                                PlatformSpec, SamplerSpec, SchedulerSpec)
from corellm.config.compose import load_config
from corellm.errors import PluginError
from corellm.interfaces import (AttentionBackend, Executor, Frontend, KVCacheManager,
                                LogitsProcessor, Sampler, SchedulingPolicy)
from corellm.ops import DeviceOps
from corellm.platforms.interface import ModelStepper, Platform
from corellm.plugins.discovery import load_registry
from corellm.sampling import SamplerOutput
from corellm.scheduling import BatchScheduler
from tests.conftest import assert_pool_whole, engine_config

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("corellm_"))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_every_hook_is_documented_and_tested():
    this_file = Path(__file__).read_text()
    for name in HOOKS:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc) > 80, f"{name} needs a docstring saying when it is called and what it returns"
        assert "Called" in doc or "called" in doc, f"{name}: say when it is called"
        test_name = "test_" + name
        assert f"def {test_name}(" in this_file, f"{name} has no {test_name} in {__file__}"


# --------------------------------------------------------------------------- schedulers
class LIFOPolicy(SchedulingPolicy):
    def waiting_key(self, request, ctx):
        return -request.arrival_seq

    def choose_victim(self, running, ctx):
        return running[0]


class LIFOPlugin:
    def corellm_schedulers(self):
        yield SchedulerSpec(name="lifo", summary="newest first",
                            factory=lambda o, ctx: BatchScheduler(o, ctx.kv_cache_manager, LIFOPolicy()))


def test_corellm_schedulers(llama_path):
    llm = LLM(engine_config(llama_path, scheduler={"name": "lifo", "max_num_seqs": 1}),
              plugins=[LIFOPlugin()])
    assert isinstance(llm.engine.scheduler.policy, LIFOPolicy)
    finished = []
    for i in range(3):
        llm.engine.add_request(_core_request(str(i)))
    while llm.engine.has_unfinished_requests():
        finished += [o.request_id for o in llm.engine.step() if o.finished]
    assert finished == ["2", "1", "0"]
    assert_pool_whole(llm)


def _core_request(rid):
    import time
    from corellm.request import EngineCoreRequest
    from corellm.sampling_params import SamplingParams as SP
    return EngineCoreRequest(rid, [5, 6, 7], SP(max_tokens=2, ignore_eos=True), None, time.time())


# --------------------------------------------------------------------------- KV managers
class CountingKV(KVCacheManager):
    """A minimal KV manager built on the core BlockPool, counting its calls."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self.allocations = 0

    @property
    def num_free_blocks(self):
        return self.pool.num_free_blocks

    def allocate_slots(self, request, n, prefix=None):
        # No find_cached_prefix override: any prefix passed is the empty one.
        assert prefix is None or prefix.num_tokens == 0
        table = self.tables.setdefault(request.request_id, [])
        need = math.ceil((request.num_computed_tokens + n) / self.block_size) - len(table)
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(max(need, 0))
        table += new
        self.allocations += len(new)
        return new

    def free(self, request):
        self.pool.free(self.tables.pop(request.request_id, []))

    def get_block_ids(self, request):
        return self.tables.get(request.request_id, [])


class KVPlugin:
    def corellm_kv_cache_managers(self):
        yield KVCacheManagerSpec(name="counting",
                                 factory=lambda o, ctx: CountingKV(ctx.num_kv_blocks, o.block_size))


def test_corellm_kv_cache_managers(llama_path):
    llm = LLM(engine_config(llama_path, kv_cache={"name": "counting"}), plugins=[KVPlugin()])
    out = llm.generate("hello hooks", GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert llm.engine.kv_cache_manager.allocations > 0
    assert_pool_whole(llm)


def test_kv_cache_manager_with_the_old_signature_is_named_at_start_up(llama_path):
    """A manager written against corellm 0.1 (allocate_slots without ``prefix``) fails when the
    engine is built, with the plugin named, not at the first step."""
    class OldKV(CountingKV):
        def allocate_slots(self, request, n):
            return super().allocate_slots(request, n)

    class OldPlugin:
        def corellm_kv_cache_managers(self):
            yield KVCacheManagerSpec(name="old", factory=lambda o, ctx: OldKV(ctx.num_kv_blocks,
                                                                             o.block_size))

    with pytest.raises(PluginError, match=r"registered in-process\): OldKV.allocate_slots\(request, "
                       r"n\) does not accept the `prefix` argument"):
        LLM(engine_config(llama_path, kv_cache={"name": "old"}), plugins=[OldPlugin()])


# --------------------------------------------------------------------------- attention
class NaiveAttention(AttentionBackend):
    """Reference paged attention: explicit softmax(QK^T)V per request, per head, from the cache."""

    def __init__(self):
        self.calls = 0

    def kv_cache_spec(self, layer, num_blocks, block_size, dtype):
        from corellm.attention import KVCacheSpec
        return KVCacheSpec((2, num_blocks * block_size, layer.num_kv_heads, layer.head_size),
                           dtype)   # flat slots

    def forward(self, layer, q, k, v, kv_cache, md):
        self.calls += 1
        kv_cache[0, md.slot_mapping] = k
        kv_cache[1, md.slot_mapping] = v
        out = torch.empty_like(q)
        group = layer.num_heads // layer.num_kv_heads
        bs = md.block_size
        for i in range(md.num_reqs):
            s, e = md.query_start_loc_list[i], md.query_start_loc_list[i + 1]
            ctx, seq = md.context_lens_list[i], md.seq_lens_list[i]
            pos = torch.arange(seq)
            slots = md.block_table[i, pos // bs] * bs + pos % bs
            keys = kv_cache[0, slots].repeat_interleave(group, dim=1)       # [seq, H, D]
            vals = kv_cache[1, slots].repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q[s:e], keys) * layer.scale
            causal = pos[None, :] <= (ctx + torch.arange(e - s))[:, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        return out


class NaiveAttentionPlugin:
    def __init__(self):
        self.backend = NaiveAttention()

    def corellm_attention_backends(self):
        yield AttentionBackendSpec(name="naive", factory=lambda o, ctx: self.backend)


def test_corellm_attention_backends(llama_path):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 20, 45)]
    plugin = NaiveAttentionPlugin()
    naive = LLM(engine_config(llama_path, attention={"name": "naive"},
                              scheduler={"max_num_batched_tokens": 24}), plugins=[plugin])
    sdpa = LLM(engine_config(llama_path))
    a = [o.outputs[0].token_ids for o in naive.generate(prompts, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in sdpa.generate(prompts, GREEDY, use_tqdm=False)]
    assert a == b
    assert plugin.backend.calls > 0


def test_attention_backend_of_the_old_interface_is_named(llama_path):
    """A backend still defining kv_cache_shape (an interface older than plugin API 1.0) fails at
    start-up with the plugin named and the fix."""
    class OldBackend(AttentionBackend):
        def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
            return (2, num_blocks, block_size, num_kv_heads, head_size)

        def forward(self, layer, q, k, v, kv_cache, md):
            raise AssertionError("never reached")

    class OldPlugin:
        def corellm_attention_backends(self):
            yield AttentionBackendSpec(name="old", factory=lambda o, ctx: OldBackend())

    with pytest.raises(PluginError, match=r"attention backend 'old' of plugin .*registered "
                       r"in-process\): Can't instantiate abstract class OldBackend.*kv_cache_spec"
                       r".*older than plugin API 1.0, which replaced kv_cache_shape"):
        LLM(engine_config(llama_path, attention={"name": "old"}), plugins=[OldPlugin()])


def test_attention_backend_keeping_build_metadata_is_named(llama_path):
    """Half-migrated: kv_cache_spec written, build_metadata kept (nothing would call it)."""
    class HalfBackend(NaiveAttention):
        def build_metadata(self, common):
            return common

    class HalfPlugin:
        def corellm_attention_backends(self):
            yield AttentionBackendSpec(name="half", factory=lambda o, ctx: HalfBackend())

    with pytest.raises(PluginError, match=r"HalfBackend defines build_metadata\(\), which "
                       r"nothing calls any more. It was written for an attention interface older"):
        LLM(engine_config(llama_path, attention={"name": "half"}), plugins=[HalfPlugin()])


def test_auto_passes_over_a_backend_that_refuses_the_model(llama_path, caplog):
    """attention.name: auto checks each candidate, best first, against the layers the
    checkpoint implies: a higher-priority backend that refuses head size 16 is passed over."""
    made = []

    class Picky(NaiveAttention):
        def supports(self, layer, dtype, device):
            return f"head_size {layer.head_size} is not supported (supported: 128)"

    class PickyPlugin:
        def corellm_attention_backends(self):
            yield AttentionBackendSpec(name="picky", factory=lambda o, ctx: made.append(1)
                                       or Picky(), auto_priority=1000)

    with caplog.at_level("INFO", logger="corellm.worker.model_runner"):
        with LLM(engine_config(llama_path), plugins=[PickyPlugin()]) as llm:
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) > 0
            runner = llm.engine.executor.worker.runner
            assert runner.attn_entry.spec.name == "torch_sdpa"
    assert made == [1]
    assert "auto -> torch_sdpa on cpu (not triton: " in caplog.text
    assert "; not picky: head_size 16 is not supported (supported: 128))" in caplog.text


# --------------------------------------------------------------------------- executors
class RecordingExecutor(Executor):
    def __init__(self, options, ctx):
        from corellm.worker.worker import Worker
        self.worker = Worker(ctx.config, ctx.registry)
        self.plans = []

    @property
    def model_info(self):
        return self.worker.model_info

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, plan):
        self.plans.append(plan.total_num_scheduled_tokens)
        return self.worker.execute_model(plan)


class ExecutorPlugin:
    def corellm_executors(self):
        yield ExecutorSpec(name="recording", factory=RecordingExecutor)


def test_corellm_executors(llama_path):
    llm = LLM(engine_config(llama_path, executor={"name": "recording"}), plugins=[ExecutorPlugin()])
    llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, use_tqdm=False)
    assert llm.engine.executor.plans == [3] + [1] * 7


# --------------------------------------------------------------------------- core launchers
class LauncherPlugin:
    """A launcher that runs the core where ``mp`` does, recording the client's calls and
    saying where the core is in words of its own."""

    def corellm_core_launchers(self):
        from corellm.components import CoreLauncherOptions, CoreLauncherSpec
        from corellm.engine.core_process import _CoreProcess

        class Recording(_CoreProcess):
            calls: list = []

            @property
            def where(self):
                return f"recorded core, pid {self.pid}"

            def bind(self, sock, which):
                self.calls.append(f"bind {which}")
                super().bind(sock, which)

            def start(self, config, max_outputs_ahead=None):
                self.calls.append("start")
                return super().start(config, max_outputs_ahead)

            def stop(self, send_shutdown, timeout=10.0):
                self.calls.append("stop")
                super().stop(send_shutdown, timeout)

        # (the config travels to the core: its options class must be importable there)
        yield CoreLauncherSpec(name="recording", factory=lambda options, config: Recording(),
                               options=CoreLauncherOptions)


def test_corellm_core_launchers(llama_path):
    from corellm.engine.core_client import SyncMPClient
    registry = load_registry(plugins=[LauncherPlugin()])
    config = load_config(engine_config(llama_path, parallel={"data_parallel_backend":
                                                             "recording"}), registry)
    assert config.core_launcher.name == "recording"      # vLLM's spelling is the same key
    client = SyncMPClient(config, registry)
    try:
        assert client.process.calls == ["bind input", "bind output", "start"]
        assert client.process.where == f"recorded core, pid {client.pid}"
        assert client.call_utility("get_stats").kv_blocks_total > 0   # the core answers
    finally:
        client.shutdown()
    assert client.process.calls[-1] == "stop"


def test_an_allow_list_without_the_mp_launcher_still_runs_in_process(llama_path, monkeypatch):
    """The default launcher is needed only where a core is launched: an in-process engine runs
    under an allow-list that leaves it out; a core run apart is refused naming the key."""
    from corellm.errors import ConfigError
    monkeypatch.setenv("CORELLM_PLUGINS", "platform_cpu,scheduler_fcfs,kv_paged,attn_torch_sdpa,"
                                          "executor_uniproc,sampler_default,models_llama")
    llm = LLM(engine_config(llama_path))
    try:
        assert llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match=r"core_launcher.name: unknown core_launcher 'mp'"):
        LLM(engine_config(llama_path), engine_process=True)


# --------------------------------------------------------------------------- platforms
class CountingOps(DeviceOps):
    """The reference ops, counting what the model asked of them."""

    def __init__(self):
        self.calls = {"linear": 0, "rms_norm": 0, "rotary": 0, "argmax": 0, "prepare": 0}

    def prepare(self, model):
        self.calls["prepare"] += 1

    def linear(self, layer, x, bias):
        self.calls["linear"] += 1
        return super().linear(layer, x, bias)

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return super().rms_norm(x, weight, eps)

    def rotary(self, positions, q, k, cos, sin, rotary_dim):
        self.calls["rotary"] += 1
        return super().rotary(positions, q, k, cos, sin, rotary_dim)

    def argmax(self, logits):
        self.calls["argmax"] += 1
        return super().argmax(logits)


class CountingPlatform(Platform):
    device_type = "cpu"
    default_block_size = 32

    def __init__(self, options):
        super().__init__(options)
        self.counting = CountingOps()
        self.steps = 0

    def device(self, local_rank=0):
        return torch.device("cpu")

    def free_memory(self, device, local_world_size=1):
        return None

    @property
    def ops(self):
        return self.counting

    def shutdown(self):
        self.shutdowns = getattr(self, "shutdowns", 0) + 1

    def make_stepper(self, model, device, limits):
        platform = self

        class Counted(ModelStepper):
            def forward(self, inputs):
                platform.steps += 1
                return super().forward(inputs)
        return Counted(model, device)


class PlatformPlugin:
    def corellm_platforms(self):
        yield PlatformSpec(name="counting", factory=CountingPlatform,
                           summary="the reference ops, counted")


def test_corellm_platforms(llama_path):
    """A platform from a plugin runs the model: its ops (bound to every core layer, prepared
    once), its stepper (every step), its block size; the tokens are the built-in CPU
    platform's."""
    cfg = engine_config(llama_path, platform={"name": "counting"})
    del cfg["kv_cache"]["block_size"]                 # the platform's default
    llm = LLM(cfg, plugins=[PlatformPlugin()])
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, use_tqdm=False)
    platform = llm.engine.executor.worker.platform
    calls = platform.counting.calls
    assert isinstance(platform, CountingPlatform) and platform.steps == 8
    assert calls["prepare"] == 1 and calls["argmax"] == 8
    assert calls["linear"] > 0 and calls["rms_norm"] > 0 and calls["rotary"] > 0
    assert llm.config.kv_cache.block_size == 32
    worker = llm.engine.executor.worker
    model = weakref.ref(worker.runner.model)
    kv = [weakref.ref(t) for t in worker.runner.kv_caches]
    llm.shutdown()
    llm.shutdown()
    # The engine's shutdown released the model and its KV cache (nothing else holds them), and
    # told the platform once.
    assert platform.shutdowns == 1
    assert model() is None and all(r() is None for r in kv)
    from corellm.engine.ipc import EngineDeadError
    with pytest.raises(EngineDeadError, match="this engine was shut down"):
        llm.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, use_tqdm=False)
    with LLM(engine_config(llama_path, platform={"name": "cpu"})) as cpu:
        want = cpu.generate({"prompt_token_ids": [4, 5, 6]}, GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids


# --------------------------------------------------------------------------- samplers
class ConstantSampler(Sampler):
    def __call__(self, logits, metadata):
        return SamplerOutput(torch.full((logits.shape[0],), 42, dtype=torch.int64))


class SamplerPlugin:
    def corellm_samplers(self):
        yield SamplerSpec(name="constant", factory=lambda o, ctx: ConstantSampler())


def test_corellm_samplers(llama_path):
    llm = LLM(engine_config(llama_path, sampler={"name": "constant"}), plugins=[SamplerPlugin()])
    out = llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].token_ids == [42] * 8 for o in out)


# --------------------------------------------------------------------------- logits processors
class OnlyToken(LogitsProcessor):
    """``extra_args={"only": T}``: token T, whatever the model says."""

    def new_request(self, req_id, params, prompt_token_ids, output_token_ids):
        return (params.extra_args or {}).get("only")

    def apply(self, logits, rows, states):
        for row, token in zip(rows, states):
            keep = logits[row, token].clone()
            logits[row] = float("-inf")
            logits[row, token] = keep


class LogitsProcessorPlugin:
    def corellm_logits_processors(self):
        yield LogitsProcessorSpec(name="only", factory=lambda o, ctx: OnlyToken())


def test_corellm_logits_processors(llama_path):
    llm = LLM(engine_config(llama_path), plugins=[LogitsProcessorPlugin()])
    out = llm.generate(["a", "b"], [SamplingParams(max_tokens=8, temperature=0.0,
                                                   ignore_eos=True, extra_args={"only": 42}),
                                    GREEDY], use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 8
    assert out[1].outputs[0].token_ids != [42] * 8
    llm.shutdown()


# --------------------------------------------------------------------------- models
class ModelPlugin:
    """Adds an architecture name, implemented by delegating to the registry's Llama model."""

    def __init__(self):
        self.built = 0

    def corellm_models(self):
        def build(arch, ctx):
            self.built += 1
            return ctx.registry.get("model", "llama").spec.factory(arch, ctx)
        yield ModelSpec(name="my-arch", architectures=("MyLlamaForCausalLM",), factory=build)


def test_corellm_models(llama_path, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(llama_path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["MyLlamaForCausalLM"]
    (copy / "config.json").write_text(json.dumps(cfg))
    plugin = ModelPlugin()
    ours = LLM(engine_config(copy), plugins=[plugin])
    ref = LLM(engine_config(llama_path))
    assert plugin.built == 1
    p = {"prompt_token_ids": [9, 8, 7]}
    assert ours.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        ref.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    from corellm.errors import PluginError
    with pytest.raises(PluginError, match="no model plugin implements architecture MyLlamaForCausalLM"):
        LLM(engine_config(copy))


# --------------------------------------------------------------------------- front ends
class EchoOptions(FrontendOptions):
    name: str = "echo"
    greeting: str = "hi"


class EchoFrontend(Frontend):
    def __init__(self, options, ctx):
        self.options = options
        self.ran = False

    def run(self):
        self.ran = True


class FrontendPlugin:
    def corellm_frontends(self):
        yield FrontendSpec(name="echo", factory=EchoFrontend, options=EchoOptions)


def test_corellm_frontends():
    reg = load_registry(plugins=[FrontendPlugin()])
    cfg = load_config({"frontend": {"name": "echo", "greeting": "hello"}}, registry=reg)
    assert cfg.frontend.greeting == "hello"
    frontend = reg.get("frontend", "echo").spec.factory(cfg.frontend, None)
    frontend.run()
    assert frontend.ran
    from corellm.errors import ConfigError
    with pytest.raises(ConfigError, match="frontend.greting: unknown option; did you mean greeting"):
        load_config({"frontend": {"name": "echo", "greting": "x"}}, registry=reg)


# --------------------------------------------------------------------------- commands
class CommandPlugin:
    """A ``corellm hello`` command, plus the ways a command plugin can go wrong."""

    def corellm_commands(self):
        def configure(parser):
            parser.add_argument("--name", default="world")
            parser.set_defaults(func=lambda args: print(f"hello {args.name}") or 7)

        def fails(_):
            raise PluginError("no such thing")

        yield CommandSpec(name="hello", factory=configure, summary="say hello")
        yield CommandSpec(name="serve", factory=configure, summary="takes a built-in's name")
        yield CommandSpec(name="shaky", factory=fails, summary="cannot build its parser")
        yield CommandSpec(name="idle", factory=lambda parser: None, summary="sets no func")


def test_corellm_commands(capsys, caplog):
    from corellm.cli.commands import build_parser, main
    help_text = build_parser([CommandPlugin()]).format_help()
    assert "hello" in help_text and "say hello" in help_text and "bench" in help_text
    assert "serve an OpenAI-compatible API" in help_text       # the built-in kept its name
    assert main(["hello", "--name", "pluggy"], plugins=[CommandPlugin()]) == 7
    assert capsys.readouterr().out == "hello pluggy\n"
    # logged once logging is set up, naming the plugin
    assert "command 'serve' of plugin 'CommandPlugin" in caplog.text
    assert "is a built-in command's name" in caplog.text
    # A command that cannot be built is listed, and running it says why; the others still run.
    assert main(["shaky", "--anything"], plugins=[CommandPlugin()]) == 2
    assert "no such thing" in capsys.readouterr().err
    assert main(["idle"], plugins=[CommandPlugin()]) == 2
    assert "set_defaults(func=...)" in capsys.readouterr().err
    assert load_registry(plugins=[CommandPlugin()]).get("command", "hello").spec.summary == \
        "say hello"
    assert main(["plugins", "--json"], plugins=[CommandPlugin()]) == 0
    rows = json.loads(capsys.readouterr().out)["components"]
    assert any(r["kind"] == "command" and r["name"] == "bench" for r in rows)   # built in
    assert any(r["kind"] == "command" and r["name"] == "hello" for r in rows)


class UnknownHookPlugin:
    def corellm_no_such_hook(self):
        pass


def test_a_registry_that_cannot_load_leaves_the_command_line_working(monkeypatch, capsys):
    """Under CORELLM_STRICT_PLUGINS a bad plugin makes the registry fail: the command line still
    answers --version and --help, and the command that needs the registry says why."""
    from corellm import __version__
    from corellm.cli.commands import main

    monkeypatch.setenv("CORELLM_STRICT_PLUGINS", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["--version"], plugins=[UnknownHookPlugin()])
    assert exit_.value.code == 0 and __version__ in capsys.readouterr().out
    assert main(["plugins"], plugins=[UnknownHookPlugin()]) == 2
    assert "corellm_no_such_hook" in capsys.readouterr().err


# --------------------------------------------------------------------------- observers
class Observer:
    def __init__(self):
        self.started = []
        self.steps = []
        self.stopped = []

    def corellm_engine_started(self, config, engine_id):
        self.started.append((config, engine_id))

    def corellm_step_finished(self, stats):
        self.steps.append(stats)

    def corellm_engine_stopped(self, engine_id, error):
        self.stopped.append((engine_id, error))


def test_corellm_engine_started(llama_path):
    obs = Observer()
    llm = LLM(engine_config(llama_path), plugins=[obs])
    other = LLM(engine_config(llama_path), plugins=[obs])
    assert obs.started == [(llm.config, llm.engine.engine_id),
                           (other.config, other.engine.engine_id)]
    assert llm.engine.engine_id != other.engine.engine_id


def test_corellm_step_finished(llama_path):
    import time
    obs = Observer()
    llm = LLM(engine_config(llama_path), plugins=[obs])
    before = time.time()
    llm.generate([{"prompt_token_ids": [3] * 5}, {"prompt_token_ids": [4] * 9}], GREEDY,
                 use_tqdm=False)
    assert len(obs.steps) == llm.get_stats().num_steps == 8
    first = obs.steps[0]
    assert first.num_scheduled_tokens == 14 and first.num_scheduled_reqs == 2
    assert obs.steps[-1].num_finished_reqs == 2
    assert {"schedule", "prepare_inputs", "forward", "sample", "update"} <= set(first.timings)
    assert obs.steps[-1].scheduler.num_running_reqs == 0
    assert {s.engine_id for s in obs.steps} == {llm.engine.engine_id}
    stamps = [s.timestamp for s in obs.steps]
    assert before <= stamps[0] and stamps == sorted(stamps) and stamps[-1] <= time.time()


def test_corellm_engine_stopped(llama_path):
    """Once per started engine: on shutdown (however often it is called), at the end of a
    `with` block, and not at all for an engine that never started."""
    obs = Observer()
    llm = LLM(engine_config(llama_path), plugins=[obs])
    llm.generate([{"prompt_token_ids": [3] * 5}], GREEDY, use_tqdm=False)
    assert obs.stopped == []
    llm.shutdown()
    llm.shutdown()
    assert obs.stopped == [(llm.engine.engine_id, None)]

    with LLM(engine_config(llama_path), plugins=[obs]) as other:
        pass
    assert obs.stopped[1:] == [(other.engine.engine_id, None)]

    with pytest.raises(Exception, match="kv_cache.block_size"):
        LLM(engine_config(llama_path, kv_cache={"block_size": 0}), plugins=[obs])
    assert len(obs.started) == len(obs.stopped) == 2


class FailingSink:
    def __init__(self):
        self.calls = []

    def corellm_engine_stopped(self, engine_id):
        self.calls.append(engine_id)
        raise OSError("disk full")


def test_engine_stopped_every_sink_runs_even_if_one_raises(llama_path, caplog):
    first, failing, last = Observer(), FailingSink(), Observer()
    llm = LLM(engine_config(llama_path), plugins=[first, failing, last])
    llm.shutdown()                               # does not raise
    engine_id = llm.engine.engine_id
    assert first.stopped == last.stopped == [(engine_id, None)] and failing.calls == [engine_id]
    assert "corellm_engine_stopped raised" in caplog.text and "disk full" in caplog.text


class FailingStart:
    def __init__(self):
        self.stopped = []

    def corellm_engine_started(self, engine_id):
        raise OSError("cannot open the metrics file")

    def corellm_engine_stopped(self, engine_id, error):
        self.stopped.append(error)


def test_engine_started_that_raises_stops_the_engine_and_names_the_plugin(llama_path,
                                                                          monkeypatch):
    """The engine does not start; it shuts down its workers, and the sinks that did start are
    told, with the error."""
    from corellm.engine.core import EngineCore
    ok, failing = Observer(), FailingStart()
    shutdowns = []
    original = EngineCore.shutdown
    monkeypatch.setattr(EngineCore, "shutdown",
                        lambda self, error=None: (shutdowns.append(error), original(self, error)))
    with pytest.raises(PluginError, match=r"plugin 'FailingStart-\w+' \(registered in-process\)"
                                          r": corellm_engine_started raised OSError"):
        LLM(engine_config(llama_path), plugins=[ok, failing])
    assert len(ok.started) == 1 and len(ok.stopped) == 1 and len(shutdowns) == 1
    assert isinstance(ok.stopped[0][1], PluginError)
    assert failing.stopped == [ok.stopped[0][1]] == shutdowns


class WrapsLifecycle:
    @hookimpl(wrapper=True)
    def corellm_engine_stopped(self):
        yield


def test_lifecycle_hook_wrappers_are_refused():
    with pytest.raises(PluginError, match="corellm_engine_stopped is called once per "
                                          "implementation; it takes plain implementations"):
        load_registry(plugins=[WrapsLifecycle()])


STOP_SINK = r"""
import os

def corellm_engine_stopped(engine_id, error):
    with open(os.environ["STOP_LOG"], "a") as f:
        f.write(f"{engine_id} {error!r}\n")

def corellm_step_finished(stats):
    if os.environ.get("FAIL_AT_STEP") == str(stats.step):
        raise RuntimeError("sink exploded")
"""


@pytest.mark.parametrize("mode", ["exit", "error"])
def test_engine_stopped_in_an_engine_process(llama_path, tmp_path, monkeypatch, mode):
    """An entry-point plugin in the engine core's process: called once when the client shuts
    the engine down, and once, with the exception, when a step kills the engine."""
    import sys
    from corellm.engine.ipc import EngineDeadError
    from tests.plugin_fixtures import install_fake_dist
    install_fake_dist(tmp_path, "fake-stop-sink", "0.1", {"fake_stop_sink": STOP_SINK},
                      {"stop_sink": "fake_stop_sink"})
    monkeypatch.syspath_prepend(str(tmp_path))
    log = tmp_path / "stops.log"
    monkeypatch.setenv("STOP_LOG", str(log))
    if mode == "error":
        monkeypatch.setenv("FAIL_AT_STEP", "2")
    llm = LLM(engine_config(llama_path), engine_process=True)
    try:
        if mode == "error":
            with pytest.raises(EngineDeadError):
                llm.generate([{"prompt_token_ids": [3] * 5}], GREEDY, use_tqdm=False)
        else:
            llm.generate([{"prompt_token_ids": [3] * 5}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    sys.modules.pop("fake_stop_sink", None)
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines
    engine_id, error = lines[0].split(" ", 1)
    assert engine_id.startswith("engine-")
    assert error == ("None" if mode == "exit" else "RuntimeError('sink exploded')")


def test_engine_stopped_at_interpreter_exit(llama_path, tmp_path):
    """An engine the program never shut down still tells its sinks, once, at exit."""
    import subprocess
    import sys
    script = (
        "import sys\n"
        "from corellm import LLM, SamplingParams\n"
        "class Sink:\n"
        "    def corellm_engine_stopped(self, engine_id, error):\n"
        "        print('stopped', engine_id, error, flush=True)\n"
        f"llm = LLM({engine_config(llama_path)!r}, plugins=[Sink()])\n"
        "llm.generate([{'prompt_token_ids': [3, 4]}], SamplingParams(max_tokens=2), "
        "use_tqdm=False)\n"
        "print('end of script', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "end of script" and len(lines) == 2, out.stdout
    assert lines[1].startswith("stopped engine-") and lines[1].endswith(" None")


def test_no_observer_no_hook_call(llama_path, monkeypatch):
    llm = LLM(engine_config(llama_path))
    assert llm.engine._observe_steps is False


def test_stats_listeners_see_the_hooks_records_in_either_process(llama_path):
    """One channel: a listener gets the same StepStats the hook gets, in-process; from an
    engine process the records cross to the caller, with each finished request's record and an
    "event" record after an abort, so the last record matches get_stats()."""
    obs = Observer()
    heard = []
    llm = LLM(engine_config(llama_path), plugins=[obs])
    llm.add_stats_listener(heard.append)
    llm.generate([{"prompt_token_ids": [3] * 5}, {"prompt_token_ids": [4] * 9}],
                 SamplingParams(max_tokens=4), use_tqdm=False)
    assert heard == obs.steps and len(heard) == llm.get_stats().num_steps
    finished = [f for s in heard for f in s.finished]
    assert sorted(f.num_generation_tokens for f in finished) == [4, 4]
    assert all(f.finish_reason == "length" and f.first_token_time >= f.first_scheduled_time
               >= f.arrival_time and f.time_to_first_token > 0 for f in finished)
    llm.shutdown()

    remote = LLM(engine_config(llama_path), engine_process=True)
    got = []
    remote.add_stats_listener(got.append)
    try:
        remote.generate([{"prompt_token_ids": [3] * 5}], SamplingParams(max_tokens=3),
                        use_tqdm=False)
        steps = [s for s in got if s.kind == "step"]
        assert len(steps) == remote.get_stats().num_steps == 3
        assert [f.num_generation_tokens for s in got for f in s.finished] == [3]
        # A request aborted while waiting: an "event" record brings the snapshot up to date.
        _, core = remote.processor.process("w", {"prompt_token_ids": [5] * 4},
                                           SamplingParams(max_tokens=2))
        remote.client.add_requests([core])
        remote.client.abort_requests(["w"])
        import time
        deadline = time.monotonic() + 10
        while not any(f.request_id == "w" for s in got for f in s.finished):
            assert time.monotonic() < deadline, got[-1]
            time.sleep(0.01)
        last = got[-1]
        stats = remote.get_stats()
        assert last.scheduler.num_waiting_reqs == stats.num_waiting_reqs == 0
        assert last.scheduler.kv_blocks_free == stats.kv_blocks_free
    finally:
        remote.shutdown()


class ParserPlugin:
    """A tool parser for ``CALL name {json}`` and a reasoning parser for ``...|`` ahead of the
    answer, each one class, registered in-process."""

    def corellm_tool_parsers(self):
        from corellm.components import ToolParserSpec
        from corellm.interfaces import ToolParser
        from corellm.serving.partial_json import partial_suffix
        from corellm.tool_calls import ParsedToolCalls, PartialToolCall

        class Call(ToolParser):
            def parse(self, text, final):
                head, sep, rest = text.partition("CALL ")
                if not sep:
                    # (held back: an end that may still become "CALL ")
                    return ParsedToolCalls(
                        content=text[:len(text) - partial_suffix(text, "CALL ")])
                name, space, args = rest.partition(" ")     # the name is whole at its space
                return ParsedToolCalls(content=head, calls=[
                    PartialToolCall(name if space else None, args)])
        yield ToolParserSpec(name="call", factory=Call, summary="CALL name {json}")

    def corellm_reasoning_parsers(self):
        from corellm.components import ReasoningParserSpec
        from corellm.interfaces import ReasoningParser
        from corellm.tool_calls import ParsedReasoning

        class Bar(ReasoningParser):
            end_marker = "|"

            def parse(self, text, final):
                thought, sep, answer = text.partition("|")
                return ParsedReasoning(thought, answer, bool(sep)) if sep or final \
                    else ParsedReasoning(thought, "", False)
        yield ReasoningParserSpec(name="bar", factory=Bar, summary="thinking, then |")


def _answer(text):
    from corellm.serving.chat_output import ChatOutputParser
    registry = load_registry(plugins=[ParserPlugin()])
    parser = ChatOutputParser(tools=registry.get("tool_parser", "call").spec.factory([]),
                              reasoning=registry.get("reasoning_parser", "bar").spec.factory())
    deltas = [parser.delta(text[:i]) for i in range(1, len(text))]
    last, message = parser.finish(text)
    return [d for d in deltas + [last] if d], message


def test_corellm_tool_parsers():
    _, message = _answer('hm|Sure. CALL get {"a": 1}')
    assert message.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [("get", '{"a": 1}')]


def test_corellm_reasoning_parsers():
    deltas, message = _answer("think it over|Fine.")
    assert message.reasoning_content == "think it over" and message.content == "Fine."
    assert "".join(d.reasoning_content or "" for d in deltas) == "think it over"
    assert "".join(d.content or "" for d in deltas) == "Fine."
