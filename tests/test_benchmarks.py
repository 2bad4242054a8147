"""The benchmark scripts run end to end on a tiny checkpoint (so they cannot rot unnoticed), and
their results hold together. The numbers themselves are recorded in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_cache_benchmark(llama_path, tmp_path, capsys):
    bench = load("prefix_cache")
    out_json = tmp_path / "pc.json"
    assert bench.main(["--model", str(llama_path), "--conversations", "3", "--turns", "3",
                       "--context-len", "40", "--user-len", "8", "--output-len", "4",
                       "--num-requests", "5", "--system-len", "48", "--question-len", "4:8",
                       "--max-num-batched-tokens", "256", "--block-size", "16",
                       "--no-tqdm", "--json", str(out_json), "--plot", str(tmp_path / "pc.png")]) == 0
    table = capsys.readouterr().out
    assert "multi-turn" in table and "fewer prefill tokens" in table
    results = json.loads(out_json.read_text())
    runs = {(r["workload"], r["prefix_caching"]): r for r in results["runs"]}
    assert len(runs) == 4
    for workload in ("multi-turn", "shared-prefix"):
        off, on = runs[(workload, "off")], runs[(workload, "on")]
        assert off["prefill_tokens"] == off["prompt_tokens"] and off["cache_hit_rate"] == 0
        assert on["prefill_tokens"] == on["prompt_tokens"] - on["cache_hit_tokens"]
        assert on["prefill_tokens"] < off["prefill_tokens"]
        assert results["agreement"][workload]["identical"] == off["requests"]
    mt = runs[("multi-turn", "on")]
    assert mt["requests"] == 9 and len(mt["prefill_tokens_per_turn"]) == 3
    assert mt["prefill_tokens_per_turn"][0] == 3 * 48          # turn 1: nothing cached yet
    assert (tmp_path / "pc.png").stat().st_size > 0


def test_throughput_benchmark(llama_path, tmp_path):
    bench = load("throughput")
    results = bench.run_benchmark(["--model", str(llama_path), "--num-requests", "4",
                                   "--input-len", "8:16", "--output-len", "4:8",
                                   "--hf-batch-size", "2", "--warmup-requests", "1",
                                   "--tp", "1,2", "--decode-heavy", "3,6,5", "--repeats", "2",
                                   "--no-tqdm"])
    rows = {r.get("label", r["engine"]): r for r in results["engines"]}
    core = rows["corellm"]
    assert core["output_tokens"] == results["workload"]["requested_output_tokens"]
    assert core["prefill_tokens_computed"] == results["workload"]["prompt_tokens"]
    assert results["agreement"]["corellm vs transformers"]["identical"] == 4
    assert results["agreement"]["corellm tp=2 vs corellm"]["identical"] == 4
    tp2 = rows["corellm tp=2"]
    assert len(tp2["memory_per_rank"]) == 2 and all(m["peak_rss"] > 0
                                                    for m in tp2["memory_per_rank"])
    # the phases ran on the same engine (tp=1 only), and every run is rated against the limit
    assert set(core["phases"]) == {"prefill-only", "decode-heavy"}
    assert core["phases"]["prefill-only"]["output_tokens"] == 4
    assert core["phases"]["decode-heavy"]["output_tokens"] == 15
    assert "phases" not in tp2 or not tp2["phases"]
    limit = results["compute_limit"]
    assert limit["gflops"] == max(limit["measurements_gflops"]) > 0
    assert limit["dtype"] == "float32"
    assert 0 < core["compute_fraction"] == core["model_gflops"] / results["compute_limit"]["gflops"]
    assert all(0 < p["compute_fraction"] for p in core["phases"].values())
    table = bench.format_tables(results)
    assert "corellm time split" in table and "peak RSS per rank" in table
    assert "decode-heavy" in table and "% of limit" in table
    # --repeats: the main workload timed twice per engine, the median reported
    assert len(core["wall_s_runs"]) == 2 and len(tp2["wall_s_runs"]) == 2
    assert core["wall_s"] == sum(core["wall_s_runs"]) / 2
    # the rate is the median of the runs' own rates (each run's tokens over its own wall)
    assert core["output_tokens_runs"] == [core["output_tokens"]] * 2
    assert core["output_tok_s"] == pytest.approx(
        sum(core["output_tokens"] / w for w in core["wall_s_runs"]) / 2)
    assert "the median of 2 timed runs" in table
    assert bench.write_plot(results, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


def test_throughput_benchmark_under_load(llama_path, tmp_path):
    """--noise-procs: each engine times the main workload again beside busy neighbours, which
    are gone afterwards; the table gives the slowdown against what the neighbours explain."""
    bench = load("throughput")

    def neighbours() -> set[int]:
        found = set()
        for proc in Path("/proc").iterdir():
            try:
                stat = (proc / "stat").read_text()
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"while True" in cmd:
                found.add(int(proc.name))
        return found

    results = bench.run_benchmark(["--model", str(llama_path), "--num-requests", "3",
                                   "--input-len", "8:16", "--output-len", "4:8", "--skip-hf",
                                   "--warmup-requests", "1", "--no-phases",
                                   "--no-compute-limit", "--noise-procs", "1", "--no-tqdm"])
    assert not neighbours()                      # stopped after the loaded runs
    load_facts = results["workload"]["under_load"]
    assert load_facts["neighbours"] == 1 and load_facts["cpus"] >= 1
    core = results["engines"][0]
    ul = core["under_load"]
    assert ul["output_tokens"] == results["workload"]["requested_output_tokens"]
    assert ul["output_tok_s"] == ul["output_tokens"] / ul["wall_s"] and ul["cores_used"] > 0
    table = bench.format_tables(results)
    cpus = load_facts["cpus"]
    assert f"explains a slowdown of {bench.explained_slowdown(cpus, 1):.2f}x" in table
    assert bench.explained_slowdown(2, 1) == 1.5 and bench.explained_slowdown(4, 0) == 1.0
    assert bench.write_plot(results, str(tmp_path / "load.png"))
    with pytest.raises(SystemExit, match="not with --cpu-quota"):
        bench.run_benchmark(["--model", str(llama_path), "--num-requests", "1", "--skip-hf",
                             "--noise-procs", "1", "--cpu-quota", "1"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_gemm_benchmark(llama_path, tmp_path, dtype):
    import torch

    from corellm_plugins.platform_cpu import gemm as cpu
    bench = load("cpu_gemm")
    args = bench.build_parser().parse_args([
        "--model", str(llama_path), "--dtype", dtype, "--num-requests", "2", "--prompt-len", "4",
        "--output-len", "3", "--rounds", "1"])
    results = bench.run(args)
    assert results["paths"] == list(cpu.available_gemm_paths(getattr(torch, dtype)))
    assert {r["plan"] for r in results["runs"]} == {"measured", *results["paths"]}
    assert all(r["output_tok_s"] > 0 and len(r["runs_s"]) == 1 for r in results["runs"])
    assert results["shapes"] and all(set(s["gflops"]["1"]) == set(results["paths"])
                                     for s in results["shapes"])
    assert f"({dtype} weights)" in bench.format_tables(results)
    assert bench.write_plot(results, str(tmp_path / "g.png"))


def test_serve_benchmark(llama_path, tmp_path):
    """benchmarks/serve.py starts the server itself, sweeps two concurrencies, stops it, runs
    the offline comparison, and leaves no process behind."""
    import subprocess
    import sys

    from tests.conftest import engine_config

    cfg = tmp_path / "server.json"
    cfg.write_text(json.dumps(engine_config(
        llama_path, scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 256})))
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "serve.py"), "--config", str(cfg), "--num-prompts", "8",
         "--input-len", "8", "--output-len", "4", "--concurrency", "1,4",
         "--warmup-requests", "1", "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "c=4" in proc.stdout and "TTFT" in proc.stdout
    assert "server exited with status 0" in proc.stderr
    results = json.loads(out_json.read_text())
    points = results["points"]
    assert [p["concurrency"] for p in points] == [1, 4]
    for p in points:
        assert p["requests"] == p["completed"] == 8 and p["failed"] == 0
        assert not p["failed_reasons"]
        assert p["total_output_tokens"] == 8 * 4 and p["total_input_tokens"] == 8 * 8
        assert p["server_counters"]["generation_tokens"] == 8 * 4
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert p[key] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):     # vLLM's key names, milliseconds
            median, p99, mean = (p[f"{s}_{metric}_ms"] for s in ("median", "p99", "mean"))
            assert 0 < median <= p99 and mean > 0, (metric, median, p99, mean)
        assert p["median_ttft_ms"] < p["median_e2el_ms"]
        assert all(r["ok"] and r["chunks"] == 4 for r in p["per_request"])
        assert p["offline"]["max_num_seqs"] == p["concurrency"]
        assert p["offline"]["output_tokens"] == 8 * 4
        assert p["offline_ratio"] == p["output_throughput"] / p["offline"]["output_throughput"]
        assert p["offline_agreement"]["of"] == 8      # greedy texts compared (batch-dependent)
    assert results["server"]["started_here"] and results["server"]["engine_core_pid"]
    for pid in (results["server"]["pid"], results["server"]["engine_core_pid"]):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z", pid
    assert out_png.stat().st_size > 0


def test_attention_benchmark(tmp_path):
    """Decode attention of torch_sdpa and triton (under the interpreter) on the same paged
    cache: the script runs, the two agree, and the floor ratio is computed from the bytes."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    out_json = tmp_path / "attn.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "attention.py"), "--backends", "torch_sdpa,triton",
         "--heads", "4", "--kv-heads", "2", "--head-size", "64", "--batch", "1,3",
         "--context", "40", "--iters", "1", "--bandwidth-mib", "16", "--device", "cpu",
         "--json", str(out_json), "--plot", str(tmp_path / "attn.png")],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| triton | 3 | 40 |" in proc.stdout
    results = json.loads(out_json.read_text())
    rows = {(r["backend"], r["batch"]): r for r in results["rows"]}
    assert len(rows) == 4
    for batch in (1, 3):
        assert rows[("torch_sdpa", batch)]["max_abs_diff_vs_first"] is None
        assert rows[("triton", batch)]["max_abs_diff_vs_first"] < 1e-4
        r = rows[("triton", batch)]
        assert r["kv_mib"] == batch * 41 * 2 * 64 * 2 * 4 / 2**20
        assert abs(r["of_floor"] - r["floor_us"] / r["median_us"]) < 1e-9
    assert (tmp_path / "attn.png").stat().st_size > 0


