#!/usr/bin/env python
"""The model runner's host time per decode step, this tree's runner against a baseline's, side by
side in one process.

A tiny random-weight Llama (hidden 64, 2 layers, vocabulary 1024: the forward costs little, so
what is timed is the runner's own host work) runs ``N`` requests at once (``--requests``), all
decoding together after one prefill step, for ``--steps`` decode steps. Each decode step where
all ``N`` run, after ``--warmup`` of them, gives the two host phases the runner reports in
``ModelRunnerOutput.timings``: ``prepare_inputs`` (the plan's deltas applied, the step's arrays
and attention metadata built) and ``sample`` (sampling metadata, the sampler, the sampled ids to
the host and appended); inside ``sample``, ``sampling_metadata`` (building the sampler's
``SamplingMetadata``) and ``sampler`` (the sampler plugin's own work) are timed apart.
``forward`` is shown for scale. Two sampling settings: ``greedy``
(temperature 0) and ``random`` (temperature 0.8, top-k 50, top-p 0.95, every fourth request
seeded).

The baseline is another version of ``corellm/worker/{model_runner,request_state,input_batch}.py``
(``--baseline-ref``, default ``HEAD``, read with ``git show``; or ``--baseline-tree DIR``),
loaded under other module names; the worker is built with its ``ModelRunner`` instead of this
tree's, everything else being this tree's. Runs alternate (baseline, this, baseline, this...) so
that both see the same machine load; the table gives medians over every measured step of every
repeat, and the speed-up of this tree's runner.

Examples::

    python benchmarks/host_prepare.py                         # 64 and 256 requests, vs HEAD
    python benchmarks/host_prepare.py --requests 256 --repeats 5 --json host_prepare.json
    python benchmarks/host_prepare.py --baseline-tree /tmp/old-checkout
    python benchmarks/host_prepare.py --no-baseline --sampling random
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (cpu_model, loadavg, logger, parse_int_list,  # noqa: E402
                     warn_if_busy, write_json)

os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
REPO = Path(__file__).resolve().parent.parent
WORKER_MODULES = ("request_state", "input_batch", "model_runner")
PHASES = ("prepare_inputs", "sample", "sampling_metadata", "sampler", "forward")
log = logger("host_prepare")


# ----------------------------------------------------------------------------- the runners
def baseline_runner(ref: str | None, tree: str | None) -> type:
    """The ``ModelRunner`` class of another version of the worker's modules, loaded as
    ``_baseline_worker_<name>`` (their imports of each other rewritten to those names)."""
    sources: dict[str, str] = {}
    for name in WORKER_MODULES:
        rel = f"corellm/worker/{name}.py"
        if tree is not None:
            path = Path(tree) / rel
            if path.exists():
                sources[name] = path.read_text()
        else:
            done = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{rel}"],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                sources[name] = done.stdout
    if "model_runner" not in sources:
        raise SystemExit(f"no corellm/worker/model_runner.py in {tree or ref}")
    for name in WORKER_MODULES:        # dependencies first
        if name not in sources:
            continue
        src = sources[name]
        for other in sources:
            src = src.replace(f"corellm.worker.{other}", f"_baseline_worker_{other}")
        module = types.ModuleType(f"_baseline_worker_{name}")
        module.__file__ = f"<baseline {tree or ref}:corellm/worker/{name}.py>"
        sys.modules[module.__name__] = module
        exec(compile(src, module.__file__, "exec"), module.__dict__)
    return sys.modules["_baseline_worker_model_runner"].ModelRunner


@contextlib.contextmanager
def runner_class(cls: type | None):
    """Workers built inside use ``cls`` (None: this tree's) as their model runner."""
    import corellm.worker.worker as worker
    original = worker.ModelRunner
    worker.ModelRunner = cls or original
    try:
        yield
    finally:
        worker.ModelRunner = original


# ----------------------------------------------------------------------------- the model
def tiny_llama(directory: Path) -> Path:
    import transformers as tf

    from corellm.checkpoint.demo import train_tokenizer, write_random_checkpoint
    tokenizer = train_tokenizer(vocab_size=1024)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, vocab_size=len(tokenizer),
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    write_random_checkpoint(directory, cfg, tokenizer, seed=1234, init_std=0.15)
    return directory


def sampling(kind: str, n: int, max_tokens: int) -> list[Any]:
    from corellm import SamplingParams
    if kind == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * n
    return [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=max_tokens,
                           ignore_eos=True, seed=i if i % 4 == 0 else None) for i in range(n)]


