"""The CUDA platform (plugins/platform_cuda).

On any machine: its options and their errors, its availability and how ``corellm plugins`` and
the config loader report it; the KV budget's arithmetic, and the order of the measurements
around the profiling forward (torch.cuda's memory calls stood in for); the capture sizes, the
choice of the graph a step replays, and what warm-up captures; the staging buffers (one copy
each way, reused, never rewritten while a copy out of them may run); the stepper replaying
padded decode steps (a stand-in graph re-runs the captured function on the same buffers) and
serving a whole engine on the CPU with the tokens of the reference stepper; and, through the
Triton interpreter, that the padding rows of a replayed decode batch write no K/V and read
nothing. What needs a GPU is marked ``gpu`` and skipped, with the reason, where no CUDA device
is visible: greedy parity with transformers, graph replay equal to eager steps, the KV cache
sized by ``gpu_memory_utilization``, pinned staging on the device.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from corellm.attention import AttentionBuildLimits, CommonAttentionMetadata
from corellm.config.compose import load_config
from corellm.errors import ConfigError
from corellm.platforms.interface import StepInputs
from corellm.plugins.discovery import load_registry
from corellm_plugins import platform_cuda
from corellm_plugins.platform_cuda import CudaOptions
from corellm_plugins.platform_cuda.graphs import (DecodeGraphs, capture_sizes, graphs_refused,
                                                  padded_size, padding_metadata)
from corellm_plugins.platform_cuda.memory import MemorySnapshot, kv_budget_bytes
from corellm_plugins.platform_cuda.platform import CudaPlatform, CudaStepper
from corellm_plugins.platform_cuda.staging import HostIds, StepStaging
from tests.conftest import assert_pool_whole, engine_config

GIB = 1 << 30
CPU = torch.device("cpu")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # The attention kernels run on the CPU under Triton's interpreter, which must be on before
    # triton is first imported: its own library functions are made then.
    os.environ["TRITON_INTERPRET"] = "1"
no_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none visible)")


def _limits(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=16,
            device=CPU):
    return AttentionBuildLimits(block_size=block_size, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len, device=device)


def _cuda_registry(monkeypatch):
    """The installed plugins, with the CUDA platform made available (to validate its options
    on a machine without a GPU)."""
    monkeypatch.setattr(platform_cuda, "availability", lambda: None)
    return load_registry()


# --------------------------------------------------------------------------- options, registry
def test_options_defaults():
    o = CudaOptions()
    assert (o.name, o.gpu_memory_utilization, o.cuda_graphs, o.cuda_graph_batch_sizes) == (
        "cuda", 0.9, True, None)
    assert CudaOptions(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    assert CudaOptions(cuda_graph_batch_sizes=[1, 3, 64]).cuda_graph_batch_sizes == [1, 3, 64]
    assert all(f.description for n, f in CudaOptions.model_fields.items() if n != "name")


@pytest.mark.parametrize("options,key,message", [
    ({"gpu_memory_utilization": 1.5}, "platform.gpu_memory_utilization",
     "less than or equal to 1 (got 1.5)"),
    ({"gpu_memory_utilization": 0}, "platform.gpu_memory_utilization",
     "greater than 0 (got 0)"),
    ({"cuda_graph_batch_sizes": [4, 2]}, "platform.cuda_graph_batch_sizes",
     "batch sizes must be strictly increasing (got [4, 2])"),
    ({"cuda_graph_batch_sizes": [1, 1]}, "platform.cuda_graph_batch_sizes",
     "batch sizes must be strictly increasing"),
    ({"cuda_graph_batch_sizes": [0, 8]}, "platform.cuda_graph_batch_sizes",
     "batch sizes must be positive (got [0, 8])"),
    ({"cuda_graph_batch_sizes": []}, "platform.cuda_graph_batch_sizes",
     "must list at least one batch size (cuda_graphs: false captures none)"),
    ({"gpu_memory_utilisation": 0.5}, "platform.gpu_memory_utilisation",
     "unknown option; did you mean gpu_memory_utilization?"),
])
def test_a_bad_option_is_a_config_error_naming_its_key(monkeypatch, options, key, message):
    registry = _cuda_registry(monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": "cuda", **options}}, registry=registry)
    problems = dict(err.value.problems)
    assert key in problems and message in problems[key], problems


def test_good_options_load_with_the_gpu_block_size(monkeypatch):
    registry = _cuda_registry(monkeypatch)
    cfg = load_config({"platform": {"name": "cuda", "gpu_memory_utilization": 0.5,
                                    "cuda_graph_batch_sizes": [1, 2, 8]}}, registry=registry)
    assert isinstance(cfg.platform, CudaOptions)
    assert cfg.platform.gpu_memory_utilization == 0.5
    assert cfg.platform.cuda_graph_batch_sizes == [1, 2, 8]
    assert cfg.kv_cache.block_size == 16
    # auto prefers an available GPU over the CPU
    assert load_config({}, registry=registry).platform.name == "cuda"


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is visible: the platform is available")
def test_unavailable_here_is_listed_with_its_reason_and_refused_by_name(capsys, caplog):
    reason = platform_cuda.availability()
    assert reason is not None
    assert (reason.startswith("torch was built without CUDA (torch ")
            or reason.startswith("no CUDA device visible"))
    from corellm.cli.commands import main
    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["components"]
    cuda = next(r for r in rows if r["kind"] == "platform" and r["name"] == "cuda")
    assert cuda["plugin"] == "platform_cuda"
    assert cuda["unavailable"] == reason and not cuda["auto_selected"]
    assert cuda["auto_priority"] == 20
    assert {o["name"] for o in cuda["options"]} == {"gpu_memory_utilization", "cuda_graphs",
                                                    "triton_ops", "cuda_graph_batch_sizes"}
    registry = load_registry()
    with caplog.at_level("INFO", logger="corellm.config.compose"):
        assert load_config({}, registry=registry).platform.name == "cpu"
    assert f"cuda: {reason}" in caplog.text
    with pytest.raises(ConfigError) as err:
        load_config({"platform": {"name": "cuda"}}, registry=registry)
    message = dict(err.value.problems)["platform.name"]
    assert message.startswith("'cuda' (plugin 'platform_cuda'")
    assert message.endswith(f"is not available here: {reason}")


def test_platform_facts_need_no_device():
    """The config loader builds the platform for its block size: nothing there touches CUDA."""
    p = CudaPlatform(CudaOptions())
    assert (p.device_type, p.dist_backend, p.default_block_size, p.shares_devices) == (
        "cuda", "nccl", 16, False)
    assert p.resolve_dtype("auto", "float16") == "float16"
    assert p.resolve_dtype("bfloat16", "float32") == "bfloat16"
    with pytest.raises(ConfigError, match="model.dtype"):
        p.resolve_dtype("float64", "float32")


# --------------------------------------------------------------------------- KV budget
def _snap(total=80, free=0.0, reserved=0.0, allocated=0.0):
    return MemorySnapshot(total=int(total * GIB), free=int(free * GIB),
                          reserved=int(reserved * GIB), allocated=int(allocated * GIB))


def test_kv_budget_is_the_share_left_by_the_profiled_peak_and_non_torch_growth():
    # Alone on an 80 GiB GPU: 0.5 GiB context at the start, 1.5 GiB outside torch after the
    # profile (cuBLAS, kernels); weights 8 GiB, the profile's peak 10 GiB.
    start = _snap(free=79.5)
    after = _snap(free=80 - 1.5 - 8, reserved=8, allocated=8)
    assert after.non_torch == int(1.5 * GIB) and start.non_torch == int(0.5 * GIB)
    budget = kv_budget_bytes(0.9, after, 10 * GIB, start)
    assert budget == int(80 * GIB * 0.9) - 10 * GIB - 1 * GIB
    # Without a start snapshot all the non-torch memory counts.
    assert kv_budget_bytes(0.9, after, 10 * GIB) == int(80 * GIB * 0.9) - 10 * GIB - int(1.5 * GIB)
    # The share scales the budget, not the measured use.
    assert kv_budget_bytes(0.5, after, 10 * GIB, start) == 40 * GIB - 11 * GIB


def test_memory_of_other_processes_is_not_counted_but_must_leave_room():
    # Another process holds 30 GiB before the engine starts; this engine asks for 0.5.
    start = _snap(free=50)
    after = _snap(free=80 - 30.5 - 8, reserved=8, allocated=8)
    budget = kv_budget_bytes(0.5, after, 10 * GIB, start)
    assert budget == 40 * GIB - 10 * GIB - int(0.5 * GIB)
    # At 0.9 the share would need more than is free: refused, with the figures.
    with pytest.raises(ConfigError) as err:
        kv_budget_bytes(0.9, after, 10 * GIB, start)
    (key, message), = err.value.problems
    assert key == "platform.gpu_memory_utilization"
    assert message.startswith("0.9 leaves 61.50 GiB for the KV cache, but only 41.50 GiB of the "
                              "device is free, of which the activations need 2.00 GiB "
                              "(30.00 GiB was in use before the engine started")


def test_nothing_left_for_the_kv_cache_is_a_config_error():
    after = _snap(free=60, reserved=19, allocated=19)
    with pytest.raises(ConfigError) as err:
        kv_budget_bytes(0.25, after, 20 * GIB, _snap(free=79))
    (key, message), = err.value.problems
    assert key == "platform.gpu_memory_utilization"
    assert message == ("0.25 of the device's 80.00 GiB is 20.00 GiB, and the weights and a "
                       "forward of the largest step peak at 20.00 GiB, with 0.00 GiB used "
                       "outside torch: nothing is left for the KV cache (raise it, lower "
                       "scheduler.max_num_batched_tokens, or set kv_cache.memory_gib)")


def test_allocatable_memory_counts_torch_reserved_but_unused():
    s = _snap(free=10, reserved=6, allocated=4)
    assert s.allocatable == 12 * GIB
    assert s.non_torch == 64 * GIB


class _FakeCuda:
    """Stands for torch.cuda's memory calls: a device of 80 GiB with 0.5 GiB used at the start,
    8 GiB of weights, and a profile that peaks at 12 GiB, 2 GiB of it its scratch KV cache, and
    leaves 1 GiB more outside torch."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        self.profiled = False
        self.scratch = 2 * GIB
        for name in ("synchronize", "empty_cache", "set_device"):
            monkeypatch.setattr(torch.cuda, name,
                                lambda *a, _n=name: self.log.append(_n))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda *a: self.log.append("reset_peak"))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                            lambda *a: (self.log.append("peak"), 12 * GIB)[1])
        monkeypatch.setattr(torch.cuda, "memory_reserved",
                            lambda *a: 8 * GIB if self.profiled else 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated",
                            lambda *a: 8 * GIB if self.profiled else 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)

    def mem_get_info(self, *a):
        used = 0.5 + (1 + 8 if self.profiled else 0)
        return int((80 - used) * GIB), 80 * GIB

    def profile(self):
        self.log.append("profile")
        self.profiled = True
        return self.scratch


