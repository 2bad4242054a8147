#!/usr/bin/env python
"""Prefix caching on vs off: the same workloads through the same model, side by side in one run.

Workloads (token-id prompts, greedy decoding, fixed output lengths via ``ignore_eos``):

* ``multi-turn``: ``--conversations`` chats of ``--turns`` turns. Turn 1 is a unique context of
  ``--context-len`` tokens plus a user message of ``--user-len`` tokens; every later turn resends
  the whole history (previous prompt, the model's answer, a new user message), as chat clients do.
  All conversations' turn *t* arrive together; turn *t + 1* starts when turn *t* has finished.
* ``shared-prefix``: ``--num-requests`` requests made of one system prompt of ``--system-len``
  tokens plus a unique question (``--question-len LO:HI``), all arriving together.

For each workload both engines (``kv_cache.enable_prefix_caching`` false, then true) start from
an empty cache. Reported per run: prompt tokens sent, prefill tokens actually computed, the
cache hit rate (hit tokens / looked-up tokens), wall time, output and total token throughput, and
time to first token (arrival to first token of each request, including its wait in the queue).
The two engines' greedy outputs are compared token for token.

Examples::

    python benchmarks/prefix_cache.py                      # demo model, both workloads
    python benchmarks/prefix_cache.py --json out.json --plot out.png
    python benchmarks/prefix_cache.py --model /path/to/ckpt --workloads multi-turn
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (Clock, agreement, environment, logger, model_facts,  # noqa: E402
                     parse_range, prompt_id_space, pyplot, report, warn_if_busy)

os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
log = logger("prefix_cache")
SETTINGS = (("off", False), ("on", True))
WORKLOADS = ("multi-turn", "shared-prefix")


# ----------------------------------------------------------------------------- workloads
class TokenSource:
    """Random prompt token ids from the ids both model and tokenizer know, minus specials."""

    def __init__(self, vocab: int, exclude: set[int], seed: int) -> None:
        import numpy as np
        self.rng = np.random.default_rng(seed)
        self.allowed = np.setdiff1d(np.arange(vocab), np.fromiter(exclude, dtype=np.int64))

    def take(self, n: int) -> list[int]:
        return self.rng.choice(self.allowed, size=n).tolist()

    def length(self, lo_hi: tuple[int, int]) -> int:
        return int(self.rng.integers(lo_hi[0], lo_hi[1] + 1))


def multi_turn_script(args: argparse.Namespace, src: TokenSource) -> list[dict[str, Any]]:
    """Per conversation: the turn-1 prompt and each later turn's new user message."""
    return [{"first": src.take(args.context_len + args.user_len),
             "later": [src.take(args.user_len) for _ in range(args.turns - 1)]}
            for _ in range(args.conversations)]


def shared_prefix_prompts(args: argparse.Namespace, src: TokenSource) -> list[list[int]]:
    system = src.take(args.system_len)
    return [system + src.take(src.length(args.question_len)) for _ in range(args.num_requests)]


# ----------------------------------------------------------------------------- one run
def _generate(llm, prompts: list[list[int]], max_tokens: int, progress: bool):
    from corellm import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=progress)


