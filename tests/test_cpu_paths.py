"""The CPU platform's fast paths (``corellm_plugins.platform_cpu``: the GEMM path planned per
weight shape, the allocator tuning, the torch_sdpa backend's decode groups) change speed, not
results: checked against the plain paths."""

from __future__ import annotations

import random

import pytest

from corellm import LLM, SamplingParams
from corellm_plugins.attn_torch_sdpa.backend import _decode_groups as groups_of
from corellm_plugins.platform_cpu import gemm
from corellm_plugins.platform_cpu.gemm import GemmPlan, PackedLinear
from tests.conftest import engine_config

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


PROMPTS = [{"prompt_token_ids": list(range(4, 4 + n))} for n in (1, 9, 33, 120)]


@pytest.mark.parametrize("plan", [("mkl", "onednn", "dense"), ("onednn",) * 3, ("mkl",) * 3,
                                  ("native",) * 3, ("native", "onednn", "dense")])
def test_gemm_paths_give_the_same_tokens(llama_path, monkeypatch, plan):
    """Every packed path, alone or mixed by row bucket (one-row decodes, four-row decode
    batches, prefills), gives the plain path's greedy tokens."""
    missing = set(plan) - set(gemm.available_gemm_paths())
    if missing:
        pytest.skip(f"this torch build lacks the {sorted(missing)} path")
    monkeypatch.setattr(gemm, "gemm_plan",
                        lambda shape, paths=None, dtype=None:
                        GemmPlan(shape, (1, 16, 64), plan))
    with LLM(engine_config(llama_path, platform={"name": "cpu"})) as planned:
        model = planned.engine.executor.worker.runner.model
        linears = [m for m in model.modules() if _core_linear(m)]
        assert linears and all(isinstance(m.kernel, PackedLinear) and m.kernel.plan.paths == plan
                               for m in linears)
        a = _tokens(planned, PROMPTS)
    with LLM(engine_config(llama_path,
                           platform={"name": "cpu", "weight_packing": False})) as plain:
        model = plain.engine.executor.worker.runner.model
        assert any(_core_linear(m) for m in model.modules())
        assert not any(isinstance(getattr(m, "kernel", None), PackedLinear)
                       for m in model.modules())
        b = _tokens(plain, PROMPTS)
    assert a == b


def _core_linear(module) -> bool:
    """A layer the CPU platform packs: the core's linear layers and LM head."""
    from corellm.layers import ParallelLMHead
    from corellm.layers.linear import LinearBase
    return isinstance(module, (LinearBase, ParallelLMHead))


def test_gemm_plan_buckets():
    plan = GemmPlan((8, 4), (1, 16, 64, 256), ("mkl", "onednn", "onednn", "dense"))
    assert [plan.path_for(r) for r in (1, 2, 16, 17, 64, 65, 256, 4096)] == [
        "mkl", "onednn", "onednn", "onednn", "onednn", "dense", "dense", "dense"]
    assert plan.describe() == "8x4 rows 1: mkl, 2-16: onednn, 17-64: onednn, 65-256: dense " \
                              "(and beyond)"


def test_measured_plan_takes_the_fastest_path_per_bucket(monkeypatch):
    """With a clock the test controls: oneDNN is slowest at one row and fastest from 16 up to
    64, dense fastest from 256; probes too large for the budget end the plan early."""
    clock = [0.0]
    cost = {1: {"dense": 2, "mkl": 1, "onednn": 9}, 4: {"dense": 2, "mkl": 1, "onednn": 9},
            16: {"dense": 3, "mkl": 2, "onednn": 1},
            64: {"dense": 3, "mkl": 2, "onednn": 1}, 256: {"dense": 1, "mkl": 2, "onednn": 3}}

    def run(path, x, weight, packed, bias):
        clock[0] += cost[x.shape[0]][path] * 1e-6       # microseconds

    monkeypatch.setattr(gemm, "_run", run)
    monkeypatch.setattr(gemm, "_pack", lambda path, weight: None)
    plan = gemm.measure_gemm_plan((32, 16), ("dense", "mkl", "onednn"), timer=lambda: clock[0])
    assert plan.bounds == (1, 4, 16, 64, 256)
    assert plan.paths == ("mkl", "mkl", "onednn", "onednn", "dense")
    assert plan.gflops["16"]["onednn"] > plan.gflops["16"]["dense"]
    monkeypatch.setattr(gemm, "_PROBE_MAX_FLOP", 2.0 * 16 * 32 * 16)
    assert gemm.measure_gemm_plan((32, 16), ("dense", "mkl", "onednn"),
                                  timer=lambda: clock[0]).bounds == (1, 4, 16)