def test_attention_benchmark_prefill_phase(tmp_path):
    """``--phase prefill``: the CPU's SDPA prefill path against its native kernel on the same
    prompts; the two agree and GFLOP/s is causal attention's FLOPs over the time."""
    import subprocess
    import sys

    out_json = tmp_path / "attn.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "attention.py"), "--phase", "prefill",
         "--backends", "torch_sdpa:prefill=sdpa,torch_sdpa", "--heads", "6", "--kv-heads", "2",
         "--head-size", "64", "--batch", "1,3", "--context", "70", "--block-size", "16",
         "--iters", "2", "--bandwidth-mib", "16", "--device", "cpu",
         "--json", str(out_json), "--plot", str(tmp_path / "attn.png")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| torch_sdpa | 3 | 70 |" in proc.stdout
    results = json.loads(out_json.read_text())
    assert results["phase"] == "prefill"
    rows = {(r["backend"], r["batch"]): r for r in results["rows"]}
    assert len(rows) == 4
    for batch in (1, 3):
        assert rows[("torch_sdpa:prefill=sdpa", batch)]["max_abs_diff_vs_first"] is None
        r = rows[("torch_sdpa", batch)]
        assert r["max_abs_diff_vs_first"] < 1e-4
        flop = batch * 4 * 6 * 64 * 70 * 71 / 2
        assert abs(r["gflops"] - flop / (r["median_us"] * 1e-6) / 1e9) < 1e-6 * r["gflops"]
    assert (tmp_path / "attn.png").stat().st_size > 0


