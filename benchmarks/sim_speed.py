#!/usr/bin/env python
"""Wall time of whole simulated ``corellm bench`` runs, start-up included.

Each timed run is ``python -m corellm.cli bench --config sim=CONFIG ...`` in a fresh process,
from its start to its exit (imports, tokenizer, engine construction, the run, the report), for
three cases of the random workload:

* ``10k 128/32 @100``: 10,000 requests of 128 prompt and 32 output tokens at 100 req/s (goal:
  at most 3 s);
* ``10k 128/128 @50``: 10,000 requests of 128 + 128 tokens at 50 req/s (no goal: measured);
* ``100k 128/32 @1000``: 100,000 requests of 128 + 32 tokens at 1000 req/s (goal: at most 12 s).

Every step goes through ``EngineCore.step()``, the one step path. ``--async-scheduling on|off``
sets the simulated config's ``scheduler.async_scheduling`` (left out: the executor's default,
overlapped for a GPU profile); ``--noise-procs N`` runs N busy processes beside every run.

The executor is ``sim`` with ``--profile`` (default: an H100 roofline profile derived here with
``corellm bench calibrate --roofline h100-sxm`` into a temporary directory). The table gives,
per case, the engine steps and simulated seconds the run reported, the median and minimum wall
time over ``--repeats`` and whether the goal is met. ``--baseline TREE`` also runs every
case with another corellm checkout (its ``corellm`` and its built-in plugins) first on
``PYTHONPATH``, interleaved with this one (A, B, A, B),
so that both see the same machine load; the table then gives both and the speed-up.

Examples::

    python benchmarks/sim_speed.py                                  # H100 roofline, 3 repeats
    python benchmarks/sim_speed.py --profile cpu.json --repeats 5 --json sim_speed.json
    python benchmarks/sim_speed.py --baseline /tmp/old-tree --cases 10k-32
    python benchmarks/sim_speed.py --quick                          # a few hundred requests
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import (cpu_model, loadavg, logger, spinning_neighbours,  # noqa: E402
                               warn_if_busy, write_json)

log = logger("sim_speed")

# name -> (requests, input tokens, output tokens, request rate, goal in seconds or None)
CASES: dict[str, tuple[int, int, int, float, float | None]] = {
    "10k-32": (10_000, 128, 32, 100.0, 3.0),
    "10k-128": (10_000, 128, 128, 50.0, None),
    "100k-32": (100_000, 128, 32, 1000.0, 12.0),
}
QUICK_CASES: dict[str, tuple[int, int, int, float, float | None]] = {
    "quick-32": (200, 32, 8, 100.0, None),
}
_DONE = re.compile(r"'sim' #1: (\d+)/(\d+) ok in ([0-9.]+) s(?:.*?\((\d+) engine steps\))?")


def describe(case: tuple[int, int, int, float, float | None]) -> str:
    n, inp, out, rate, _ = case
    count = f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)
    return f"{count} {inp}/{out} @{rate:g}"


def roofline_profile(directory: Path, device: str, pythonpath: str) -> Path:
    """An H100 (or ``device``) roofline profile of the default model, derived by
    ``corellm bench calibrate --roofline`` (no measurement: instant)."""
    config = directory / "empty.yaml"
    config.write_text("{}\n")
    out = directory / f"{device}.json"
    cmd = [sys.executable, "-m", "corellm.cli", "bench", "calibrate", "--config", str(config),
           "--roofline", device, "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    if proc.returncode != 0:
        raise SystemExit(f"deriving the {device} roofline profile failed:\n{proc.stderr}")
    return out


def run_once(config: Path, case: tuple[int, int, int, float, float | None],
             pythonpath: str, timeout: float) -> dict[str, Any]:
    """One whole ``corellm bench`` command; its wall time and what it reported."""
    n, inp, out, rate, _ = case
    cmd = [sys.executable, "-m", "corellm.cli", "bench", "--config", f"sim={config}",
           "--num-prompts", str(n), "--request-rate", f"{rate:g}", "--random-input-len",
           str(inp), "--random-output-len", str(out), "--seed", "0", "--no-progress"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    m = _DONE.search(proc.stderr)
    return {"wall_s": wall, "completed": int(m.group(1)) if m else None,
            "simulated_s": float(m.group(3)) if m else None,
            "engine_steps": int(m.group(4)) if m and m.group(4) else None}


def summarize(runs: list[dict[str, Any]], goal: float | None) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    median = statistics.median(walls)
    return {"wall_s": walls, "median_s": median, "min_s": min(walls),
            "engine_steps": runs[0]["engine_steps"], "simulated_s": runs[0]["simulated_s"],
            "completed": runs[0]["completed"], "goal_s": goal,
            "met": None if goal is None else median <= goal}


def baseline_path(tree: Path, tmp: Path) -> str:
    """PYTHONPATH that runs another checkout: its ``corellm`` and, through a link named
    ``corellm_plugins`` (what an install maps ``plugins/`` to), its built-in plugins; the
    plugins of the installed tree would otherwise be imported with the other core."""
    shim = tmp / "baseline-plugins"
    shim.mkdir(exist_ok=True)
    link = shim / "corellm_plugins"
    if not link.exists():
        link.symlink_to(tree.resolve() / "plugins", target_is_directory=True)
    return os.pathsep.join([str(tree.resolve()), str(shim)])


def compile_tree(tree: Path) -> None:
    """Byte-compile a checkout's ``corellm`` and ``plugins``, as an installed package is: a
    run then times what a user's start-up costs, even where PYTHONDONTWRITEBYTECODE is set
    (it is on this project's machines, and would add each module's compilation to every run)."""
    import compileall

    for sub in ("corellm", "plugins"):
        compileall.compile_dir(str(tree / sub), quiet=1)


def run_benchmark(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cases = QUICK_CASES if args.quick else {k: CASES[k] for k in args.cases}
    here = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    trees = {"this": here}
    compile_tree(REPO)
    if args.baseline:
        compile_tree(Path(args.baseline))
    warn_if_busy(log)
    load_before = loadavg()
    with tempfile.TemporaryDirectory(prefix="sim_speed-") as tmp:
        if args.baseline:
            trees = {"baseline": baseline_path(Path(args.baseline), Path(tmp)), **trees}
        configs = {}
        for tree, pythonpath in trees.items():
            # Each tree derives its own roofline profile (the format may differ between them).
            (Path(tmp) / tree).mkdir()
            profile = Path(args.profile) if args.profile else roofline_profile(
                Path(tmp) / tree, args.roofline, pythonpath)
            data: dict[str, Any] = {"executor": {"name": "sim",
                                                 "profile": str(profile.resolve())}}
            if args.async_scheduling and tree == "this":
                data["scheduler"] = {"async_scheduling": args.async_scheduling == "on"}
            configs[tree] = Path(tmp) / f"sim-{tree}.yaml"
            configs[tree].write_text(json.dumps(data) + "\n")
        rows = []
        for name, case in cases.items():
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
            for rep in range(args.repeats):
                for tree, pythonpath in trees.items():
                    with spinning_neighbours(args.noise_procs):
                        r = run_once(configs[tree], case, pythonpath, args.timeout)
                    runs[tree].append(r)
                    log(f"{describe(case)} [{tree}] #{rep + 1}/{args.repeats}: "
                        f"{r['wall_s']:.2f} s wall, {r['engine_steps']} steps, "
                        f"{r['simulated_s']} s simulated")
            row = {"case": name, "description": describe(case), "requests": case[0],
                   **{tree: summarize(rs, case[4]) for tree, rs in runs.items()}}
            if args.baseline:
                row["speedup"] = row["baseline"]["median_s"] / row["this"]["median_s"]
            rows.append(row)
    return {"benchmark": "sim_speed", "profile": str(args.profile or f"{args.roofline} roofline"),
            "repeats": args.repeats, "baseline": args.baseline,
            "async_scheduling": args.async_scheduling, "noise_procs": args.noise_procs,
            "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(),
                        "load_before": load_before, "load_after": loadavg()},
            "rows": rows}


def format_table(results: dict[str, Any]) -> str:
    trees = ["baseline", "this"] if results["baseline"] else ["this"]
    head = ["case", "requests", "steps", "simulated s"]
    for t in trees:
        head += [f"{t} median s", f"{t} min s"]
    head += ["goal s", "met?"] + (["speed-up"] if results["baseline"] else [])
    lines = [f"{results['machine']['cpu']}, {results['machine']['cpu_count']} CPUs; "
             f"profile: {results['profile']}; async_scheduling "
             f"{results.get('async_scheduling') or 'default'}; {results.get('noise_procs', 0)} "
             f"busy neighbours; {results['repeats']} repeats; load average "
             f"{results['machine']['load_before']} before, {results['machine']['load_after']} "
             "after", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results["rows"]:
        mine = row["this"]
        cells = [row["description"], str(row["requests"]), str(mine["engine_steps"]),
                 f"{mine['simulated_s']}"]
        for t in trees:
            cells += [f"{row[t]['median_s']:.2f}", f"{row[t]['min_s']:.2f}"]
        goal = mine["goal_s"]
        cells += ["-" if goal is None else f"{goal:g}",
                  "-" if mine["met"] is None else ("yes" if mine["met"] else "no")]
        if results["baseline"]:
            cells.append(f"{row['speedup']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", metavar="PROFILE.json",
                    help="the sim executor's profile (default: a roofline profile derived here)")
    ap.add_argument("--roofline", default="h100-sxm", metavar="DEVICE",
                    help="the device of the derived profile when no --profile (default: "
                         "h100-sxm)")
    ap.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                    help=f"comma-separated cases to run (default: all of {', '.join(CASES)})")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    ap.add_argument("--baseline", metavar="TREE",
                    help="also run every case with another corellm checkout (its corellm and "
                         "plugins), interleaved")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--async-scheduling", choices=("on", "off"),
                    help="scheduler.async_scheduling of this tree's config (the baseline's "
                         "config leaves it out)")
    ap.add_argument("--noise-procs", type=int, default=0, metavar="N",
                    help="busy processes beside every run (default 0: quiet)")
    ap.add_argument("--quick", action="store_true",
                    help="one small case (a few hundred requests), for tests")
    ap.add_argument("--json", metavar="FILE", help="write the results here")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    results = run_benchmark(argv)
    print(format_table(results), flush=True)
    args = parse_args(argv)
    if args.json:
        write_json(results, args.json, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
