"""The CPU GEMM paths (plugins/platform_cpu/gemm.py) on this machine: per weight shape, and end to end.

1. For each linear weight shape of the model, the GFLOP/s of every available path of the
   weights' dtype (``--dtype``; fp32: plain ``F.linear``, MKL packed, oneDNN prepacked, corellm's
   native kernel; bf16: plain, oneDNN where it packs bf16, upcast, native) at each probe row
   count, and the plan the worker would pick (measured now, not read from the cache).
2. A decode-heavy workload (``--num-requests`` prompts of ``--prompt-len`` tokens, ``--output-len``
   new tokens each, all running at once) through one engine per plan, in one process,
   alternating rounds so a slow phase of the machine falls on every plan alike: the measured
   plans against every weight forced onto one path (``mkl`` was the default before plans;
   ``dense`` is no packing).

    python3 benchmarks/cpu_gemm.py --make-model /tmp/bench-model
    python3 benchmarks/cpu_gemm.py --make-model /tmp/bench-model --dtype bfloat16
    python3 benchmarks/cpu_gemm.py --model CKPT --rounds 3 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, logger, pyplot, report  # noqa: E402

_log = logger("cpu_gemm")


def model_shapes(llm) -> dict[tuple[int, int], int]:
    """Distinct linear weight shapes of the loaded model and how many layers have each."""
    from corellm.layers.linear import LinearBase, ParallelLMHead
    counts: dict[tuple[int, int], int] = {}
    for m in llm.engine.executor.worker.runner.model.modules():
        if isinstance(m, (LinearBase, ParallelLMHead)) and getattr(m, "weight", None) is not None:
            shape = tuple(int(s) for s in m.weight.shape)
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from corellm import LLM, SamplingParams
    from corellm_plugins.platform_cpu import gemm as cpu

    model = args.model
    if model is None:
        from throughput import make_model
        model = str(make_model(args.make_model))
    dtype = getattr(torch, args.dtype)
    paths = cpu.available_gemm_paths(dtype)
    env = environment()
    _log(f"{env['cpu_model']} ({', '.join(env.get('cpu_simd') or [])}), torch {torch.__version__}"
         f" with {torch.get_num_threads()} threads; {args.dtype} paths: {', '.join(paths)}")
    cfg = {"model": {"path": model, "dtype": args.dtype,
                     "max_model_len": args.prompt_len + max(args.output_len, 4)},  # warm-up: 4
           "scheduler": {"max_num_seqs": args.num_requests},
           "kv_cache": {"num_blocks": args.num_requests
                        * -(-(args.prompt_len + args.output_len) // 16) + 64}}

    real_plan = cpu.gemm_plan
    plans = ["measured"] + [p for p in paths if p != "measured"]
    engines = {}
    for name in plans:
        if name == "measured":
            cpu.gemm_plan = lambda shape, paths=None, dtype=None: measured[shape]
        else:
            cpu.gemm_plan = (lambda path: lambda shape, paths=None, dtype=None: cpu.GemmPlan(
                shape, (1,), (path,), dtype=args.dtype))(name)
        if name == "measured":
            probe = LLM(cfg | {"platform": {"name": "cpu", "weight_packing": False}})
            shapes = model_shapes(probe)
            probe.shutdown()
            measured = {s: cpu.measure_gemm_plan(s, paths, dtype=dtype) for s in shapes}
        engines[name] = LLM(cfg)
    cpu.gemm_plan = real_plan

    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)]}
               for i in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for llm in engines.values():                       # warm-up
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
            _log(f"round {r + 1}: {name}: {times[name][-1]:.2f} s")
    for llm in engines.values():
        llm.shutdown()
    tokens = args.num_requests * args.output_len
    rows = [{"plan": name, "median_s": statistics.median(t), "runs_s": t,
             "output_tok_s": tokens / statistics.median(t),
             "same_tokens_as_measured": outputs[name] == outputs["measured"]}
            for name, t in times.items()]
    return {"environment": env, "model": model, "dtype": args.dtype, "paths": list(paths),
            "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                         "output_len": args.output_len, "rounds": args.rounds},
            "shapes": [{"shape": list(s), "layers": n, "plan": measured[s].describe(),
                        "gflops": measured[s].gflops} for s, n in shapes.items()],
            "runs": rows}


def format_tables(results: dict[str, Any]) -> str:
    env = results["environment"]
    w = results["workload"]
    lines = [f"# CPU GEMM paths ({results.get('dtype', 'float32')} weights): {env['cpu_model']}, "
             f"{env['cpu_count']} CPUs, torch "
             f"{env['torch']}, {env['date'][:10]}", "", "## GFLOP/s per path (measured now)",
             "", "| shape | layers | rows | " + " | ".join(results["paths"]) + " | plan |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in results["paths"]) + " | --- |"]
    for s in results["shapes"]:
        for i, (rows, by_path) in enumerate(s["gflops"].items()):
            lines.append(f"| {s['shape'][0]}x{s['shape'][1]} | {s['layers']} | {rows} | "
                         + " | ".join(f"{by_path.get(p, float('nan')):.1f}"
                                      for p in results["paths"])
                         + f" | {s['plan'] if i == 0 else ''} |")
    base = next(r for r in results["runs"] if r["plan"] == "measured")["median_s"]
    lines += ["", f"## Decode-heavy: {w['num_requests']} requests x {w['prompt_len']} prompt "
              f"tokens -> {w['output_len']} tokens, median of {w['rounds']} alternating rounds",
              "", "| plan | median s | output tok/s | measured plan vs it | same tokens |",
              "| --- | ---: | ---: | ---: | --- |"]
    for r in results["runs"]:
        lines.append(f"| {r['plan']} | {r['median_s']:.2f} | {r['output_tok_s']:.1f} | "
                     f"{r['median_s'] / base:.2f}x | {r['same_tokens_as_measured']} |")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, _log)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    runs = results["runs"]
    ax.bar([r["plan"] for r in runs], [r["output_tok_s"] for r in runs],
           color=["tab:blue"] + ["tab:gray"] * (len(runs) - 1))
    ax.set_ylabel("output tokens/s (decode-heavy)")
    env = results["environment"]
    ax.set_title(f"GEMM plans: {env['cpu_model']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="Hugging Face checkpoint directory")
    p.add_argument("--make-model", default="/tmp/bench-model",
                   help="without --model: the throughput benchmark's ~100M Llama, built here")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the weights' dtype (the paths measured are those of this dtype)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--plot")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report(run(args), args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
