"""Helpers shared by the benchmark scripts: workload parsing, the environment record, timing
with CPU-utilization checks, and output agreement. Not part of the corellm package."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def logger(tag: str):
    def log(msg: str) -> None:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)
    return log


def parse_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return a, b



def parse_int_list(text: str) -> list[int]:
    """``N[,N...]`` of positive integers (a sweep: batch sizes, concurrencies)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def summarize(values, percentiles=(50, 90, 99)) -> dict[str, float | None]:
    """Mean and percentiles of a list of numbers (linear interpolation between the closest
    ranks, as ``numpy.percentile``); every entry None when the list is empty."""
    xs = sorted(values)
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs) if xs else None}
    for q in percentiles:
        if not xs:
            out[f"p{q:g}"] = None
            continue
        pos = (len(xs) - 1) * q / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q:g}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


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
    (bos/eos/pad would change the meaning of a random prompt for no benchmark benefit)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    special = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None}
    return min(vocab_size, len(tok)), special



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



def loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Clock:
    """Wall and process CPU time of a timed run. ``cpu_util`` = CPU seconds / (wall x torch
    threads): well below 1 while the CPU-bound phases run means another process took cores."""

    def __init__(self) -> None:
        self.load_before = loadavg()
        self.cpu0 = time.process_time()
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, dict[str, Any]]:
        import torch

        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0
        return wall, {"cpu_s": cpu, "cpu_util": cpu / (wall * torch.get_num_threads()),
                      "loadavg_1min_before": self.load_before, "loadavg_1min_after": loadavg()}



def environment() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    simd: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                simd = sorted(f for f in flags if f in {
                    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"})
                break
    except OSError:
        pass
    env: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_model": cpu, "cpu_simd": simd, "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }
    env["thread_env"] = {k: os.environ[k] for k in ("CORELLM_MALLOC_TUNING", "OMP_NUM_THREADS",
                                                     "MKL_NUM_THREADS",
                                                     "KMP_AFFINITY", "LD_PRELOAD")
                         if k in os.environ}
    try:
        env["cpu_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    for mod in ("transformers", "corellm", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            env[mod] = None
    try:
        root = Path(__file__).resolve().parent.parent
        env["git_commit"] = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
            timeout=10).stdout.strip() or None
        # Uncommitted changes (engine files edited since the commit change what was measured).
        env["git_status"] = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
            timeout=10).stdout.splitlines()[:50]
    except (OSError, subprocess.SubprocessError):
        pass
    return env



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


def pyplot(path: str, log):
    """matplotlib.pyplot with the Agg backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"--plot {path}: matplotlib is not installed (pip install matplotlib); skipped")
        return None
    return plt