def timed(owner: Any, name: str, into: list[float]) -> None:
    """Wrap ``owner.name`` to append each call's seconds to ``into``."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    setattr(owner, name, call)


def run_once(model: Path, cls: type | None, n: int, kind: str, args: argparse.Namespace
             ) -> dict[str, list[float]]:
    """One engine, ``n`` requests decoding together: the timings of each measured step."""
    import numpy as np

    from corellm import LLM
    blocks = n * (-(-(args.prompt_len + args.steps + 2) // 16)) + 16
    cfg = {"model": {"path": str(model), "dtype": "float32", "max_model_len": 1024},
           "kv_cache": {"num_blocks": blocks, "block_size": 16},
           "scheduler": {"max_num_seqs": n,
                         "max_num_batched_tokens": max(2048, n * args.prompt_len)}}
    with runner_class(cls):
        llm = LLM(cfg)
    try:
        runner = llm.engine.executor.worker.runner
        inner = runner.sample_tokens
        steps: list[dict[str, float]] = []

        def sample_tokens(so):
            out = inner(so)
            decode = (len(so.num_scheduled_tokens) == n == so.total_num_scheduled_tokens
                      and not so.scheduled_new_reqs)
            if decode:
                steps.append({**out.timings, "sampling_metadata": extra["sampling_metadata"][-1],
                              "sampler": extra["sampler"][-1]})
            return out

        runner.sample_tokens = sample_tokens
        # Inside "sample": building the SamplingMetadata (the persistent batch's method, or
        # the per-request function of a runner without one) and the sampler plugin's call.
        extra: dict[str, list[float]] = {"sampling_metadata": [], "sampler": []}
        owner = getattr(runner, "batch", None)
        if owner is None or not hasattr(owner, "sampling_metadata"):
            owner = sys.modules[type(runner).__module__]
        timed(owner, "sampling_metadata", extra["sampling_metadata"])
        timed(runner, "sampler", extra["sampler"])
        rng = np.random.default_rng(0)
        prompts = [{"prompt_token_ids": rng.integers(10, 1000, args.prompt_len).tolist()}
                   for _ in range(n)]
        llm.generate(prompts, sampling(kind, n, args.steps + 1), use_tqdm=False)
    finally:
        llm.shutdown()
    measured = steps[args.warmup:]
    if not measured:
        raise SystemExit(f"{n} requests: no decode step with all of them running")
    return {p: [s[p] for s in measured] for p in PHASES}


# ----------------------------------------------------------------------------- the run
def run_benchmark(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    impls: dict[str, type | None] = {}
    if not args.no_baseline:
        impls["baseline"] = baseline_runner(None if args.baseline_tree else args.baseline_ref,
                                            args.baseline_tree)
    impls["this"] = None
    warn_if_busy(log)
    load_before = loadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="host_prepare-") as tmp:
        model = Path(args.model) if args.model else tiny_llama(Path(tmp) / "tiny-llama")
        for n in args.requests:
            for kind in args.sampling:
                times: dict[str, dict[str, list[float]]] = {i: {p: [] for p in PHASES}
                                                           for i in impls}
                for rep in range(args.repeats):
                    for impl, cls in impls.items():
                        got = run_once(model, cls, n, kind, args)
                        for p in PHASES:
                            times[impl][p].extend(got[p])
                        log(f"{n} requests, {kind} [{impl}] #{rep + 1}/{args.repeats}: "
                            f"prepare {statistics.median(got['prepare_inputs']) * 1e6:.0f} us, "
                            f"sample {statistics.median(got['sample']) * 1e6:.0f} us")
                row: dict[str, Any] = {"requests": n, "sampling": kind}
                for impl in impls:
                    row[impl] = {p: {"median_us": statistics.median(v) * 1e6,
                                     "min_us": min(v) * 1e6, "steps": len(v)}
                                 for p, v in times[impl].items()}
                if "baseline" in impls:
                    row["speedup"] = {p: row["baseline"][p]["median_us"]
                                      / row["this"][p]["median_us"] for p in PHASES}
                rows.append(row)
    return {"benchmark": "host_prepare",
            "baseline": None if args.no_baseline else (args.baseline_tree or args.baseline_ref),
            "prompt_len": args.prompt_len, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats,
            "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "load_before": load_before,
                        "load_after": loadavg()},
            "rows": rows}


def format_table(results: dict[str, Any]) -> str:
    impls = ["baseline", "this"] if results["baseline"] else ["this"]
    head = ["requests", "sampling"]
    for p in PHASES:
        head += [f"{p} {i} us" for i in impls] + (["x"] if len(impls) == 2 else [])
    lines = [f"model runner host time per decode step (median us; CPU: "
             f"{results['machine']['cpu']}; baseline: {results['baseline']})",
             " | ".join(head)]
    for r in results["rows"]:
        cells = [str(r["requests"]), r["sampling"]]
        for p in PHASES:
            cells += [f"{r[i][p]['median_us']:.0f}" for i in impls]
            if len(impls) == 2:
                cells.append(f"{r['speedup'][p]:.2f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=parse_int_list, default=[64, 256],
                    help="running decode requests, N[,N...] (default 64,256)")
    ap.add_argument("--sampling", type=lambda s: s.split(","), default=["greedy", "random"],
                    help="greedy,random (default both)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per run (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps not measured")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="a checkpoint instead of the tiny random Llama")
    ap.add_argument("--baseline-ref", default="HEAD",
                    help="git revision of the baseline runner (default HEAD)")
    ap.add_argument("--baseline-tree", help="a checkout whose runner is the baseline")
    ap.add_argument("--no-baseline", action="store_true", help="time this tree's runner only")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    results = run_benchmark(argv)
    print(format_table(results), flush=True)
    args = parse_args(argv)
    if args.json:
        write_json(results, args.json, log)


if __name__ == "__main__":
    main()
