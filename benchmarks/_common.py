"""Helpers shared by the benchmark scripts: workload parsing, timing with CPU-utilization checks,
and output agreement. Not part of the corellm package; the environment record, the load
average and the plot helper (``pyplot``) come from the ``corellm bench`` harness (``bench.env``,
``bench.report``), re-exported here."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from corellm_plugins.bench.env import environment, loadavg  # noqa: F401  (re-exported)
# pyplot(path, log): matplotlib.pyplot on the Agg backend, or None (logged with the script's
# log) when matplotlib is missing: the bench plugin's helper, so there is one.
from corellm_plugins.bench.report import pyplot_for as pyplot  # noqa: F401  (re-exported)
from corellm_plugins.bench.workload_cli import parse_range  # noqa: F401  (re-exported)
from corellm_plugins.bench.targets import prompt_token_space


def logger(tag: str):
    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)
    return log


def parse_int_list(text: str) -> list[int]:
    """``N[,N...]`` of positive integers (a sweep: batch sizes, concurrencies)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def random_token_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                          seed: int, vocab_size: int, exclude_ids=frozenset(),
                          ) -> list[dict[str, Any]]:
    """``num`` random prompts (token ids below ``vocab_size``, none in ``exclude_ids``) and
    output lengths, uniform in the inclusive ranges: ``{"prompt_token_ids", "output_len"}``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude_ids, dtype=np.int64))
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=num)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=num)
    return [{"prompt_token_ids": rng.choice(allowed, size=int(n)).tolist(),
             "output_len": int(m)} for n, m in zip(in_lens, out_lens)]


def model_facts(model: Path) -> dict[str, Any]:
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return {"vocab_size": cfg["vocab_size"],
            "max_position_embeddings": cfg.get("max_position_embeddings")}


def prompt_id_space(model: Path, vocab_size: int) -> tuple[int, set[int]]:
    """Ids to draw prompts from: what both the model and its tokenizer know, minus specials
    (the ``corellm bench`` harness's rule, so every benchmark draws prompts alike)."""
    _, vocab, special = prompt_token_space(model)
    return min(vocab_size, vocab), special


def count_params(model: Path) -> int | None:
    try:
        from safetensors import safe_open
    except ImportError:
        return None
    total, seen = 0, set()
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name not in seen:
                    seen.add(name)
                    shape = st.get_slice(name).get_shape()
                    total += math.prod(shape)
    return total or None



class Clock:
    """Wall and process CPU time of a timed run. ``cores_used`` = CPU seconds / wall;
    ``cpu_util`` = that over the CPUs this process may use: well below 1 while the CPU-bound
    phases run means another process took cores."""

    def __init__(self) -> None:
        self.load_before = loadavg()
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, dict[str, Any]]:
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0
        return wall, {"cpu_s": cpu, "cores_used": cpu / wall,
                      "cpu_util": cpu / (wall * len(os.sched_getaffinity(0))),
                      "loadavg_1min_before": self.load_before, "loadavg_1min_after": loadavg()}



# A neighbour: a process that keeps one CPU busy and never sleeps (what a build, a test run or
# another service does to a shared machine).
NEIGHBOUR = [sys.executable, "-c", "while True: pass"]


@contextlib.contextmanager
def spinning_neighbours(n: int, log=None):
    """``n`` neighbour processes, each spinning on a CPU, for the duration of the block."""
    procs = [subprocess.Popen(NEIGHBOUR) for _ in range(n)]
    try:
        if procs:
            time.sleep(0.5)                     # started and spinning
            if log:
                log(f"{n} busy neighbour process(es) running: {[p.pid for p in procs]}")
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _cgroup_dirs() -> tuple[Path, str, str] | None:
    """(where to make a cgroup, the quota file, its format) for this process, or None."""
    root = Path("/sys/fs/cgroup")
    if (root / "cgroup.controllers").exists():                       # v2
        rel = next((line.split("::", 1)[1] for line in
                    Path("/proc/self/cgroup").read_text().splitlines()
                    if line.startswith("0::")), "/")
        return root / rel.lstrip("/"), "cpu.max", "v2"
    for name in ("cpu,cpuacct", "cpu"):                              # v1
        if (root / name / "cpu.cfs_quota_us").exists():
            return root / name, "cpu.cfs_quota_us", "v1"
    return None


@contextlib.contextmanager
def cpu_quota(cpus: float, log):
    """This process (and the processes it starts) in a new cgroup limited to ``cpus`` CPUs
    (a CFS quota over 100 ms periods) for the duration of the block. Needs a cgroup file
    system this user may write; raises SystemExit naming what failed otherwise."""
    found = _cgroup_dirs()
    if found is None:
        raise SystemExit("--cpu-quota: no writable cgroup cpu controller at /sys/fs/cgroup")
    parent, quota_file, version = found
    group = parent / f"corellm-bench-{os.getpid()}"
    period = 100_000
    try:
        group.mkdir()
        if version == "v2":
            (group / "cpu.max").write_text(f"{int(cpus * period)} {period}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{period}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{int(cpus * period)}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise SystemExit(f"--cpu-quota: cannot make a cgroup with a CPU quota at {group} "
                         f"({exc}); run as a user who may, or leave the option out") from None
    log(f"in cgroup {group} ({version}): a CPU quota of {cpus:g} CPUs")
    try:
        yield str(group / quota_file)
    finally:
        with contextlib.suppress(OSError):
            (parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
            group.rmdir()


def left_padded(batch: list[dict[str, Any]], pad_id: int):
    """(input ids, attention mask, longest prompt) of a static batch for transformers
    ``generate``: the prompts left-padded with ``pad_id`` to the longest."""
    import torch

    longest = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):
        p = r["prompt_token_ids"]
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    return ids, mask, longest


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many requests' greedy outputs are identical, and where the others first differ."""
    same, firsts = 0, []
    for x, y in zip(a, b):
        if x == y:
            same += 1
        else:
            firsts.append(next((i for i, (s, t) in enumerate(zip(x, y)) if s != t),
                               min(len(x), len(y))))
    firsts.sort()
    return {"identical": same, "of": len(a),
            "median_first_divergence": firsts[len(firsts) // 2] if firsts else None}



def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which figures are reported with."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def warn_if_busy(log) -> None:
    load = loadavg()
    if load is not None and load > 0.5:
        log(f"WARNING: 1-min load average is {load:.2f} before starting: other processes are "
            "using the CPU and the numbers will be noisy")


def write_json(results: dict[str, Any], path: str, log) -> None:
    Path(path).write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {path}")


def report(results: dict[str, Any], args: argparse.Namespace, format_tables, write_plot,
           log) -> None:
    """Print the tables, then write ``--json`` and ``--plot`` when asked."""
    print(format_tables(results), flush=True)
    if args.json:
        write_json(results, args.json, log)
    if args.plot and write_plot(results, args.plot):
        log(f"wrote {args.plot}")


def in_netns(no_netns: bool) -> int | None:
    """Run this script again in a loopback-only network namespace (Ray advertises the machine's
    address otherwise) and return its exit status; None when already there, or ``no_netns``."""
    if no_netns or os.environ.get("CORELLM_IN_NETNS"):
        return None
    if shutil.which("unshare") is None:
        raise SystemExit("no unshare command: give --no-netns (Ray will then advertise this "
                         "machine's address)")
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
           sys.executable, *sys.argv]
    return subprocess.call(cmd, env={**os.environ, "CORELLM_IN_NETNS": "1"})