def test_the_budget_is_measured_around_the_profiling_forward(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    platform = CudaPlatform(CudaOptions(gpu_memory_utilization=0.5))
    dev = platform.device(1)
    assert dev == torch.device("cuda", 1) and cuda.log == ["set_device"]
    assert platform.device(1) == dev                   # the start is measured once per device
    cuda.log.clear()
    budget = platform.kv_cache_budget(dev, 1, cuda.profile)
    # the 0.5 GiB of the start and the profile's 2 GiB scratch cache not counted
    assert budget == 40 * GIB - 10 * GIB - 1 * GIB
    # The peak restarts before the profile and is read after it has finished on the device.
    assert cuda.log == ["synchronize", "empty_cache", "reset_peak", "profile", "synchronize",
                        "peak", "empty_cache"]
    assert platform.free_memory(dev) == int(70.5 * GIB)
    with pytest.raises(ConfigError, match="local rank 2 needs CUDA device 2, but 2 are visible"):
        platform.device(2)


# --------------------------------------------------------------------------- graphs: host side
def test_default_capture_sizes():
    assert capture_sizes(None, 256, 8192) == [1, 2, 4] + list(range(8, 257, 8))
    assert len(capture_sizes(None, 256, 8192)) == 35
    assert capture_sizes(None, 100, 8192)[-3:] == [88, 96, 100]     # every batch has a graph
    assert capture_sizes(None, 3, 8192) == [1, 2, 3]
    assert capture_sizes(None, 1, 8192) == [1]
    assert capture_sizes(None, 64, 20) == [1, 2, 4, 8, 16, 20]       # token budget bounds too


def test_requested_capture_sizes_above_the_batch_limit_are_skipped():
    assert capture_sizes([1, 3, 48, 500], 64, 2048) == [1, 3, 48]
    assert capture_sizes([128], 64, 2048) == []


def test_padded_size_is_the_smallest_captured_size_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [
        1, 2, 4, 8, 8, 16, 16, None]
    assert padded_size(1, []) is None


def test_padding_metadata_stores_nothing_and_attends_to_nothing():
    md = padding_metadata(4, 16)
    assert (md.num_reqs, md.num_decodes, md.num_actual_tokens, md.max_query_len) == (4, 4, 4, 1)
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [-1] * 4
    assert md.seq_lens.tolist() == [0] * 4 and md.block_table.shape == (4, 1)


def _inputs(n_tokens, n_reqs, n_decodes, rows=None, md=None):
    ids = np.arange(100, 100 + n_tokens, dtype=np.int64)
    pos = np.arange(7, 7 + n_tokens, dtype=np.int64)
    rows = np.arange(n_reqs, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    return StepInputs(ids, pos, rows, md, n_reqs, n_decodes)


def test_only_decode_only_steps_within_the_limits_replay():
    graphs = DecodeGraphs(_limits(max_num_seqs=8, max_num_batched_tokens=32))
    assert graphs.size_for(_inputs(3, 3, 3)) is None                  # nothing captured yet
    graphs.enable([1, 2, 4, 8])
    assert graphs.size_for(_inputs(3, 3, 3)) == 4
    assert graphs.size_for(_inputs(1, 1, 1)) == 1
    assert graphs.size_for(_inputs(8, 8, 8)) == 8
    assert graphs.size_for(_inputs(7, 3, 2)) is None                  # a prefill in the step
    assert graphs.size_for(_inputs(5, 3, 3)) is None                  # not one token a request
    assert graphs.off is None
    # A step beyond the limits moved the persistent buffers: no graph is replayed after it.
    assert graphs.size_for(_inputs(40, 2, 0)) is None
    assert graphs.off and "exceeded the scheduler's limits (8, 32)" in graphs.off
    assert graphs.size_for(_inputs(3, 3, 3)) is None


class _Builder:
    cuda_graphs = True

    def __init__(self):
        self.built: list[CommonAttentionMetadata] = []

    def build(self, common):
        self.built.append(common)
        return ("md", common.num_reqs)


class _EagerBuilder(_Builder):
    cuda_graphs = False


def test_why_graphs_are_not_captured():
    assert graphs_refused(True, _Builder(), 1) is None
    assert graphs_refused(False, _Builder(), 1) == "platform.cuda_graphs is false"
    assert "no attention metadata builder" in graphs_refused(True, None, 1)
    assert graphs_refused(True, _EagerBuilder(), 1) == (
        "the attention backend's metadata builder (_EagerBuilder) does not declare cuda_graphs")
    assert graphs_refused(True, _Builder(), 2).startswith("tensor parallelism (2 ranks)")


# --------------------------------------------------------------------------- staging buffers
class _Events:
    """Stands for torch.cuda.Event: logs records and waits, in order."""

    def __init__(self):
        self.log: list[str] = []

    def __call__(self):
        log = self.log

        class Event:
            def record(self):
                log.append("record")

            def synchronize(self):
                log.append("wait")
        return Event()


def test_staging_packs_a_step_in_one_buffer_at_addresses_fixed_by_its_padded_size():
    events = _Events()
    st = StepStaging(16, 4, CPU, pin=False, event=events)
    base = st.device_buf.data_ptr()
    ids, pos, rows = st.stage(np.array([5, 6, 7]), np.array([10, 11, 12]), np.array([2]), 4)
    assert ids.tolist() == [5, 6, 7, 0] and pos.tolist() == [10, 11, 12, 0]   # padding: 0, 0
    assert rows.tolist() == [2]
    assert st.device_buf[:9].tolist() == [5, 6, 7, 0, 10, 11, 12, 0, 2]        # one packed copy
    assert events.log == ["record"]                       # one copy, nothing waited for
    # A smaller step padded to the same size: the same addresses, stale values overwritten.
    ids2, pos2, rows2 = st.stage(np.array([9]), np.array([3]), np.array([0]), 4)
    assert (ids2.data_ptr(), pos2.data_ptr()) == (ids.data_ptr(), pos.data_ptr())
    assert ids2.tolist() == [9, 0, 0, 0] and pos2.tolist() == [3, 0, 0, 0]
    # The previous copy out of the host buffer was waited for before it was rewritten.
    assert events.log == ["record", "wait", "record"]
    # Unpadded (eager) steps: exactly their own tokens.
    ids3, pos3, rows3 = st.stage(np.arange(16), np.arange(16) + 1, np.arange(4))
    assert ids3.tolist() == list(range(16)) and pos3.tolist() == list(range(1, 17))
    assert rows3.tolist() == [0, 1, 2, 3]
    assert st.moves == 0 and st.device_buf.data_ptr() == base   # the limits fit without moving
    # Beyond the limits: the buffers grow (moving), counted.
    ids4, _, _ = st.stage(np.arange(30), np.arange(30), np.arange(2))
    assert ids4.tolist() == list(range(30)) and st.moves == 1 and st.capacity >= 62
    with pytest.raises(ValueError, match="cannot pad 3 tokens to 2"):
        st.stage(np.arange(3), np.arange(3), np.arange(1), 2)


def test_sampled_ids_come_back_in_one_copy_and_one_wait():
    events = _Events()
    landing = HostIds(4, pin=False, event=events)
    buf = landing.buf.data_ptr()
    assert landing.fetch(torch.tensor([3, 1, 4])) == [3, 1, 4]
    assert landing.fetch(torch.tensor([[9], [8]])) == [9, 8]
    assert events.log == ["record", "wait"] * 2 and landing.buf.data_ptr() == buf   # reused
    assert landing.fetch(torch.arange(6)) == list(range(6))                         # grows
    assert landing.fetch(torch.tensor([7], dtype=torch.int32)) == [7]


# --------------------------------------------------------------------------- the stepper
class _Model:
    """A model whose hidden state of a token is (id, position): enough to see which inputs
    each row of a forward read."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, ids, positions, md):
        self.calls.append((md, ids.numel()))
        return torch.stack([ids, positions], dim=1).float()

    def compute_logits(self, hidden):
        return hidden * 2


class _Graph:
    """Stands for a CUDA graph: replays the captured function into the captured output."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.fn())


class _CpuStepper(CudaStepper):
    def __init__(self, model, limits):
        super().__init__(model, CPU, limits, pin=False, event=_Events())

    def _graph_pool(self):
        return "pool"

    def _capture(self, fn, pool):
        assert pool == "pool"
        out = fn()
        return _Graph(fn, out), out


@torch.inference_mode()            # as the model runner's steps run
def test_stepper_replays_padded_decode_steps_and_runs_the_rest_eagerly():
    model, builder = _Model(), _Builder()
    stepper = _CpuStepper(model, _limits(max_num_seqs=8, max_num_batched_tokens=32))
    stepper.attn_builder = builder
    stepper.capture([1, 2, 4, 8])
    # Captured largest first, each from padding rows built by the runner's builder, after one
    # eager forward of the same batch.
    assert [c.num_reqs for c in builder.built] == [8, 4, 2, 1]
    assert all(c.slot_mapping.tolist() == [-1] * c.num_reqs and not c.seq_lens.any()
               for c in builder.built)
    assert [n for _, n in model.calls] == [8, 8, 4, 4, 2, 2, 1, 1]
    assert sorted(stepper.captured) == [1, 2, 4, 8]
    model.calls.clear()

    # A decode-only step of 3 rows replays the graph of 4, on its own inputs, padded.
    inputs = _inputs(3, 3, 3, rows=[0, 2], md=("real", 3))
    logits = stepper.forward(inputs)
    assert logits.tolist() == [[200.0, 14.0], [204.0, 18.0]]            # rows 0 and 2 only
    graph, hidden, md = stepper.captured[4]
    assert graph.replays == 1 and stepper.replays == 1 and md == ("md", 4)
    assert hidden.tolist() == [[100, 7], [101, 8], [102, 9], [0, 0]]    # row 3: padding
    assert [n for _, n in model.calls] == [4]                           # the graph's function
    assert [stepper.captured[s][0].replays for s in (1, 2, 8)] == [0, 0, 0]

    # A step with a prefill runs eagerly, on its own metadata.
    model.calls.clear()
    logits = stepper.forward(_inputs(6, 2, 1, rows=[0, 5], md=("mixed", 2)))
    assert model.calls == [(("mixed", 2), 6)] and stepper.replays == 1
    assert logits.tolist() == [[200.0, 14.0], [210.0, 24.0]]
    # A decode batch larger than every captured size runs eagerly too.
    stepper.graphs.enable([1, 2])
    model.calls.clear()
    stepper.forward(_inputs(3, 3, 3, md=("big", 3)))
    assert model.calls == [(("big", 3), 3)]

    assert stepper.to_host(torch.tensor([5, 6])) == [5, 6]


def test_the_stepper_serves_an_engine_as_the_reference_does(llama_path, monkeypatch):
    """Its inputs path (the packed buffer, chunked prefills mixed with decodes, the sampled
    rows, the ids fetched back) in a real engine, on the CPU: the same tokens as the core's
    reference stepper."""
    from corellm import LLM, SamplingParams
    from corellm_plugins.platform_cpu.platform import CpuPlatform
    from tests.test_hf_equivalence import make_prompts
    prompts = [{"prompt_token_ids": p} for p in make_prompts(1024)[:5]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # The CPU platform by name: platform auto would pick cuda (and its own stepper, twice)
    # where a GPU is visible.
    cfg = engine_config(llama_path, platform={"name": "cpu"},
                        scheduler={"max_num_batched_tokens": 24}, attention={"name": "torch_sdpa"})
    tokens = []
    for stepper in ("reference", "cuda"):
        if stepper == "cuda":
            monkeypatch.setattr(CpuPlatform, "make_stepper",
                                lambda self, model, device, limits: CudaStepper(
                                    model, device, limits, pin=False, event=_Events()))
        with LLM(cfg) as llm:
            used = llm.engine.executor.worker.runner.stepper
            assert isinstance(used, CudaStepper) == (stepper == "cuda")
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                        use_tqdm=False)])
            assert_pool_whole(llm)
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[1])