def test_server_abuse_benchmark(llama_path, tmp_path):
    """benchmarks/server_abuse.py starts a server per scenario, probes it while the load runs,
    and reports a table, JSON and a plot: a 900 KB request_id is refused at once (the bound),
    and a process-group SIGTERM drains every stream and ends the whole group with status 0."""
    import subprocess
    import sys

    from tests.conftest import engine_config

    cfg = tmp_path / "server.json"
    cfg.write_text(json.dumps(engine_config(llama_path)))
    out_json, out_png = tmp_path / "abuse.json", tmp_path / "abuse.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "server_abuse.py"), "--config", str(cfg),
         "--scenarios", "request-id,group-sigterm", "--max-probes", "3", "--json",
         str(out_json), "--plot", str(out_png)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "request-id" in proc.stdout and "1st token max" in proc.stdout
    rows = {r["scenario"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert rows["request-id"]["probes"] == 3 and rows["request-id"]["probes_failed"] == 0
    assert rows["request-id"]["load"].startswith("400 in")
    assert rows["group-sigterm"]["drained"] == 8 and rows["group-sigterm"]["errored"] == 0
    assert rows["group-sigterm"]["exit_status"] == 0
    assert out_png.stat().st_size > 0


def test_server_soak_benchmark(llama_path, tmp_path):
    """benchmarks/server_soak.py, a few seconds of every client kind: each gets its expected
    answer (413, 400, a dropped stream...), RSS of both processes is sampled, and the report
    says PASS or FAIL for the flatness criterion (here with a tolerance no run can miss)."""
    import subprocess
    import sys

    from tests.conftest import engine_config

    cfg = tmp_path / "server.json"
    cfg.write_text(json.dumps(engine_config(llama_path, model={"max_model_len": 256},
                                            kv_cache={"num_blocks": 1024})))
    out_json, out_png, server_log = (tmp_path / "soak.json", tmp_path / "soak.png",
                                     tmp_path / "server.log")
    kinds = ("one_token", "short", "stream_chat", "max_limit", "oversized", "malformed",
             "slow_headers", "disconnect")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "server_soak.py"), "--config", str(cfg), "--duration", "8",
         "--warmup", "3", "--final-window", "3", "--sample-s", "1", "--idle-s", "0",
         "--rss-tolerance-mb", "100000", "--slow-lines", "1", "--max-limit-tokens", "2",
         "--clients", ",".join(f"{k}=1" for k in kinds), "--server-log", str(server_log),
         "--json", str(out_json), "--plot", str(out_png)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "flatness (peak RSS in the last 3 s of load within 100000 MiB" in proc.stdout
    assert "PASS" in proc.stdout and "server log: 0 error line(s)" in proc.stdout
    results = json.loads(out_json.read_text())
    for kind in kinds:
        k = results["kinds"][kind]
        assert k["ok"] > 0 and k["failed"] == 0, (kind, k)
    assert set(results["kinds"]["oversized"]["outcomes"]) == {"413"}
    assert set(results["kinds"]["malformed"]["outcomes"]) == {"400"}
    assert set(results["kinds"]["disconnect"]["outcomes"]) == {"dropped"}
    assert results["kinds"]["one_token"]["p50_ms"] <= results["kinds"]["one_token"]["p99_ms"]
    assert results["flat"] and set(results["memory"]) == {"api", "engine"}
    assert len(results["samples"]) >= 5
    assert all(s["api_rss_mb"] > 0 and s["engine_rss_mb"] > 0 for s in results["samples"])
    assert results["health_at_end"] == 200 and not results["stuck_clients"]
    assert "stopped (exit code 0)" in server_log.read_text()
    assert out_png.stat().st_size > 0


def test_sim_speed_benchmark(tmp_path, capsys, llama_path, monkeypatch):
    """The whole simulated `corellm bench` command, timed in a subprocess on a derived roofline
    profile of the test checkpoint: the table and the JSON hold the run's steps, simulated and
    wall seconds."""
    monkeypatch.setenv("CORELLM_DEFAULT_MODEL", str(llama_path))
    bench = load("sim_speed")
    out_json = tmp_path / "sim_speed.json"
    assert bench.main(["--quick", "--repeats", "1", "--json", str(out_json)]) == 0
    assert "| 200 32/8 @100 | 200 |" in capsys.readouterr().out
    results = json.loads(out_json.read_text())
    (row,) = results["rows"]
    mine = row["this"]
    assert mine["completed"] == 200 and mine["engine_steps"] > 0
    assert mine["simulated_s"] > 0 and len(mine["wall_s"]) == 1
    assert mine["median_s"] == mine["min_s"] == mine["wall_s"][0] > 0


def test_host_cost_benchmark(tmp_path, capsys, llama_path, monkeypatch):
    """The engine's host work per generated token on a free simulated device: a steady batch
    of decoding requests, timed in a subprocess; the table and the JSON hold µs per token and
    the phases."""
    monkeypatch.setenv("CORELLM_DEFAULT_MODEL", str(llama_path))
    bench = load("host_cost")
    out_json = tmp_path / "host_cost.json"
    assert bench.main(["--quick", "--json", str(out_json)]) == 0
    assert "| 8 |" in capsys.readouterr().out
    (row,) = json.loads(out_json.read_text())["rows"]
    run = row["this"]["runs"][0]
    assert run["tokens"] == 8 * 50                     # every running request, every step
    assert 0 < row["this"]["us_per_token"] < 1e4
    assert set(row["this"]["phase_us_per_token"]) == {"schedule", "execute", "update"}


def test_gpu_bringup_decode_profile_dry_run(make_checkpoint, tmp_path, capsys):
    """``gpu_bringup.py profile`` on the CPU (its dry run): a decode step at a fixed batch and
    context, greedy and sampled, with its floor; the device columns stay empty off a GPU."""
    bench = load("gpu_bringup")
    out = tmp_path / "profile.json"
    model = make_checkpoint("qwen3")
    assert bench.main(["profile", "--model", str(model), "--device", "cpu", "--dtype",
                       "float32", "--batch", "4", "--context", "24", "--steps", "4",
                       "--warmup", "2", "--profile-steps", "2", "--temperature", "0,0.6",
                       "--json", str(out)]) == 0
    assert "| temperature | batch |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["temperature"] for r in rows] == [0.0, 0.6]
    for r in rows:
        assert r["batch"] == 4 and r["mean_context"] == 24 + 2 + 4 // 2 + 1
        assert r["step_ms_device"] is None and r["kernels_per_step"] is None
        assert r["step_ms_host"] > 0 and r["floor_ms"] > 0 and r["tok_s"] > 0
        # the tensors' bytes: each file less its 8-byte length and JSON header
        files = list(model.glob("*.safetensors"))
        headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
        assert r["weight_bytes"] == sum(f.stat().st_size for f in files) - headers


def test_the_scripts_plot_with_the_bench_plugins_helper(monkeypatch):
    """One matplotlib helper: ``_common.pyplot`` is the bench plugin's ``pyplot_for``, every
    script that plots through it imports it from ``_common``, and without matplotlib the skip
    is logged with the script's own log."""
    import ast
    import sys

    from corellm_plugins.bench.report import pyplot_for

    common = load("_common")
    assert common.pyplot is pyplot_for
    callers = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "pyplot"]
        if not calls or path.name == "_common.py":
            continue
        callers.append(path.stem)
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and any(a.name == "pyplot" for a in n.names)}
        assert imported and imported <= {"_common", "benchmarks._common"}, path.name
        assert all(len(c.args) == 2 for c in calls), path.name       # (path, log)
    assert {"serve", "throughput", "prefix_cache"} <= set(callers)
    logged: list[str] = []
    monkeypatch.setitem(sys.modules, "matplotlib", None)            # import fails
    assert common.pyplot("x.png", logged.append) is None
    assert logged == ["--plot x.png: matplotlib is not installed (pip install matplotlib); "
                      "skipped"]