def test_plan_keeps_one_path_unless_another_wins_clearly(monkeypatch):
    """A path that is best overall is kept in a bucket where another is faster by less than
    the margin (each packed path is one more copy of the weight); a clear win still
    switches. The timings are the best of several rounds, so one slow round is forgotten."""
    clock, calls = [0.0], [0]
    cost = {1: {"dense": 1.0, "onednn": 1.05}, 4: {"dense": 1.0, "onednn": 1.05},
            16: {"dense": 2.0, "onednn": 1.0},
            64: {"dense": 3.0, "onednn": 1.0}, 256: {"dense": 1.0, "onednn": 2.0}}

    def run(path, x, weight, packed, bias):
        calls[0] += 1
        slow = 50 if calls[0] % 7 == 0 else 1             # a noisy neighbour, now and then
        clock[0] += cost[x.shape[0]][path] * slow * 1e-6

    monkeypatch.setattr(gemm, "_run", run)
    monkeypatch.setattr(gemm, "_pack", lambda path, weight: None)
    monkeypatch.setattr(gemm, "_PROBE_MAX_CALLS", 1)
    plan = gemm.measure_gemm_plan((32, 16), ("dense", "onednn"), timer=lambda: clock[0])
    assert plan.paths == ("onednn", "onednn", "onednn", "onednn", "dense")


def test_plans_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "_plans", {})
    measured = []
    real = gemm.measure_gemm_plan

    def measure(shape, paths=None, timer=None, **kw):
        measured.append(shape)
        return real(shape, paths, **kw)

    monkeypatch.setattr(gemm, "measure_gemm_plan", measure)
    first = gemm.gemm_plan((24, 16))
    monkeypatch.setattr(gemm, "_plans", {})           # a new process: only the disk remains
    assert gemm.gemm_plan((24, 16)) == first
    assert measured == [(24, 16)]
    assert (tmp_path / "corellm" / "cpu-gemm-plans.json").exists()


