"""Start-up time of `corellm serve`: from spawning the process to the first `GET /health` = 200.

    python3 benchmarks/startup.py                       # the random demo model and SmolLM2 (if installed)
    python3 benchmarks/startup.py --model /path/to/ckpt --runs 5 --json startup.json
    python3 benchmarks/startup.py --baseline /tmp/old-tree    # side by side with another version

Each run starts a fresh `python3 -m corellm serve --port P`, polls /health every 10 ms, and stops
the server with SIGINT. Caches are warm (the demo model and a GGUF file's index are built before
the first timed run, as after any first use); `--cold-gguf` also times a GGUF file's first use
(metadata parsed and tokenizer converted into an empty cache). Also times the pieces in-process:
loading the GGUF weights (dequantization included) and the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from corellm_plugins.bench.env import environment, loadavg


def machine_header() -> str:
    env = environment()
    return (f"machine: {env['cpu_model']} ({env['cpu_count']} CPUs), torch {env.get('torch')}, "
            f"corellm {env.get('corellm')}, load average {loadavg()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_healthy(model: str | None, env: dict[str, str], timeout: float = 300) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "corellm", "serve", "--port", str(port)]
    if model:
        cmd.append(model)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"not healthy after {timeout} s")
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def gguf_pieces(path: str) -> dict[str, float]:
    """In a fresh process: the seconds to read + dequantize all weights, and to load the
    tokenizer, from a warm cache."""
    code = f"""
import json, time
import torch  # imported by the engine before it loads weights: not part of the loading time
from corellm.checkpoint.reader import iter_weights, load_arch_config
from corellm.engine.llm import load_tokenizer
load_arch_config({path!r})
t = time.perf_counter(); n = sum(w.numel() for _, w in iter_weights({path!r}))
weights = time.perf_counter() - t
t = time.perf_counter(); load_tokenizer({path!r}, "model.path"); tok = time.perf_counter() - t
print(json.dumps({{"weights_s": weights, "tokenizer_s": tok, "parameters": n}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.8))
    labels = [r["model"] for r in rows]
    med = [r["median_s"] for r in rows]
    err = [[m - r["min_s"] for m, r in zip(med, rows)], [r["max_s"] - m for m, r in zip(med, rows)]]
    ax.barh(labels, med, xerr=err, color="tab:blue", capsize=4)
    for y, r in enumerate(rows):
        ax.text(r["max_s"] + 0.2, y, f"{r['median_s']:.2f} s", va="center", ha="left")
    ax.set_xlim(0, max(r["max_s"] for r in rows) * 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from spawning `corellm serve` to /health = 200 (median; bars: min-max)")
    ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="checkpoint(s) to time (repeatable); "
                    "default: the random demo model and SmolLM2 if installed")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold-gguf", action="store_true",
                    help="also time a GGUF model's first use (empty cache)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also time the random demo model with corellm from DIR (a source tree "
                         "holding corellm/ and corellm_plugins/, e.g. an older commit's "
                         "`git archive`), interleaved with the others, and print the ratio")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a bar chart (median, min-max) here (PNG)")
    args = ap.parse_args()

    from corellm.checkpoint.demo import ensure_demo_model, smollm2_gguf

    targets: list[tuple[str, str | None, dict[str, str]]] = []
    base = {k: v for k, v in os.environ.items() if k != "CORELLM_DEFAULT_MODEL"}
    if args.model:
        targets = [(m, m, base) for m in args.model]
    else:
        ensure_demo_model()
        targets.append(("random demo", None, {**base, "CORELLM_DEFAULT_MODEL": "random"}))
        if smollm2_gguf() is not None:
            targets.append(("SmolLM2-135M Q4_1 (default)", None, base))
    if args.baseline:
        old = {**base, "PYTHONPATH": os.path.abspath(args.baseline)}
        targets.insert(0, ("random demo, baseline", None, old))
    print(machine_header())
    for label, model, env in targets:
        time_to_healthy(model, env)                       # warm the caches (not timed)
    times: dict[str, list[float]] = {label: [] for label, _, _ in targets}
    for i in range(args.runs):                            # round-robin: drift hits all alike
        for label, model, env in targets:
            times[label].append(time_to_healthy(model, env))
            print(f"  {label}: run {i + 1}/{args.runs}: {times[label][-1]:.2f} s",
                  file=sys.stderr)
    rows = [{"model": label, "runs": t, "median_s": statistics.median(t), "min_s": min(t),
             "max_s": max(t)} for label, t in times.items()]
    gguf = None
    smol = smollm2_gguf()
    gguf_path = next((m for _, m, _ in targets if m and m.endswith(".gguf")), None) or (
        str(smol) if smol else None)
    if gguf_path:
        gguf = gguf_pieces(gguf_path)
        if args.cold_gguf:
            with tempfile.TemporaryDirectory() as cache:
                env = {**base, "CORELLM_CACHE": cache}
                cold = time_to_healthy(gguf_path, env)
            rows.append({"model": f"{Path(gguf_path).name} (first use, empty cache)",
                         "runs": [cold], "median_s": cold, "min_s": cold, "max_s": cold})
    print(f"\n{'model':<44} {'median':>8} {'min':>8} {'max':>8}   (spawn -> /health 200, s)")
    for r in rows:
        print(f"{r['model']:<44} {r['median_s']:>8.2f} {r['min_s']:>8.2f} {r['max_s']:>8.2f}")
    if args.baseline and len(rows) > 1:
        print(f"\n{rows[1]['model']}: {rows[1]['median_s'] / rows[0]['median_s']:.2f}x the baseline's "
              "median start-up time")
    if gguf:
        print(f"\nGGUF {Path(gguf_path).name}: weights read + dequantized in "
              f"{gguf['weights_s']:.2f} s ({gguf['parameters'] / 1e6:.0f}M parameters), "
              f"tokenizer loaded in {gguf['tokenizer_s']:.2f} s (warm cache)")
    if args.plot:
        plot(rows, machine_header(), args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_header(), "rows": rows,
                                               "gguf": gguf}, indent=2))


if __name__ == "__main__":
    main()
