#!/usr/bin/env python
"""Online serving: the OpenAI server under concurrent streaming load, against offline ``LLM``.

Starts ``python3 -m corellm serve --config CFG --port 0`` (or uses a running server, ``--url``),
warms it up, then for each load point sends the workload's requests to ``/v1/completions`` as
streaming requests (``stream_options.include_usage``, ``ignore_eos``, temperature 0 by default,
so every request generates exactly its output length) and measures, per point:

* throughput: requests/s, output tokens/s, total (prompt + output) tokens/s, over the point's
  duration (first request sent to last response finished);
* TTFT: request sent to the first streamed chunk that carries tokens;
* TPOT: per request, (E2E - TTFT) / (output tokens - 1);
* ITL: every gap between two consecutive token-carrying chunks of a request;
* E2E: request sent to the end of its stream;

each as mean, median, std, p90 and p99 under ``vllm bench serve``'s key names (``mean_ttft_ms``,
``p99_itl_ms``, ...). This script is a thin sweep over the ``corellm bench`` harness: the client,
the server process, the metrics and the offline engine runs are the bench plugin's
``server_client``, ``server_process``, ``metrics`` and ``engine_driver``
(``corellm_plugins.bench``), shared with ``corellm bench``. Output tokens are counted from the
usage chunk, and every request must get exactly the expected number: a request that errors,
ends early or gets a different count is a failure, counted and reported (its latencies are left
out of the statistics), never dropped silently.

Load: ``--concurrency 1,4,16,64`` (a closed loop: at most N requests in flight, a new one sent
as soon as one finishes) and/or ``--request-rate R[,R...]`` (Poisson arrivals, seeded; ``inf``
sends every request at once); with both, each rate runs at each concurrency.

Offline comparison (``--offline``, the default when the script starts the server itself): once
the server has been stopped -- the two never share the CPU -- the same prompts of each point run
through an in-process engine (the harness's offline target), with ``scheduler.max_num_seqs`` =
the point's concurrency and the server's config otherwise (engine built and warmed up outside
the timing).
The table reports server / offline output throughput; the target for the demo model is >= 0.9.
(Offline, a point's requests are all submitted at once; against a ``--request-rate`` point that
makes the ratio a lower bound on how close the server gets.)

Every point's requests carry their own ``cache_salt`` (server and offline alike), so no point
finds the previous point's prompts in the prefix cache.

Examples::

    python benchmarks/serve.py                                   # demo model, concurrency 1,4,16,64
    python benchmarks/serve.py --num-prompts 16 --input-len 32 --output-len 16 --concurrency 1,4
    python benchmarks/serve.py --config cfg.yaml --json out.json --plot out.png
    python benchmarks/serve.py --url http://127.0.0.1:8000 --request-rate 1,2,4,inf
    python benchmarks/serve.py --dataset prompts.jsonl           # {"prompt": "...", "max_tokens": 64}

Progress goes to stderr; the table to stdout. The exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (logger, model_facts, parse_int_list, parse_range, pyplot,  # noqa: E402
                     random_token_requests, report, warn_if_busy)

from corellm_plugins.bench.cli import HelpFormatter, positive_int  # noqa: E402
from corellm_plugins.bench.env import environment, loadavg, proc_cpu_seconds  # noqa: E402
from corellm_plugins.bench.metrics import RequestRecord, summarize  # noqa: E402
from corellm_plugins.bench.engine_driver import run_engine  # noqa: E402
from corellm_plugins.bench.server_client import (  # noqa: E402
    counter_deltas, drive_server, http_clients, scrape_counters, server_info)
from corellm_plugins.bench.server_process import ServerProcess  # noqa: E402
from corellm_plugins.bench.sessions import warmup_workload  # noqa: E402
from corellm_plugins.bench.targets import RunOptions, Target  # noqa: E402
from corellm_plugins.bench.workload import BenchRequest, Workload  # noqa: E402

# As under the `corellm` command (and in the other benchmarks): corellm's CPU workers may tune
# the allocator. Inherited by the server this script starts, so both sides run alike.
os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logger("serve")
OFFLINE_TARGET = 0.9
PERCENTILES = (90.0, 99.0)


# ----------------------------------------------------------------------------- the workload
def load_dataset(path: str, num: int | None, output_len: tuple[int, int], seed: int,
                 ) -> list[dict[str, Any]]:
    """JSONL lines ``{"prompt": text, "max_tokens": N (optional)}``; the first ``num``."""
    rng = random.Random(seed)
    reqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f"--dataset {path}:{lineno}: expected a JSON object with a "
                                 "\"prompt\" string") from None
            if not isinstance(prompt, str) or not prompt:
                raise SystemExit(f"--dataset {path}:{lineno}: \"prompt\" must be a non-empty "
                                 "string")
            n = obj.get("max_tokens") or rng.randint(*output_len)
            reqs.append({"prompt": prompt, "output_len": int(n)})
            if num is not None and len(reqs) >= num:
                break
    if not reqs:
        raise SystemExit(f"--dataset {path}: no prompts")
    if num is not None and len(reqs) < num:
        log(f"WARNING: --dataset {path} has {len(reqs)} prompts, fewer than --num-prompts {num}")
    return reqs


def points_of(args: argparse.Namespace) -> list[tuple[int | None, float]]:
    concurrencies = args.concurrency or ([None] if args.request_rate else [1, 4, 16, 64])
    rates = args.request_rate or [math.inf]
    return [(c, r) for c in concurrencies for r in rates]


def point_label(concurrency: int | None, rate: float) -> str:
    parts = [f"c={concurrency}" if concurrency else "c=all"]
    if rate != math.inf:
        parts.append(f"{rate:g}/s")
    return " ".join(parts)


def requests_per_point(args: argparse.Namespace, concurrency: int | None) -> int:
    if args.num_prompts:
        return args.num_prompts
    return max(32, 4 * concurrency) if concurrency else 128


def _rates(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected R[,R...] (requests/s or inf), "
                                         f"got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"request rates must be > 0, got {text!r}")
    return values



# ----------------------------------------------------------------------------- the load
def point_workload(reqs: list[dict[str, Any]], rate: float, seed: int, label: str) -> Workload:
    """A point's requests as a harness workload: Poisson arrivals at ``rate`` (seeded), or all
    at once for ``inf``."""
    gaps = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(reqs):
        out.append(BenchRequest(index=i, prompt_token_ids=r["prompt_token_ids"],
                                output_len=r["output_len"], delay_s=t))
        if rate != math.inf:
            t += gaps.expovariate(rate)
    return Workload(out, f"{label}: {len(out)} requests")


def point_metrics(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """The harness's summary (vLLM key names) plus what this sweep reports besides."""
    ok = [r for r in records if r.ok]
    chunks = sum(len(r.chunk_times_s) for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), **summarize(records, duration, percentiles=PERCENTILES),
        # > 1: the server sent several tokens in one chunk (the API process fell behind).
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "per_request": [{"ok": r.ok, "ttft_s": r.ttft, "e2el_s": r.e2el,
                         "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                         "chunks": len(r.chunk_times_s),
                         **({"error": r.error} if r.error else {})} for r in records],
    }


