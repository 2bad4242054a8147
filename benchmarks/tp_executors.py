"""The tensor-parallel executors side by side: what each adds to a step beyond the ranks' own
work, on one machine.

The same model, the same requests, three engines alive together and measured in alternating
rounds (a slow phase of the machine falls on all): ``uniproc`` TP=1 (the in-process executor,
the floor), ``multiproc`` TP=2 (worker processes, shared-memory ring) and ``ray`` TP=2 (Ray
actors in a placement group; on the driver's node the same ring). Steps are not overlapped
(``async_scheduling: false``), so the engine's ``execute`` time of a step is handing the plan
over, the ranks' work and taking rank 0's output back; the ranks report their own work
(``prepare_inputs``, ``forward``, ``sample``), and the difference is the executor's overhead:

    overhead per step = (execute - prepare_inputs - forward - sample) / steps

(collectives between the ranks are inside ``forward``: both TP=2 executors pay the same gloo
all-reduces). Reported per step and per generated token, with output tok/s.

Ray advertises the machine's address, so the script runs itself in a loopback-only network
namespace (``unshare -n``; ``--no-netns`` where one cannot be made).

    python benchmarks/tp_executors.py --make-model /tmp/bench-model
    python benchmarks/tp_executors.py --tiny /tmp/tiny-model --rounds 5   # overhead dominates
    python benchmarks/tp_executors.py --tiny /tmp/tiny-model --busy 1     # beside a busy process
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (cpu_model, environment, in_netns, logger, pyplot, report,  # noqa: E402
                     spinning_neighbours)

_log = logger("tp-executors")
ENGINES = {"uniproc TP=1": ("uniproc", 1), "multiproc TP=2": ("multiproc", 2),
           "ray TP=2": ("ray", 2)}


def tiny_model(path: Path) -> Path:
    """The tests' tiny Llama (hidden 64, 2 layers): a step is mostly overhead."""
    if (path / "config.json").exists():
        return path
    import transformers as tf

    from corellm.checkpoint.demo import train_tokenizer, write_random_checkpoint
    tok = train_tokenizer(vocab_size=1024)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, bos_token_id=None,
                         tie_word_embeddings=False)
    write_random_checkpoint(path, cfg, tok, seed=1234, init_std=0.15)
    return path


def _phase(stats: Any) -> dict[str, float]:
    return {"steps": stats.num_steps, **stats.timings}


def _round(llm: Any, prompts: list, params: Any) -> dict[str, float]:
    before = _phase(llm.get_stats())
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _phase(llm.get_stats())
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    work = sum(d.get(k, 0.0) for k in ("prepare_inputs", "forward", "sample"))
    return {"wall_s": wall, "tokens": tokens, "steps": d["steps"],
            "overhead_us_per_step": 1e6 * (d["execute"] - work) / d["steps"],
            "overhead_us_per_token": 1e6 * (d["execute"] - work) / tokens,
            "step_ms": 1e3 * d["step"] / d["steps"], "tok_s": tokens / wall,
            "ids": [o.outputs[0].token_ids for o in outs]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from corellm import LLM, SamplingParams
    if args.tiny:
        model = tiny_model(Path(args.tiny))
    elif args.model:
        model = Path(args.model)
    else:
        from throughput import make_model
        model = make_model(args.make_model)
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False,
             num_cpus=os.cpu_count())
    base = {"model": {"path": str(model), "dtype": "float32"},
            "kv_cache": {"num_blocks": args.num_blocks},
            "scheduler": {"async_scheduling": False, "max_num_seqs": args.requests}}
    engines = {}
    for label, (name, tp) in ENGINES.items():
        t0 = time.perf_counter()
        engines[label] = LLM({**base, "executor": {"name": name},
                              "parallel": {"tensor_parallel_size": tp}})
        _log(f"{label}: started in {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": [11 + (i * 37 + j * 13) % 900 for j in range(args.input_len)]}
               for i in range(args.requests)]
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    rounds: dict[str, list] = {label: [] for label in engines}
    with spinning_neighbours(args.busy, _log):
        for r in range(args.rounds):
            for label, llm in engines.items():
                rounds[label].append(_round(llm, prompts, params))
            _log(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} {v[-1]['overhead_us_per_step']:.0f} us/step" for k, v in rounds.items()))
    for llm in engines.values():
        llm.shutdown()
    ref = rounds["uniproc TP=1"][0]["ids"]
    rows = {}
    for label, rs in rounds.items():
        rows[label] = {k: statistics.median(r[k] for r in rs)
                       for k in ("overhead_us_per_step", "overhead_us_per_token", "step_ms",
                                 "tok_s")}
        rows[label]["identical_to_tp1"] = all(r["ids"] == ref for r in rs)
        rows[label]["rounds"] = [{k: v for k, v in r.items() if k != "ids"} for r in rs]
    return {"benchmark": "tp_executors", "environment": environment(), "cpu": cpu_model(),
            "model": str(model), "settings": {k: v for k, v in vars(args).items()},
            "engines": rows}


def format_tables(results: dict[str, Any]) -> str:
    rows = results["engines"]
    mp = rows["multiproc TP=2"]["overhead_us_per_step"]
    busy = results["settings"]["busy"]
    lines = [f"model {results['model']}, {results['cpu']}; medians of "
             f"{results['settings']['rounds']} alternating rounds"
             + (f", beside {busy} busy process(es)" if busy else ", quiet"),
             "| executor | overhead / step | overhead / token | vs multiproc | step | output "
             "tok/s | greedy = TP=1 |", "| --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['overhead_us_per_step']:.0f} us | "
                     f"{r['overhead_us_per_token']:.1f} us | "
                     f"{r['overhead_us_per_step'] / mp:.2f}x | {r['step_ms']:.2f} ms | "
                     f"{r['tok_s']:.1f} | {'yes' if r['identical_to_tp1'] else 'NO'} |")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, _log)
    if plt is None:
        return False
    rows = results["engines"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = list(rows)
    ax.bar(labels, [rows[k]["overhead_us_per_step"] for k in labels], color="tab:blue")
    ax.set_ylabel("executor overhead per step (us)")
    ax.set_title("tensor-parallel executors, " + results["cpu"][:40], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help="a checkpoint directory")
    m.add_argument("--make-model", metavar="DIR", help="build (once) the ~100M benchmark Llama")
    m.add_argument("--tiny", metavar="DIR", help="build (once) the tests' tiny Llama")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run beside N processes spinning on a CPU each")
    p.add_argument("--no-netns", action="store_true",
                   help="run here, not in a loopback-only network namespace")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    status = in_netns(args.no_netns)
    if status is not None:
        return status
    results = run(args)
    report(results, args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
