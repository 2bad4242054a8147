"""Does one request stall the server? /health and a one-token completion, timed while a heavy
request runs.

Cases: ``idle`` (nothing else running); ``issue-12`` (the body that froze the server in issue
12: 60,000 distinct stop strings, ``n: 128``, 16 tokens; a server with ``frontend.limits``
answers it with a 400 at once); ``worst-allowed`` (the largest request the default limits
allow: 128 streamed samples at the generated-token budget or the context, 64 stop strings of
256 characters, logprobs at the limit).

    CORELLM_DEFAULT_MODEL=random python3 benchmarks/server_abuse.py --json out.json --plot out.png
    python3 benchmarks/server_abuse.py --url http://127.0.0.1:8000

A server started here gets ``scheduler.max_num_seqs`` 160, so the probes are never queued
behind the heavy request's 128 samples: what is timed is the API process, not the scheduling
policy's queue (with a full batch, a policy decides who waits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import logger  # noqa: E402
from corellm.bench.env import environment  # noqa: E402
from corellm.bench.runner import ServerProcess  # noqa: E402

log = logger("server_abuse")


def issue12_body() -> dict[str, Any]:
    stops = [f"§{i:05d}¤" for i in range(60_000)]
    return {"prompt": "The meaning of life", "max_tokens": 16, "ignore_eos": True, "n": 128,
            "stop": stops}


def worst_allowed_body(max_model_len: int, prompt_tokens: int = 8) -> dict[str, Any]:
    # default frontend.limits: 128 samples, 131072 generated tokens, 64 stop strings of 256
    # characters, 1024 logprob alternatives per position over all samples
    max_tokens = min(131072 // 128, max_model_len - prompt_tokens)
    stops = [f"{i:03d}" + "\u00e9z" * 126 + "q" for i in range(64)]
    return {"prompt": "The meaning of life", "max_tokens": max_tokens, "n": 128,
            "ignore_eos": True, "stop": stops, "logprobs": 1024 // 128, "stream": True}


def run_case(client: Any, url: str, model: str, name: str, body: dict[str, Any] | None,
             max_probes: int, timeout: float) -> dict[str, Any]:
    done = threading.Event()
    heavy: dict[str, Any] = {}

    def run_heavy() -> None:
        t0 = time.perf_counter()
        try:
            with client.stream("POST", f"{url}/v1/completions", json={**body, "model": model},
                               timeout=timeout) as r:
                heavy["status"] = r.status_code
                heavy["events"] = sum(1 for line in r.iter_lines() if line.startswith("data: {"))
        except Exception as exc:          # noqa: BLE001 - reported in the table
            heavy["status"] = type(exc).__name__
        heavy["seconds"] = time.perf_counter() - t0
        done.set()

    if body is not None:
        threading.Thread(target=run_heavy, daemon=True).start()
        time.sleep(0.3)                   # let it reach the server
    health, completion = [], []
    # probe while the heavy request runs (3 probes at least: one rejected at once runs briefly)
    while len(health) < max_probes and (body is None or not done.is_set() or len(health) < 3):
        t0 = time.perf_counter()
        client.get(f"{url}/health", timeout=timeout)
        health.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        client.post(f"{url}/v1/completions", timeout=timeout,
                    json={"model": model, "prompt": "Hi", "max_tokens": 1})
        completion.append(time.perf_counter() - t0)
    if body is not None:
        done.wait(timeout)
    row = {"case": name, "probes": len(health),
           "health_median_ms": statistics.median(health) * 1e3,
           "health_max_ms": max(health) * 1e3,
           "completion_median_ms": statistics.median(completion) * 1e3,
           "completion_max_ms": max(completion) * 1e3,
           "heavy_status": heavy.get("status"), "heavy_seconds": heavy.get("seconds"),
           "heavy_events": heavy.get("events")}
    log(f"{name}: /health max {row['health_max_ms']:.0f} ms, 1-token max "
        f"{row['completion_max_ms']:.0f} ms, heavy request {row['heavy_status']}")
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'case':<18} {'probes':>6} {'/health med':>12} {'/health max':>12} "
            f"{'1-tok med':>10} {'1-tok max':>10}  heavy request")
    lines = [head, "-" * len(head)]
    for r in rows:
        heavy = "-" if r["heavy_status"] is None else \
            f"{r['heavy_status']} in {r['heavy_seconds']:.2f} s"
        lines.append(f"{r['case']:<18} {r['probes']:>6} {r['health_median_ms']:>10.0f}ms "
                     f"{r['health_max_ms']:>10.0f}ms {r['completion_median_ms']:>8.0f}ms "
                     f"{r['completion_max_ms']:>8.0f}ms  {heavy}")
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["health_max_ms"] for r in rows], 0.4, label="/health (max)")
    ax.bar([i + 0.2 for i in x], [r["completion_max_ms"] for r in rows], 0.4,
           label="1-token completion (max)")
    ax.set_xticks(list(x), [r["case"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("latency, ms (log)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server; default: start `corellm serve` here")
    p.add_argument("--config", help="config for the server started here")
    p.add_argument("--cases", default="idle,issue-12,worst-allowed")
    p.add_argument("--max-probes", type=int, default=30, help="probe pairs per case at most")
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--json", metavar="OUT.json")
    p.add_argument("--plot", metavar="OUT.png")
    args = p.parse_args()

    import httpx

    server = None if args.url else ServerProcess(
        args.config, extra_args=["--set", "scheduler.max_num_seqs=160"])
    if server is not None:
        server.start()
    try:
        url = args.url or server.url
        with httpx.Client() as client:
            info = client.get(f"{url}/v1/models").json()["data"][0]
            model, max_model_len = info["id"], info.get("max_model_len", 1024)
            bodies = {"idle": None, "issue-12": issue12_body(),
                      "worst-allowed": worst_allowed_body(max_model_len)}
            rows = [run_case(client, url, model, name, bodies[name], args.max_probes,
                             args.timeout) for name in args.cases.split(",")]
    finally:
        if server is not None:
            server.stop()
    env = environment()
    title = f"{model} on {env.get('cpu_model', '?')}: latency while a heavy request runs"
    print(f"\n{title}\n{format_table(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "model": model, "rows": rows},
                                              indent=2))
    if args.plot:
        write_plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