async def sweep(url: str, model: str | None, reqs: list[dict[str, Any]],
                args: argparse.Namespace, server: ServerProcess | None, run_id: str,
                ) -> list[dict[str, Any]]:
    options = RunOptions(temperature=args.temperature, request_timeout=args.request_timeout,
                         progress=False, keep_outputs=True)
    points = []
    sync_client, client = http_clients(args.request_timeout)
    with sync_client:
        async with client:
            if args.warmup_requests:
                log(f"warm-up: {args.warmup_requests} requests...")
                warm = warmup_workload(point_workload(reqs, math.inf, args.seed, "warm-up"),
                                       args.warmup_requests, 16)
                recs, _ = await drive_server(client, url, model, warm, options,
                                             salt=f"{run_id}-warmup")
                bad = [r.error for r in recs if not r.ok]
                if bad:
                    raise RuntimeError(f"warm-up requests failed: {bad[0]}")
            for concurrency, rate in points_of(args):
                label = point_label(concurrency, rate)
                mine = reqs[:requests_per_point(args, concurrency)]
                log(f"{label}: sending {len(mine)} requests...")
                counters0 = scrape_counters(sync_client, url)
                cpu0 = {"client": time.process_time(),
                        "server_api": proc_cpu_seconds(server.pid if server else None),
                        "engine_core": proc_cpu_seconds(server.engine_pid if server else None)}
                load0 = loadavg()
                records, duration = await drive_server(
                    client, url, model, point_workload(mine, rate, args.seed, label),
                    replace(options, max_concurrency=concurrency), salt=f"{run_id}-{label}")
                cpu1 = {"client": time.process_time(),
                        "server_api": proc_cpu_seconds(server.pid if server else None),
                        "engine_core": proc_cpu_seconds(server.engine_pid if server else None)}
                counters1 = scrape_counters(sync_client, url)
                row = {"label": label, "concurrency": concurrency,
                       "request_rate": None if rate == math.inf else rate,
                       **point_metrics(records, duration)}
                # CPU seconds per wall second of the point, per process (2.0 = two cores busy).
                row["cpu_cores_busy"] = {k: (cpu1[k] - cpu0[k]) / duration
                                         for k in cpu0 if cpu0[k] is not None
                                         and cpu1[k] is not None}
                row["loadavg_1min_before"], row["loadavg_1min_after"] = load0, loadavg()
                if counters0 and counters1:
                    delta = counter_deltas(counters0, counters1)
                    row["server_counters"] = delta
                    steps = delta.get("engine_steps") or 0
                    row["server_tokens_per_step"] = (
                        delta.get("generation_tokens", 0) / steps if steps else None)
                row["_texts"] = [r.output_text if r.ok else None for r in records]
                log(f"{label}: {row['completed']}/{row['requests']} ok in {duration:.2f} s: "
                    f"{row['output_throughput']:.1f} output tok/s, TTFT p50 "
                    f"{_ms(row['median_ttft_ms'])} ms, TPOT p50 {_ms(row['median_tpot_ms'])} ms")
                for err, count in row["failed_reasons"].items():
                    log(f"{label}: {count} request(s) failed: {err}")
                points.append(row)
    return points


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


