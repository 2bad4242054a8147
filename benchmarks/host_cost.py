#!/usr/bin/env python
"""The engine's host work per generated token, with a step that costs nothing on the device.

A simulated engine (``executor: sim`` on virtual time, an H100 roofline profile of the default
model: the device is free, so everything measured is the host's Python) is filled with
``--running`` requests (128 prompt tokens each, no length limit in reach), run until every one
decodes, then timed over ``--steps`` steady decode steps: wall time of ``EngineCore.step()``
per generated token, and the engine's own phase timings per step (schedule, execute (the
simulated executor's pricing of the plan), update). Each case runs in a fresh process, for this
tree and, with ``--baseline TREE``, another checkout, alternating (A, B, A, B) so both see the
same machine load; the table gives the median of ``--repeats`` and the ratio.

Examples::

    python benchmarks/host_cost.py                                   # 64 and 256 running
    python benchmarks/host_cost.py --baseline /tmp/base --repeats 5 --json host_cost.json
    python benchmarks/host_cost.py --async-scheduling                # overlapped steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import cpu_model, loadavg, logger, warn_if_busy, write_json  # noqa: E402
from benchmarks.sim_speed import baseline_path, compile_tree, roofline_profile  # noqa: E402

log = logger("host_cost")

# Runs in the measured process: build, fill, warm, time.
_CHILD = r"""
import json, sys, time, gc
from corellm import LLM
from corellm.request import EngineCoreRequest
from corellm.sampling_params import SamplingParams

profile, running, steps, overlap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = {"executor": {"name": "sim", "profile": profile},
       "scheduler": {"max_num_seqs": running, "max_num_batched_tokens": 128 * running},
       "kv_cache": {"block_size": 16, "num_blocks": running * (steps + 200) // 16}}
if overlap != "default":
    cfg["scheduler"]["async_scheduling"] = overlap == "on"
llm = LLM(cfg, skip_tokenizer_init=True)
engine = llm.engine
max_len = engine.model_info.max_model_len
if max_len < 128 + steps + 40:
    sys.exit(f"the model's max_model_len {max_len} is too short for {steps} steps")
params = SamplingParams(max_tokens=max_len - 128, ignore_eos=True, temperature=0.0)
for i in range(running):
    engine.add_request(EngineCoreRequest(f"r{i}", [100 + (i + j) % 500 for j in range(128)],
                                         params, eos_token_id=None, arrival_time=0.0))
for _ in range(20):                         # prefill, then a few decodes
    engine.step()
gc.collect(); gc.disable()
t0 = dict(engine.timings)
tokens = 0
start = time.perf_counter()
for _ in range(steps):
    for o in engine.step():
        tokens += len(o.new_token_ids)
wall = time.perf_counter() - start
gc.enable()
phases = {k: (engine.timings[k] - t0.get(k, 0.0)) / steps * 1e6
          for k in ("schedule", "execute", "update") if k in engine.timings}
engine.abort_requests([f"r{i}" for i in range(running)])
llm.shutdown()
print(json.dumps({"tokens": tokens, "wall_s": wall, "us_per_token": wall / tokens * 1e6,
                  "us_per_step": wall / steps * 1e6, "phase_us_per_step": phases}))
"""


def run_once(profile: Path, running: int, steps: int, overlap: str, pythonpath: str,
             ) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(profile), str(running), str(steps),
                           overlap], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    if proc.returncode != 0:
        raise RuntimeError(f"host-cost child exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="64,256", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=1000, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per case and tree (median)")
    p.add_argument("--baseline", help="another checkout to run side by side")
    p.add_argument("--async-scheduling", dest="overlap", action="store_const", const="on",
                   default="default", help="overlapped steps (default: the executor's)")
    p.add_argument("--sync", dest="overlap", action="store_const", const="off",
                   help="synchronous steps")
    p.add_argument("--roofline", default="h100-sxm", help="device of the roofline profile")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="one repeat of 50 steps at 8 running")
    return p.parse_args(argv)


def run_benchmark(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sizes = [8] if args.quick else [int(x) for x in args.running.split(",")]
    steps, repeats = (50, 1) if args.quick else (args.steps, args.repeats)
    here = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    compile_tree(REPO)
    if args.baseline:
        compile_tree(Path(args.baseline))
    warn_if_busy(log)
    load_before = loadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="host_cost-") as tmp:
        trees = {"this": here}
        if args.baseline:
            trees = {"baseline": baseline_path(Path(args.baseline), Path(tmp)), **trees}
        # Each tree derives its own (a profile's format may differ between versions).
        profiles = {}
        for tree, pythonpath in trees.items():
            (Path(tmp) / tree).mkdir()
            profiles[tree] = roofline_profile(Path(tmp) / tree, args.roofline, pythonpath)
        for running in sizes:
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
            for rep in range(repeats):
                for tree, pythonpath in trees.items():
                    r = run_once(profiles[tree], running, steps, args.overlap, pythonpath)
                    runs[tree].append(r)
                    log(f"{running} running [{tree}] #{rep + 1}/{repeats}: "
                        f"{r['us_per_token']:.2f} us/token")
            row: dict[str, Any] = {"running": running}
            for tree, rs in runs.items():
                med = statistics.median(r["us_per_token"] for r in rs)
                phases = {k: statistics.median(r["phase_us_per_step"].get(k, 0.0) for r in rs)
                          for k in ("schedule", "execute", "update")}
                row[tree] = {"us_per_token": med, "runs": rs,
                             "phase_us_per_token": {k: v / running for k, v in phases.items()}}
            if args.baseline:
                row["ratio"] = row["baseline"]["us_per_token"] / row["this"]["us_per_token"]
            rows.append(row)
    return {"benchmark": "host_cost", "steps": steps, "repeats": repeats,
            "overlap": args.overlap, "baseline": args.baseline,
            "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "load_before": load_before,
                        "load_after": loadavg()},
            "rows": rows}


def format_table(results: dict[str, Any]) -> str:
    trees = ["baseline", "this"] if results["baseline"] else ["this"]
    head = ["running"]
    for t in trees:
        head += [f"{t} us/token", f"{t} schedule / execute / update"]
    if results["baseline"]:
        head.append("speed-up")
    m = results["machine"]
    lines = [f"{m['cpu']}, {m['cpu_count']} CPUs; steps {results['steps']}, repeats "
             f"{results['repeats']}, overlap {results['overlap']}; load {m['load_before']} "
             f"before, {m['load_after']} after", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        cells = [str(row["running"])]
        for t in trees:
            ph = row[t]["phase_us_per_token"]
            cells += [f"{row[t]['us_per_token']:.2f}",
                      " / ".join(f"{ph[k]:.2f}" for k in ("schedule", "execute", "update"))]
        if results["baseline"]:
            cells.append(f"{row['ratio']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    results = run_benchmark(argv)
    print(format_table(results))
    args = parse_args(argv)
    if args.json:
        write_json(results, args.json, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