@pytest.mark.parametrize("options,builder,captured", [
    ({}, _Builder, [1, 2, 4, 8]),
    ({"cuda_graph_batch_sizes": [2, 6, 64]}, _Builder, [2, 6]),
    ({"cuda_graphs": False}, _Builder, []),
    ({}, _EagerBuilder, []),
])
def test_warm_up_captures_what_the_options_and_the_builder_allow(monkeypatch, caplog, options,
                                                                 builder, captured):
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    platform = CudaPlatform(CudaOptions(**options))
    stepper = _CpuStepper(_Model(), _limits(max_num_seqs=8, max_num_batched_tokens=32))
    stepper.attn_builder = builder()
    with caplog.at_level("INFO", logger="corellm_plugins.platform_cuda.platform"):
        platform.warm_up(stepper)
    assert sorted(stepper.captured) == captured and stepper.graphs.sizes == captured
    if not captured:
        assert "CUDA graphs: none captured (" in caplog.text


# --------------------------------------------------------------------------- padded rows, Triton
@pytest.fixture
def triton_device():
    """CUDA where visible, else the CPU under Triton's interpreter."""
    triton = pytest.importorskip("triton",
                                 reason="the triton backend's kernels need the 'triton' package")
    if HAS_CUDA:
        return torch.device("cuda")
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    return CPU