def run_workload(llm, workload: str, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run one workload on one engine from an empty prefix cache; return its measurements."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not reset the prefix cache (requests still running?)")
    before = llm.get_stats()
    outputs, ttft, per_turn, prefill_per_turn, prompt_tokens = [], [], [], [], 0
    clock = Clock()
    if workload == "multi-turn":
        histories = [c["first"] for c in data]
        for turn in range(args.turns):
            if turn:
                histories = [h + c["later"][turn - 1] for h, c in zip(histories, data)]
            computed = llm.get_stats().num_prefill_tokens
            outs = _generate(llm, histories, args.output_len, not args.no_tqdm)
            prefill_per_turn.append(llm.get_stats().num_prefill_tokens - computed)
            times = [o.metrics.time_to_first_token for o in outs]
            per_turn.append(sum(times) / len(times))
            ttft += times
            prompt_tokens += sum(map(len, histories))
            outputs += [o.outputs[0].token_ids for o in outs]
            histories = [h + o.outputs[0].token_ids for h, o in zip(histories, outs)]
    else:
        outs = _generate(llm, data, args.output_len, not args.no_tqdm)
        ttft = [o.metrics.time_to_first_token for o in outs]
        prompt_tokens = sum(map(len, data))
        outputs = [o.outputs[0].token_ids for o in outs]
    wall, cpu = clock.stop()
    after = llm.get_stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    output_tokens = sum(map(len, outputs))
    ttft_sorted = sorted(ttft)
    return {
        "requests": len(outputs), "prompt_tokens": prompt_tokens,
        "prefill_tokens": after.num_prefill_tokens - before.num_prefill_tokens,
        "cache_hit_tokens": hits, "cache_hit_rate": hits / queries if queries else 0.0,
        "output_tokens": output_tokens, "wall_s": wall,
        "output_tok_s": output_tokens / wall, "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_p50_s": ttft_sorted[len(ttft) // 2],
        "ttft_p90_s": ttft_sorted[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "ttft_mean_per_turn_s": per_turn or None,
        "prefill_tokens_per_turn": prefill_per_turn or None,
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "kv_evictions": None, **cpu, "_outputs": outputs,
    }


# ----------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    m = p.add_argument_group("multi-turn")
    m.add_argument("--conversations", type=int, default=32)
    m.add_argument("--turns", type=int, default=4)
    m.add_argument("--context-len", type=int, default=512, help="unique context of turn 1")
    m.add_argument("--user-len", type=int, default=32, help="tokens of each user message")
    s = p.add_argument_group("shared-prefix")
    s.add_argument("--num-requests", type=int, default=64)
    s.add_argument("--system-len", type=int, default=512)
    s.add_argument("--question-len", type=parse_range, default=(16, 64), metavar="LO:HI")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: the device's, 128 on the CPU); a prefix "
                        "is reused in whole blocks")
    e.add_argument("--num-kv-blocks", type=int, default=None,
                   help="default: sized from kv_cache.memory_gib (1 GiB)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT.json")
    o.add_argument("--plot", metavar="OUT.png", help="bar charts and per-turn TTFT (matplotlib)")
    o.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    return p


def run_benchmark(argv: list[str] | argparse.Namespace | None = None) -> dict[str, Any]:
    from corellm import LLM

    args = argv if isinstance(argv, argparse.Namespace) else build_parser().parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(workloads) - set(WORKLOADS)
    if unknown or not workloads:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose from {WORKLOADS}")
    if args.model:
        model = Path(args.model)
    else:
        from corellm.checkpoint.demo import ensure_demo_model
        model = ensure_demo_model()
    facts = model_facts(model)
    vocab, special = prompt_id_space(model, facts["vocab_size"])
    src = TokenSource(vocab, special, args.seed)
    data = {"multi-turn": multi_turn_script(args, src), "shared-prefix":
            shared_prefix_prompts(args, src)}
    longest = max(args.context_len + args.turns * (args.user_len + args.output_len),
                  args.system_len + args.question_len[1] + args.output_len)
    limit = facts["max_position_embeddings"] or longest
    if longest > limit:
        raise SystemExit(f"the longest request needs {longest} tokens; the model allows {limit}")

    results: dict[str, Any] = {
        "environment": environment(), "command": None,
        "model": {"path": str(model), **facts, "dtype": args.dtype, "max_model_len": longest},
        "workloads": {
            "multi-turn": {"conversations": args.conversations, "turns": args.turns,
                           "context_len": args.context_len, "user_len": args.user_len,
                           "output_len": args.output_len},
            "shared-prefix": {"num_requests": args.num_requests, "system_len": args.system_len,
                              "question_len": list(args.question_len),
                              "output_len": args.output_len}},
        "runs": [], "agreement": {},
    }
    warn_if_busy(log)
    engines = {}
    for label, enabled in SETTINGS:
        kv: dict[str, Any] = {"enable_prefix_caching": enabled}
        if args.num_kv_blocks:
            kv["num_blocks"] = args.num_kv_blocks
        if args.block_size:
            kv["block_size"] = args.block_size
        config = {"model": {"path": str(model), "dtype": args.dtype, "max_model_len": longest,
                            "seed": args.seed},
                  "scheduler": {"max_num_seqs": args.max_num_seqs,
                                "max_num_batched_tokens": args.max_num_batched_tokens},
                  "kv_cache": kv}
        log(f"loading the engine with prefix caching {label}...")
        llm = LLM(config)
        # Untimed warm-up with full-budget prefill steps and a batch of decodes, so first-use
        # costs (allocator growth, kernel selection) land in neither timed run.
        warm = TokenSource(vocab, special, args.seed + 1)
        warm_len = max(1, min(256, longest - 8))
        n_warm = min(max(4, -(-2 * args.max_num_batched_tokens // warm_len)), args.max_num_seqs)
        _generate(llm, [warm.take(warm_len) for _ in range(n_warm)], 8, False)
        engines[label] = llm
    try:
        for workload in workloads:
            outs = {}
            for label, _ in SETTINGS:
                log(f"{workload}, prefix caching {label}...")
                llm = engines[label]
                evictions = llm.engine.kv_cache_manager.pool.num_evictions if hasattr(
                    llm.engine.kv_cache_manager, "pool") else None
                row = run_workload(llm, workload, data[workload], args)
                if evictions is not None:
                    row["kv_evictions"] = llm.engine.kv_cache_manager.pool.num_evictions - evictions
                outs[label] = row.pop("_outputs")
                results["runs"].append({"workload": workload, "prefix_caching": label, **row})
            results["agreement"][workload] = agreement(outs["off"], outs["on"])
    finally:
        for llm in engines.values():
            llm.shutdown()
    results["ratios"] = ratios(results)
    return results


def ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per workload: off / on for prefill tokens and mean TTFT, on / off for throughput."""
    out = {}
    by = {(r["workload"], r["prefix_caching"]): r for r in results["runs"]}
    for workload in dict.fromkeys(r["workload"] for r in results["runs"]):
        off, on = by[(workload, "off")], by[(workload, "on")]
        out[workload] = {
            "prefill_tokens_off_over_on": off["prefill_tokens"] / max(on["prefill_tokens"], 1),
            "ttft_mean_off_over_on": off["ttft_mean_s"] / on["ttft_mean_s"],
            "total_tok_s_on_over_off": on["total_tok_s"] / off["total_tok_s"],
            "wall_off_over_on": off["wall_s"] / on["wall_s"]}
    return out


def format_tables(results: dict[str, Any]) -> str:
    head = (f"{'workload':<14} {'cache':>5} {'requests':>8} {'prompt tok':>10} "
            f"{'prefill tok':>11} {'hit rate':>8} {'wall s':>7} {'out tok/s':>9} "
            f"{'total tok/s':>11} {'TTFT mean ms':>12} {'p50 ms':>7} {'p90 ms':>7}")
    lines = [head, "-" * len(head)]
    for r in results["runs"]:
        lines.append(
            f"{r['workload']:<14} {r['prefix_caching']:>5} {r['requests']:>8} "
            f"{r['prompt_tokens']:>10} {r['prefill_tokens']:>11} "
            f"{100 * r['cache_hit_rate']:>7.1f}% {r['wall_s']:>7.2f} {r['output_tok_s']:>9.1f} "
            f"{r['total_tok_s']:>11.1f} {1e3 * r['ttft_mean_s']:>12.1f} "
            f"{1e3 * r['ttft_p50_s']:>7.1f} {1e3 * r['ttft_p90_s']:>7.1f}")
    lines.append("")
    for workload, q in results["ratios"].items():
        lines.append(f"{workload}: {q['prefill_tokens_off_over_on']:.2f}x fewer prefill tokens, "
                     f"{q['ttft_mean_off_over_on']:.2f}x lower mean TTFT, "
                     f"{q['total_tok_s_on_over_off']:.2f}x total throughput with prefix caching")
    for r in results["runs"]:
        if r["workload"] == "multi-turn":
            lines.append(f"multi-turn per turn, prefix caching {r['prefix_caching']:>3}: mean TTFT "
                         + " / ".join(f"{1e3 * t:.0f}" for t in r["ttft_mean_per_turn_s"])
                         + " ms; prefill tokens "
                         + " / ".join(map(str, r["prefill_tokens_per_turn"])))
    for workload, ag in results["agreement"].items():
        lines.append(f"greedy outputs, {workload}: {ag['identical']}/{ag['of']} identical "
                     "with and without prefix caching")
    util = ", ".join(f"{r['workload']}/{r['prefix_caching']} {100 * r['cpu_util']:.0f}%"
                     for r in results["runs"])
    lines.append(f"CPU utilization of the runs (process CPU s / wall s / threads): {util}")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    runs = results["runs"]
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    by = {(r["workload"], r["prefix_caching"]): r for r in runs}
    colors = {"off": "#999999", "on": "#3b75af"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), dpi=110)
    for ax, key, scale, label in ((axes[0], "prefill_tokens", 1e-3, "prefill tokens computed (k)"),
                                  (axes[1], "ttft_mean_s", 1e3, "mean time to first token (ms)")):
        for j, (setting, _) in enumerate(SETTINGS):
            xs = [i + (j - 0.5) * 0.38 for i in range(len(workloads))]
            bars = ax.bar(xs, [by[(w, setting)][key] * scale for w in workloads], width=0.38,
                          color=colors[setting], label=f"prefix caching {setting}")
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    axes[0].legend(fontsize=8)
    ax = axes[2]
    if "multi-turn" in workloads:
        for setting, _ in SETTINGS:
            per_turn = by[("multi-turn", setting)]["ttft_mean_per_turn_s"]
            ax.plot(range(1, len(per_turn) + 1), [1e3 * t for t in per_turn], marker="o",
                    color=colors[setting], label=f"prefix caching {setting}")
        ax.set_xticks(range(1, results["workloads"]["multi-turn"]["turns"] + 1))
        ax.set_xlabel("turn")
        ax.set_ylabel("mean TTFT (ms)")
        ax.set_title("multi-turn: TTFT per turn", fontsize=9)
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
    fig.suptitle(f"prefix caching off vs on ({Path(results['model']['path']).name}, "
                 f"{results['environment']['torch_threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    results = run_benchmark(args)
    results["command"] = " ".join(["python", *(sys.argv if argv is None else
                                               ["benchmarks/prefix_cache.py", *argv])])
    log(f"done in {time.perf_counter() - t0:.0f} s")
    report(results, args, format_tables, write_plot, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