def test_quant_kernels_benchmark(tmp_path):
    bench = load("quant_kernels")
    args = bench.build_parser().parse_args([
        "--formats", "Q4_1,Q6_K", "--shapes", "16x256,9x512", "--rows", "1,5", "--rounds", "2",
        "--seconds", "0.001"])
    results = bench.run(args)
    cases = results["cases"]
    assert [(c["format"], c["n"], c["k"], c["rows"]) for c in cases] == [
        (q, n, k, m) for q in ("Q4_1", "Q6_K") for n, k in ((16, 256), (9, 512)) for m in (1, 5)]
    assert all(c["gflops"]["interleaved"] > 0 and c["gflops"]["rows"] > 0 for c in cases)
    # the same blocks in both layouts: the outputs differ only in the last bits
    assert all(c["max_rel_diff"] < 1e-5 for c in cases), cases
    assert "interleaved GF/s" in bench.format_tables(results)
    assert bench.write_plot(results, str(tmp_path / "q.png"))


def test_lora_benchmark(llama_path, tmp_path):
    pytest.importorskip("peft")
    bench = load("lora")
    args = bench.build_parser().parse_args([
        "--model", str(llama_path), "--work-dir", str(tmp_path / "work"), "--requests", "6",
        "--adapters", "2", "--rank", "4", "--input-len", "8:16", "--output-len", "4",
        "--rounds", "1"])
    results = bench.run(args)
    arms = results["arms"]
    assert set(arms) == {"base", "multi-lora", "merged"}
    assert all(a["tok_s"] > 0 for a in arms.values())
    # two merged copies hold twice the weights; the slots add a little to one copy
    assert arms["merged"]["weights_bytes"] == 2 * arms["base"]["weights_bytes"]
    assert arms["base"]["weights_bytes"] < arms["multi-lora"]["weights_bytes"] \
        < arms["merged"]["weights_bytes"]
    assert results["agreement_multi_lora_vs_merged"]["of"] == 6
    assert "multi-lora" in bench.format_tables(results)
    assert bench.write_plot(results, str(tmp_path / "lora.png"))