def _full(view, n):
    """The first ``n`` elements of the buffer ``view`` is the start of: what a graph captured
    for ``n`` rows reads there."""
    return torch.as_strided(view, (n,), (1,), view.storage_offset())


def test_padded_decode_rows_write_no_kv_and_read_nothing(triton_device):
    from corellm.interfaces import AttentionLayerSpec
    from corellm_plugins.attn_triton import TritonAttentionOptions
    from corellm_plugins.attn_triton.backend import TritonAttentionBackend
    from tests.attn_reference import common_metadata, paged_cache, reference_attention

    dev, dtype, bs, rows = triton_device, torch.float32, 16, 8
    backend = TritonAttentionBackend(TritonAttentionOptions())
    layer = AttentionLayerSpec(0, 4, 2, 64, scale=0.125)
    limits = _limits(max_num_seqs=rows, max_num_batched_tokens=64, max_model_len=128,
                     block_size=bs, device=dev)
    builder = backend.make_metadata_builder(limits)
    assert builder.cuda_graphs

    # The capture: a batch of padding rows only.
    captured = builder.build(padding_metadata(rows, bs))
    assert captured.num_splits == 1 and captured.num_reqs == rows

    # The real step: three decodes, over a cache that is NaN wherever nothing was written.
    gen = torch.Generator().manual_seed(0)
    reqs = [(20, 1), (5, 1), (33, 1)]
    spec = backend.kv_cache_spec(layer, 24, bs, dtype)
    cache, tables = paged_cache(spec.shape, dtype, reqs, bs, gen)
    common = common_metadata(reqs, tables, bs)
    md = builder.build(common)
    # Its rows past the last, up to max_num_seqs, are padding in the buffers a graph reads.
    assert _full(md.slot_mapping, rows).tolist() == common.slot_mapping.tolist() + [-1] * 5
    assert _full(md.seq_lens, rows).tolist() == [21, 6, 34] + [0] * 5
    assert _full(md.query_start_loc, rows + 1).tolist() == list(range(rows + 1))
    # The block table has the fixed width of the longest request the limits allow.
    assert md.block_table.shape == (3, limits.max_blocks_per_seq)
    assert md.block_table.stride(0) == captured.block_table.stride(0)
    # The decode grid is the same tensors every step.
    grid = md.tiles("decode", 0, 3, 4)
    assert grid[0].data_ptr() == captured.tiles("decode", 0, rows, 4)[0].data_ptr()
    assert grid[0].tolist() == [0, 1, 2] and grid[1].tolist() == [0, 0, 0] and grid[2] == 3

    q = torch.randn(rows, 4, 64, generator=gen).to(dtype)
    k = torch.randn(rows, 2, 64, generator=gen).to(dtype)
    v = torch.randn(rows, 2, 64, generator=gen).to(dtype)
    cache = cache.to(dev)
    # Eager: the three rows alone.
    eager_cache = cache.clone()
    eager = backend.forward(layer, q[:3].to(dev), k[:3].to(dev), v[:3].to(dev), eager_cache, md)
    # Replayed: what the graph captured for eight rows runs, with the capture's grid and
    # strides, on the buffers as the real step left them; the stale block-table rows past the
    # third point at poisoned blocks, which a row that read them would turn into NaN.
    table = torch.zeros((rows, md.block_table.shape[1]), dtype=torch.int32, device=dev)
    table[:3] = md.block_table
    unwritten = next(b for b in range(24) if all(b not in t for t in tables))
    table[3:, :2] = torch.tensor(tables[0][:2], dtype=torch.int32)     # another request's
    table[3:, 2:4] = unwritten                                          # NaN throughout
    replay_md = dataclasses.replace(
        captured, slot_mapping=_full(md.slot_mapping, rows),
        query_start_loc=_full(md.query_start_loc, rows + 1),
        seq_lens=_full(md.seq_lens, rows), block_table=table)
    replay_cache = cache.clone()
    replayed = backend.forward(layer, q.to(dev), k.to(dev), v.to(dev), replay_cache, replay_md)

    assert torch.equal(replayed[:3].cpu(), eager.cpu())                 # the real rows: same
    assert torch.equal(replayed[3:].cpu(), torch.zeros(5, 4, 64))      # padding: 0, not NaN
    # The padding rows stored nothing: the cache is the eager step's, NaN where it was NaN.
    assert torch.equal(replay_cache.isnan(), eager_cache.isnan())
    written = ~eager_cache.isnan()
    assert torch.equal(replay_cache[written], eager_cache[written])
    ref = reference_attention(layer, q[:3], eager_cache.cpu(), reqs, tables, bs)
    torch.testing.assert_close(eager.cpu().double(), ref, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------- on a GPU
def _stepper(llm) -> CudaStepper:
    stepper = llm.engine.executor.worker.runner.stepper
    assert isinstance(stepper, CudaStepper)
    return stepper


@pytest.mark.gpu
@no_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_matches_transformers_on_cuda(make_checkpoint, dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from corellm import LLM, SamplingParams
    from tests.test_hf_equivalence import (assert_bf16_greedy_matches, compare, hf_greedy,
                                          make_prompts)
    path = make_checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    prompts = make_prompts(model.config.vocab_size)[:6]
    gen = GenerationConfig(max_new_tokens=16, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    results = hf_greedy(model, prompts, gen)
    cfg = engine_config(path, platform={"name": "cuda"}, model={"dtype": dtype},
                        scheduler={"max_num_seqs": 8})
    with LLM(cfg) as llm:
        stepper = _stepper(llm)
        assert stepper.device.type == "cuda"
        assert llm.engine.executor.worker.runner.attn_entry.spec.name == "triton"
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        assert stepper.replays > 0, "no decode step replayed a CUDA graph"
        assert_pool_whole(llm)
    if dtype == "float32":
        notes = [n for o, (theirs, logits) in zip(outputs, results)
                 if (n := compare(o.outputs[0].token_ids, theirs, logits))]
        assert len(notes) <= 1, notes
        return
    assert_bf16_greedy_matches(outputs, results)


@pytest.mark.gpu
@no_cuda
def test_graph_replay_gives_the_tokens_of_eager_steps(llama_path):
    from corellm import LLM, SamplingParams
    from tests.test_hf_equivalence import make_prompts
    prompts = make_prompts(1024)[:6]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens, replays = {}, {}
    for graphs in (True, False):
        cfg = engine_config(llama_path, platform={"name": "cuda", "cuda_graphs": graphs},
                            attention={"name": "triton"}, scheduler={"max_num_seqs": 8})
        with LLM(cfg) as llm:
            stepper = _stepper(llm)
            assert sorted(stepper.captured) == ([1, 2, 4, 8] if graphs else [])
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            tokens[graphs] = [o.outputs[0].token_ids for o in outs]
            replays[graphs] = stepper.replays
            assert_pool_whole(llm)
    assert replays[True] > 0 and replays[False] == 0
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@no_cuda
def test_kv_cache_sized_from_gpu_memory_utilization(llama_path):
    import gc

    from corellm import LLM
    sizes = {}
    for util in (0.3, 0.6):
        gc.collect()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() < GIB, "an earlier engine's memory is still held"
        cfg = engine_config(llama_path, platform={"name": "cuda", "gpu_memory_utilization": util})
        del cfg["kv_cache"]["num_blocks"]
        # Large blocks: a tiny model's 0.6 of a GPU is millions of 16-token blocks, which the
        # pool's bookkeeping (and the conftest's invariant checks) would walk in Python.
        cfg["kv_cache"]["block_size"] = 256
        with LLM(cfg) as llm:
            runner = llm.engine.executor.worker.runner
            sizes[util] = llm.engine.kv_cache_manager.num_blocks
            per_block = runner.kv_cache_bytes_per_block()
            total = torch.cuda.mem_get_info()[1]
            # the weights and a profiling step of a tiny model are well under 0.3 of a GPU
            assert sizes[util] * per_block > (util - 0.1) * total
            assert sizes[util] * per_block <= util * total
        del llm, runner
    assert sizes[0.6] > 1.9 * sizes[0.3]


@pytest.mark.gpu
@no_cuda
def test_shut_down_engines_give_their_device_memory_back(llama_path):
    """Two engines that each size their KV cache to 0.6 of the GPU: one after the other in one
    process, each shut down before the next starts, they fit where two at once would not
    (the second would find less than 0.6 free). ``shutdown()`` frees the weights, the KV cache
    and the graphs at once, while the engine object is still referenced."""
    from corellm import LLM, SamplingParams
    cfg = engine_config(llama_path, platform={"name": "cuda", "gpu_memory_utilization": 0.6})
    del cfg["kv_cache"]["num_blocks"]
    cfg["kv_cache"]["block_size"] = 256
    engines, used = [], []
    for _ in range(2):
        llm = LLM(cfg)
        engines.append(llm)                       # kept referenced on purpose
        out = llm.generate([{"prompt_token_ids": [5, 9, 13]}],
                           SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        used.append(torch.cuda.memory_allocated())
        llm.shutdown()
        assert torch.cuda.memory_allocated() < GIB, "the shut-down engine still holds memory"
    total = torch.cuda.mem_get_info()[1]
    assert min(used) > 0.5 * total


@pytest.mark.gpu
@no_cuda
def test_staging_and_landing_on_the_device():
    dev = torch.device("cuda")
    st = StepStaging(16, 4, dev, event=torch.cuda.Event)
    ids, pos, rows = st.stage(np.array([5, 6, 7]), np.array([1, 2, 3]), np.array([2]), 4)
    assert ids.is_cuda and st.host.is_pinned()
    assert ids.tolist() == [5, 6, 7, 0] and pos.tolist() == [1, 2, 3, 0] and rows.tolist() == [2]
    ids, _, _ = st.stage(np.array([8]), np.array([4]), np.array([0]), 4)
    assert ids.tolist() == [8, 0, 0, 0]
    landing = HostIds(4, event=torch.cuda.Event)
    assert landing.buf.is_pinned()
    assert landing.fetch(torch.tensor([3, 1, 4], device=dev)) == [3, 1, 4]


def test_the_probe_reads_torch_s_build_without_importing_it():
    """Where torch is not imported yet, the probe reads its build (CUDA or not) from its
    ``version.py``: the same values ``torch.version`` has once imported. A CPU build is then
    refused without the seconds of ``import torch``."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from corellm_plugins.platform_cuda.probe import _build_info, cuda_problem\n"
            "info, problem = _build_info(), cuda_problem()\n"
            "cpu_build = info is not None and info['cuda'] is None\n"
            "print('imported' if 'torch' in sys.modules else 'not imported')\n"
            "import torch\n"
            "print(info['cuda'] == torch.version.cuda, info['__version__'] == torch.__version__)\n"
            "print(cpu_build == (torch.version.cuda is None), problem)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1] == "True True" and lines[2].startswith("True")
    if torch.version.cuda is None:
        assert lines[0] == "not imported" and "built without CUDA" in lines[2]


def test_platform_specs_declare_their_platforms_block_size():
    """The block size a config defaults to without building the platform (the spec's) is the
    one the platform has."""
    from corellm.plugins.discovery import load_registry
    from corellm_plugins.platform_cpu.platform import CpuPlatform
    from corellm_plugins.platform_cuda.platform import CudaPlatform

    registry = load_registry()
    for name, cls in (("cpu", CpuPlatform), ("cuda", CudaPlatform)):
        spec = registry.get("platform", name, usable=False).spec
        assert spec.default_block_size == cls.default_block_size, name
