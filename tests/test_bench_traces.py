"""Production traces as a workload (``corellm bench --dataset-name trace``): Azure CSV and
Mooncake JSONL rows become requests at their timestamps (scaled by the speed-up, chosen by the
window, the seeded sample and the count cap), Mooncake hash ids share token blocks, bad rows are
named by file and line, and a bench run on the sim executor sees the trace's prefix reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corellm_plugins.bench.traces import (TraceOptions, parse_timestamp, read_trace,
                                          select_rows, trace_workload)
from corellm_plugins.bench.workload_spec import WorkloadError

VOCAB = 1000


def azure(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{t},{c},{g}\n" for t, c, g in rows))
    return path


def mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n,
                                        "output_length": m, "hash_ids": ids}) + "\n"
                            for t, n, m, ids in rows))
    return path


def build(path: Path, seed: int = 0, **options):
    return trace_workload(read_trace(path), vocab_size=VOCAB, seed=seed,
                          options=TraceOptions(**options), quiet=True)


AZURE_ROWS = [("2023-11-16 18:15:46.6805900", 10, 3), ("2023-11-16 18:15:47.1805900", 20, 4),
              ("2023-11-16 18:15:50.0000000", 30, 5), ("2023-11-16 18:16:46.6805900", 40, 6)]


def test_azure_timestamps_with_seven_fractional_digits():
    assert parse_timestamp("2023-11-16 18:15:46.6805900") - parse_timestamp(
        "2023-11-16 18:15:46") == pytest.approx(0.68059)
    assert parse_timestamp("2023-11-16T18:15:46Z") == parse_timestamp("2023-11-16 18:15:46")
    assert parse_timestamp("2023-11-16 19:15:46+01:00") == parse_timestamp("2023-11-16 18:15:46")
    assert parse_timestamp("12.5") == 12.5
    with pytest.raises(ValueError):
        parse_timestamp("yesterday")


def test_azure_arrivals_lengths_and_speedup(tmp_path):
    path = azure(tmp_path / "azure.csv", AZURE_ROWS)
    w = build(path)
    assert [r.delay_s for r in w.requests] == pytest.approx([0.0, 0.5, 3.3194100, 60.0])
    assert [len(r.prompt_token_ids) for r in w.requests] == [10, 20, 30, 40]
    assert [r.output_len for r in w.requests] == [3, 4, 5, 6]
    assert all(r.ignore_eos and r.follows is None for r in w.requests)
    assert all(0 <= t < VOCAB for r in w.requests for t in r.prompt_token_ids)
    fast = build(path, speedup=4)
    assert [r.delay_s for r in fast.requests] == pytest.approx([0.0, 0.125, 0.829852, 15.0])
    assert w.description == "trace azure.csv: 4 of 4 requests over 60.0 s, seed 0"
    # Same seed, same prompts; another seed, others.
    assert build(path).requests == w.requests
    assert build(path, seed=1).requests[0].prompt_token_ids != w.requests[0].prompt_token_ids


def test_window_sample_and_count_cap(tmp_path):
    rows = [(f"2024-05-10 00:00:{s:02d}.5000000", 8, 2) for s in range(60)]
    path = azure(tmp_path / "a.csv", rows)
    w = build(path, window=(10, 20))
    assert len(w.requests) == 10 and w.requests[0].delay_s == 0.0
    assert w.requests[-1].delay_s == pytest.approx(9.0)
    assert [len(r.prompt_token_ids) for r in build(path, window=(None, 5)).requests] == [8] * 5
    assert len(build(path, window=(55, None)).requests) == 5
    half = build(path, sample=0.5, seed=2)
    assert 15 < len(half.requests) < 45
    again = build(path, sample=0.5, seed=2)
    assert [r.delay_s for r in again.requests] == [r.delay_s for r in half.requests]
    other = build(path, sample=0.5, seed=3)
    assert [r.delay_s for r in other.requests] != [r.delay_s for r in half.requests]
    # A row's draw does not depend on the window: the samples of nested windows nest.
    trace = read_trace(path)
    everywhere = {r.t for r in select_rows(trace, TraceOptions(sample=0.5), 2)[0]}
    inside = {r.t for r in select_rows(trace, TraceOptions(sample=0.5, window=(20, 40)), 2)[0]}
    assert inside and inside == {t for t in everywhere if 20 <= t - trace.rows[0].t < 40}
    capped = build(path, window=(30, None), num_prompts=4)
    assert len(capped.requests) == 4 and capped.requests[-1].delay_s == pytest.approx(3.0)
    assert capped.spec["kept"] == {"rows": 60, "window": 30, "sample": 30, "fit": 30, "sent": 4}
    with pytest.raises(WorkloadError, match="--trace-window: .*no request left"):
        build(path, window=(100, None))


def test_mooncake_hash_ids_share_blocks(tmp_path):
    path = mooncake(tmp_path / "mc.jsonl", [
        (0, 700, 5, [1, 2]), (1500, 600, 6, [1, 3]), (2000, 512, 7, [4]),
        (2500, 300, 8, [1])])
    w = build(path)
    a, b, c, d = (r.prompt_token_ids for r in w.requests)
    assert [len(p) for p in (a, b, c, d)] == [700, 600, 512, 300]
    assert a[:512] == b[:512]                       # the same first hash id
    assert a[512:600] != b[512:600]                 # different second ids
    assert c != a[:512]                             # another first id, another block
    assert d == a[:300]                             # the last block cut to input_length
    assert [r.delay_s for r in w.requests] == pytest.approx([0.0, 1.5, 2.0, 2.5])
    small = build(path, block_size=100)
    p0, p1 = small.requests[0].prompt_token_ids, small.requests[1].prompt_token_ids
    assert len(p0) == 700 and p0[:100] == p1[:100] and p0[100:200] != p1[100:200]
    # 700 tokens but two blocks of 100: the rest is random and not shared
    assert p0[200:600] != p1[200:600]
    assert "blocks of 100" in small.description


def test_bad_rows_are_named_by_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,10,3\n"
                   "2023-11-16 18:15:47.1,ten,3\n")
    with pytest.raises(WorkloadError, match=r"bad.csv:3: ContextTokens must be an integer"):
        read_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nlater,10,3\n")
    with pytest.raises(WorkloadError, match=r"bad.csv:2: TIMESTAMP 'later'"):
        read_trace(bad)
    bad.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(WorkloadError, match=r"bad.csv:1: expected the header"):
        read_trace(bad)
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [1]}\n'
                  '{"timestamp": 5, "input_length": 4}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: missing output_length"):
        read_trace(jl)
    jl.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2, "hash_ids": [-1]}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:1: hash_ids must be"):
        read_trace(jl)
    odd = tmp_path / "trace.txt"
    odd.write_text("hello\n")
    with pytest.raises(WorkloadError, match="not a trace this reads"):
        read_trace(odd)
    sniffed = tmp_path / "trace.log"       # no telling extension: the content decides
    sniffed.write_text('{"timestamp": 0, "input_length": 4, "output_length": 2}\n')
    assert read_trace(sniffed).format == "mooncake"


def test_cli_replays_a_trace_on_the_sim_executor(llama_path, tmp_path, capsys):
    from corellm.cli.commands import main
    from tests.test_sim import make_profile, sim_config

    profile = make_profile(llama_path, tmp_path / "profile.json")
    cfg = tmp_path / "sim.json"
    cfg.write_text(json.dumps(sim_config(llama_path, profile)))
    # Blocks of 32 tokens; most requests start with hash ids 1, 2 (a shared system prompt).
    rows = [(i * 250, 80 + 8 * (i % 3), 4 + i % 3, [1, 2, 100 + i]) for i in range(10)]
    rows += [(2600, 3000, 4, [7])]      # longer than the model's context: left out
    trace = mooncake(tmp_path / "mc.jsonl", rows)
    out = tmp_path / "r.json"
    assert main(["bench", "--config", str(cfg), "--dataset-name", "trace",
                 "--dataset-path", str(trace), "--trace-block-size", "32",
                 "--trace-speedup", "2", "--num-warmups", "0", "--no-progress",
                 "--result-filename", str(out)]) == 0
    err = capsys.readouterr().err
    assert "11 rows, 10 fit max_model_len, 10 sent" in err
    res = json.loads(out.read_text())
    assert res["completed"] == 10 and res["failed"] == 0
    assert res["total_output_tokens"] == sum(r[2] for r in rows[:10])
    # Hits from the shared hash blocks, not from preempted requests finding their own blocks.
    assert res["prefix_cache_hit_rate"] > 0 and res["num_preemptions"] == 0
    assert all(r["cached_tokens"] >= 64 for r in res["runs"][0]["requests"][1:])
    assert res["settings"]["dataset_name"] == "trace" and res["settings"]["trace_speedup"] == 2
    assert res["settings"]["trace_format"] == "mooncake" and res["settings"]["request_rate"] is None
    arrivals = [r["arrival_s"] for r in res["runs"][0]["requests"]]
    assert arrivals[-1] - arrivals[0] == pytest.approx(9 * 0.125, abs=0.01)