# ----------------------------------------------------------------------------- offline
def run_offline(base: dict[str, Any], max_num_seqs: int | None, reqs: list[dict[str, Any]],
                args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """The same requests, all submitted at once, through the harness's in-process engine
    target (built, warmed up and shut down outside the timing)."""
    import torch

    config = copy.deepcopy(base)
    config.pop("frontend", None)
    if max_num_seqs:
        config["scheduler"] = {**(config.get("scheduler") or {}), "max_num_seqs": max_num_seqs}
    options = RunOptions(temperature=args.temperature, warmup_requests=args.warmup_requests,
                         progress=False, keep_outputs=True)
    run = run_engine(Target(f"offline-{max_num_seqs}", config=config),
                     point_workload(reqs, math.inf, args.seed, "offline"), options)
    s = summarize(run.records, run.duration)
    expected = sum(r["output_len"] for r in reqs)
    if s["total_output_tokens"] != expected:
        log(f"WARNING: offline run produced {s['total_output_tokens']} output tokens, "
            f"expected {expected}")
    steps = run.counters["engine_steps"]
    return {"max_num_seqs": run.info["max_num_seqs"], "requests": len(reqs),
            "wall_s": run.duration, "load_s": run.info["load_s"],
            "output_tokens": s["total_output_tokens"], "prompt_tokens": s["total_input_tokens"],
            "output_throughput": s["output_throughput"],
            "total_token_throughput": s["total_token_throughput"],
            "request_throughput": s["request_throughput"], "num_steps": steps,
            "tokens_per_step": s["total_output_tokens"] / steps if steps else None,
            "num_preemptions": run.counters["num_preemptions"], "cpu_s": run.info["cpu_s"],
            "cpu_util": run.info["cpu_s"] / (run.duration * torch.get_num_threads()),
            "_texts": [tokenizer.decode(r.output_token_ids or [], skip_special_tokens=True)
                       for r in run.records]}


# ----------------------------------------------------------------------------- reporting
COLUMNS = [  # group, header, width, value(row) -> str
    ("load", "", 10, lambda r: r["label"]),
    ("", "reqs", 5, lambda r: str(r["requests"])),
    ("", "fail", 4, lambda r: str(r["failed"])),
    ("", "req/s", 7, lambda r: f"{r['request_throughput']:.2f}"),
    ("output tok/s", "server", 8, lambda r: f"{r['output_throughput']:.1f}"),
    ("", "offline", 8, lambda r: f"{r['offline']['output_throughput']:.1f}"
     if r.get("offline") else "-"),
    ("", "ratio", 5, lambda r: f"{r['offline_ratio']:.2f}"
     if r.get("offline_ratio") is not None else "-"),
    ("TTFT ms", "mean", 7, lambda r: _ms(r["mean_ttft_ms"])),
    ("", "p50", 7, lambda r: _ms(r["median_ttft_ms"])),
    ("", "p99", 7, lambda r: _ms(r["p99_ttft_ms"])),
    ("TPOT ms", "mean", 6, lambda r: _ms(r["mean_tpot_ms"])),
    ("", "p50", 6, lambda r: _ms(r["median_tpot_ms"])),
    ("", "p99", 6, lambda r: _ms(r["p99_tpot_ms"])),
    ("ITL ms", "p50", 6, lambda r: _ms(r["median_itl_ms"])),
    ("", "p99", 6, lambda r: _ms(r["p99_itl_ms"])),
    ("E2E s", "mean", 6, lambda r: _seconds(r["mean_e2el_ms"])),
    ("", "p99", 6, lambda r: _seconds(r["p99_e2el_ms"])),
]


def _seconds(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms / 1e3:.2f}"


def format_tables(results: dict[str, Any]) -> str:
    groups, heads = [], []
    for i, (group, head, width, _) in enumerate(COLUMNS):
        if i == 0:
            groups.append(f"{group:<{width}}")
            heads.append(f"{head:<{width}}")
            continue
        groups.append(f"{group:<{width}}" if group else " " * width)
        heads.append(f"{head:>{width}}")
    lines = [" ".join(groups).rstrip(), " ".join(heads)]
    lines.append("-" * len(lines[1]))
    for r in results["points"]:
        cells = [f"{fn(r):<{w}}" if i == 0 else f"{fn(r):>{w}}"
                 for i, (_, _, w, fn) in enumerate(COLUMNS)]
        lines.append(" ".join(cells))
    w = results["workload"]
    lines.append("")
    lines.append(f"server {results['server']['model_name']!r} at {results['server']['url']}; "
                 f"workload: {w['description']}; temperature {w['temperature']}, ignore_eos")
    ratios = [(r["offline_ratio"], r["label"]) for r in results["points"]
              if r.get("offline_ratio") is not None]
    if ratios:
        worst = min(ratios)
        lines.append("server / offline output throughput: "
                     + ", ".join(f"{lbl} {q:.2f}" for q, lbl in ratios)
                     + f"; lowest {worst[0]:.2f} ({worst[1]}), target >= {OFFLINE_TARGET}: "
                     + ("met" if worst[0] >= OFFLINE_TARGET else "NOT met"))
    agree = [f"{r['label']} {r['offline_agreement']['identical']}/"
             f"{r['offline_agreement']['of']}" for r in results["points"]
             if r.get("offline_agreement")]
    if agree:
        lines.append("greedy text identical to offline: " + ", ".join(agree))
    batch = [f"{r['label']} {r['server_tokens_per_step']:.1f}"
             + (f" (offline {r['offline']['tokens_per_step']:.1f})"
                if r.get("offline") and r["offline"].get("tokens_per_step") else "")
             for r in results["points"] if r.get("server_tokens_per_step")]
    if batch:
        lines.append("output tokens per engine step: " + ", ".join(batch))
    chunky = [f"{r['label']} {r['tokens_per_chunk']:.2f}" for r in results["points"]
              if r.get("tokens_per_chunk") and r["tokens_per_chunk"] > 1.01]
    if chunky:
        lines.append("tokens per streamed chunk > 1 (the API process sent several tokens at "
                     "once; ITL counts one gap per chunk): " + ", ".join(chunky))
    cpu = []
    for r in results["points"]:
        busy = r.get("cpu_cores_busy") or {}
        cpu.append(f"{r['label']} " + " / ".join(
            f"{busy[k]:.2f}" if k in busy else "-"
            for k in ("engine_core", "server_api", "client")))
    lines.append("CPU cores busy during each point, engine core / API server / this client: "
                 + ", ".join(cpu))
    off = [f"{r['label']} {100 * r['offline']['cpu_util']:.0f}%" for r in results["points"]
           if r.get("offline")]
    if off:
        lines.append("CPU utilization of the offline runs (process CPU s / wall s / threads): "
                     + ", ".join(off))
    for r in results["points"]:
        for err, count in r["failed_reasons"].items():
            lines.append(f"FAILED {r['label']}: {count} request(s): {err}")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    pts = results["points"]
    xs = list(range(len(pts)))
    labels = [p["label"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=110)
    ax = axes[0]
    ax.plot(xs, [p["output_throughput"] for p in pts], marker="o", color="#3b75af",
            label="server")
    off = [(x, p) for x, p in zip(xs, pts) if p.get("offline")]
    if off:
        ax.plot([x for x, _ in off], [p["offline"]["output_throughput"] for _, p in off],
                marker="s", color="#999999", label="offline LLM")
        for x, p in off:
            ax.annotate(f"{p['offline_ratio']:.2f}", (x, p["output_throughput"]),
                        textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8,
                        color="#3b75af")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput (label: server / offline)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    for ax, metric, title in ((axes[1], "ttft", "time to first token"),
                              (axes[2], "tpot", "time per output token")):
        for q, stat, style in (("p50", "median", "-"), ("p99", "p99", "--")):
            ax.plot(xs, [math.nan if p[f"{stat}_{metric}_ms"] is None
                         else p[f"{stat}_{metric}_ms"] for p in pts],
                    style, marker="o", color="#3b75af", label=f"server {q}")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(xs, labels, fontsize=8)
        ax.set_xlabel("load point (concurrency, request rate)")
    w = results["workload"]
    fig.suptitle(f"corellm serve: {results['server']['model_name']}, {w['description']}, "
                 f"{results['environment']['cpu_model']}, {results['environment']['cpu_count']} "
                 "CPUs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--url", help="a running server (e.g. http://127.0.0.1:8000); default: start "
                   "`python -m corellm serve` with --config on a free port, stop it at the end")
    s.add_argument("--config", help="config file for the server started here and for the "
                   "offline runs (default: the demo model); with --url, the model's tokenizer "
                   "and the offline config come from here")
    s.add_argument("--server-timeout", type=float, default=300,
                   help="seconds to wait for the started server to be ready")
    s.add_argument("--server-log", metavar="FILE", help="write the started server's output here "
                   "(default: kept in memory, its tail shown on errors)")
    s.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=positive_int, default=None, help="requests per load point "
                   "(default: max(32, 4 x concurrency); 128 without a concurrency limit). Each "
                   "point sends the first N prompts of one list")
    w.add_argument("--input-len", type=parse_range, default="128", metavar="N|LO:HI",
                   help="prompt tokens of the random workload")
    w.add_argument("--output-len", type=parse_range, default="128", metavar="N|LO:HI",
                   help="output tokens per request (dataset lines without max_tokens too)")
    w.add_argument("--dataset", metavar="FILE.jsonl", help="prompts instead of random tokens: "
                   "one JSON object per line, {\"prompt\": text, \"max_tokens\": N (optional)}")
    w.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    w.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (server and offline texts are then compared too)")
    w.add_argument("--warmup-requests", type=int, choices=range(0, 1025), metavar="N", default=2,
                   help="untimed requests sent at once before the sweep and before each "
                        "offline run (the first N prompts, 16 output tokens)")
    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", type=parse_int_list, default=None, metavar="N[,N...]",
                    help="maximum requests in flight (default 1,4,16,64, or no limit when only "
                         "--request-rate is given)")
    ld.add_argument("--request-rate", type=_rates, default=None, metavar="R[,R...]",
                    help="Poisson arrivals at R requests/s; inf: all at once (the default)")
    o = p.add_argument_group("offline comparison")
    o.add_argument("--offline", action=argparse.BooleanOptionalAction, default=None,
                   help="after the server is stopped, run each point's prompts through the "
                        "offline LLM with scheduler.max_num_seqs = concurrency (default: on when "
                        "this script starts the server, off with --url)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="OUT.json", help="write all results and the environment")
    out.add_argument("--plot", metavar="OUT.png", help="throughput and latency per load point "
                     "(matplotlib)")
    return p


def base_config(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """The config as a dict, and the model directory it names (the demo model by default)."""
    from corellm.config import read_config_file

    data = read_config_file(args.config) if args.config else {}
    path = (data.get("model") or {}).get("path")
    if path:
        return data, Path(path)
    from corellm.checkpoint.demo import ensure_demo_model
    return data, ensure_demo_model()


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from corellm_plugins.bench.targets import prompt_token_space

    if args.offline is None:
        args.offline = args.url is None
    config, model = base_config(args)
    facts = model_facts(model)
    tokenizer, vocab, special = prompt_token_space(model)
    points = points_of(args)
    n_max = max(requests_per_point(args, c) for c, _ in points)
    if args.dataset:
        reqs = [{"prompt_token_ids": tokenizer.encode(r["prompt"]), "output_len": r["output_len"]}
                for r in load_dataset(args.dataset, n_max, args.output_len, args.seed)]
        description = (f"{len(reqs)} prompts from {args.dataset}, "
                       f"{sum(r['output_len'] for r in reqs)} output tokens")
    else:
        reqs = random_token_requests(n_max, args.input_len, args.output_len, args.seed, vocab,
                                     special)
        description = (f"random prompts, in {_range(args.input_len)}, out "
                       f"{_range(args.output_len)} tokens")
    run_id = f"serve-bench-{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {
        "environment": environment(), "command": None,
        "model": {"path": str(model), **facts},
        "server": {"url": args.url, "started_here": args.url is None, "config_file": args.config,
                   "config": config},
        "workload": {"description": description, "dataset": args.dataset,
                     "num_prompts": args.num_prompts,
                     "input_len": None if args.dataset else _range(args.input_len),
                     "output_len": _range(args.output_len), "seed": args.seed,
                     "temperature": args.temperature, "ignore_eos": True,
                     "warmup_requests": args.warmup_requests,
                     "requests_per_point": {point_label(c, r): min(
                         len(reqs), requests_per_point(args, c)) for c, r in points}},
        "offline_target": OFFLINE_TARGET, "points": [],
    }
    warn_if_busy(log)
    server = None if args.url else ServerProcess(args.config, args.server_timeout,
                                                 args.server_log)
    try:
        if server:
            server.start()
            url = server.url
        else:
            url = args.url.rstrip("/")
        with httpx.Client(trust_env=False, timeout=30) as sync_client:
            info = server_info(sync_client, url)
        model_name, max_model_len = info["model_name"], info["max_model_len"]
        results["server"].update(url=url, model_name=model_name, max_model_len=max_model_len,
                                 pid=server.pid if server else None,
                                 engine_core_pid=server.engine_pid if server else None)
        if max_model_len and not args.dataset:
            longest = args.input_len[1] + args.output_len[1]
            if longest > max_model_len:
                raise SystemExit(f"--input-len + --output-len can reach {longest} tokens; the "
                                 f"server's max_model_len is {max_model_len}")
        results["points"] = asyncio.run(sweep(url, model_name, reqs, args, server, run_id))
    except Exception:
        if server and server.proc is not None:
            log(f"the server's last output:\n{server.log_tail(15)}")
        raise
    finally:
        if server:
            server.stop()

    if args.offline:
        if args.url:
            log("WARNING: offline runs while the server at --url is still up: make sure it is "
                "idle, or the two share the CPU")
        done: dict[int | None, dict[str, Any]] = {}
        configured = (config.get("scheduler") or {}).get("max_num_seqs")
        if configured and any((c or 0) > configured for c, _ in points):
            log(f"WARNING: the server batches at most scheduler.max_num_seqs = {configured} "
                "requests; offline runs use max_num_seqs = concurrency, above that too")
        for row in results["points"]:
            c = row["concurrency"]
            if c not in done:
                mine = reqs[:row["requests"]]
                log(f"offline, max_num_seqs {c or 'as configured'}: {len(mine)} requests...")
                done[c] = run_offline(config, c, mine, args, tokenizer)
                log(f"offline, max_num_seqs {c or 'as configured'}: "
                    f"{done[c]['output_throughput']:.1f} output tok/s in "
                    f"{done[c]['wall_s']:.2f} s (engine built in {done[c]['load_s']:.1f} s)")
            off = done[c]
            row["offline"] = {k: v for k, v in off.items() if not k.startswith("_")}
            row["offline_ratio"] = row["output_throughput"] / off["output_throughput"]
            if args.temperature == 0:
                pairs = [(a, b) for a, b in zip(row["_texts"], off["_texts"]) if a is not None]
                row["offline_agreement"] = {"identical": sum(a == b for a, b in pairs),
                                            "of": len(pairs)}
    for row in results["points"]:
        row.pop("_texts", None)
    return results


def _range(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}:{r[1]}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server started here is stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    try:
        results = run_benchmark(args)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    results["command"] = " ".join(["python", *(sys.argv if argv is None else
                                               ["benchmarks/serve.py", *argv])])
    log(f"done in {time.perf_counter() - t0:.0f} s")
    report(results, args, format_tables, write_plot, log)
    failed = sum(r["failed"] for r in results["points"])
    if failed:
        log(f"{failed} request(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