def test_a_plan_measured_in_a_slow_phase_is_measured_again(monkeypatch, tmp_path):
    """A cached plan records the machine's calibration speed; when the machine is now
    clearly faster (the plan was made in a slow phase of a shared machine), it is measured
    again and the cache overwritten. A slower machine now keeps the cached plan."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    real = gemm.measure_gemm_plan

    def measure(shape, paths=None, timer=None, **kw):
        measured.append(shape)
        return real(shape, paths, **kw)

    monkeypatch.setattr(gemm, "measure_gemm_plan", measure)

    def start(speed):                       # a new process on a machine running at `speed`
        monkeypatch.setattr(gemm, "_plans", {})
        monkeypatch.setattr(gemm, "_speed", [speed])
        return gemm.gemm_plan((24, 16))

    assert start(50.0).machine_gflops == 50.0 and len(measured) == 1   # the slow phase
    assert start(60.0).machine_gflops == 50.0 and len(measured) == 1   # within noise: cached
    assert start(40.0).machine_gflops == 50.0 and len(measured) == 1   # slower now: cached
    assert start(100.0).machine_gflops == 100.0 and len(measured) == 2  # 2x faster: again
    assert start(110.0).machine_gflops == 100.0 and len(measured) == 2  # and cached from then


def test_machine_speed_is_measured_once():
    speed = gemm.machine_gflops()
    assert speed > 0 and gemm.machine_gflops() == speed


@pytest.mark.parametrize("seed", range(5))
def test_decode_groups_partition_and_reduce_padding(seed):
    rng = random.Random(seed)
    lens = sorted(rng.randint(1, 600) for _ in range(rng.randint(1, 64)))
    groups = groups_of(lens, 16)
    # contiguous, in order, covering every row exactly once
    assert groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    padded = sum((e - s) * -(-lens[e - 1] // 16) for s, e in groups)
    one_group = len(lens) * -(-lens[-1] // 16)
    assert padded <= one_group


def test_uniform_lengths_stay_one_group():
    assert groups_of([100] * 64, 16) == [(0, 64)]
    assert groups_of([], 16) == []


def test_malloc_tuning_is_opt_in(monkeypatch):
    from corellm_plugins.platform_cpu.memory import tune_malloc
    monkeypatch.delenv("CORELLM_MALLOC_TUNING", raising=False)
    assert tune_malloc() is False                  # a library leaves the host process alone
    monkeypatch.setenv("CORELLM_MALLOC_TUNING", "0")
    assert tune_malloc() is False
    monkeypatch.setenv("CORELLM_MALLOC_TUNING", "1")
    import sys
    assert tune_malloc() is sys.platform.startswith("linux")


def test_bf16_weights_get_their_own_paths():
    import torch

    paths = gemm.available_gemm_paths(torch.bfloat16)
    assert paths[0] == "dense" and "upcast" in paths and "mkl" not in paths
    assert ("onednn" in paths) == gemm._onednn_takes_bf16()
    assert gemm.available_gemm_paths(torch.float16) == ("dense",)     # nothing to plan
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=gen).to(torch.bfloat16)
    w = torch.randn(24, 48, generator=gen).to(torch.bfloat16)
    b = torch.randn(24, generator=gen).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for path in paths:
        got = gemm._run(path, x, w, gemm._pack(path, w), b)
        assert got.dtype == torch.bfloat16 and got.shape == (5, 24)
        # fp32 accumulation, one rounding to bf16 (2^-8 relative) of the output
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-2)


def test_a_bf16_model_is_planned_per_dtype(llama_path, monkeypatch, tmp_path):
    """A bf16 model's linears take bf16 plans (here forced: plain bf16 for one row, upcast
    beyond), keep no weight copy for the upcast path, and generate; plans are cached per
    dtype."""
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemm, "_plans", {})
    plan = gemm.gemm_plan((24, 16), dtype=torch.bfloat16)                # measured now
    assert plan.dtype == "bfloat16" and set(plan.paths) <= set(gemm.available_gemm_paths(
        torch.bfloat16))
    assert "|bfloat16|" in (tmp_path / "corellm" / "cpu-gemm-plans.json").read_text()
    seen = []

    def forced(shape, paths=None, dtype=None):
        seen.append(dtype)
        return GemmPlan(shape, (1, 16), ("dense", "upcast"), dtype="bfloat16")

    monkeypatch.setattr(gemm, "gemm_plan", forced)
    with LLM(engine_config(llama_path, model={"dtype": "bfloat16"},
                           platform={"name": "cpu"})) as llm:
        model = llm.engine.executor.worker.runner.model
        planned = [m for m in model.modules() if _core_linear(m)]
        assert planned and set(seen) == {torch.bfloat16}
        assert all(isinstance(m.kernel, PackedLinear) and m.kernel.plan.dtype == "bfloat16"
                   and m.kernel.packed == {"dense": None, "upcast": None} for m in planned)
        outs = _tokens(llm, PROMPTS)          # prefills (upcast) and one-row decodes (dense)
        assert [len(t) for t in outs] == [GREEDY.max_tokens] * len(PROMPTS)
