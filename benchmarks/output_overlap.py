#!/usr/bin/env python
"""Output processing off the stepping thread: ``LLM.generate`` throughput with the engine
stepped serially (``InprocClient``: each step, then its outputs' detokenization, stop strings
and ``RequestOutput`` building, in one thread), by a core thread (``core_thread=True``:
``ThreadedInprocClient``, outputs processed in the caller's thread while the next step runs) and
by the engine-core process (``engine_process=True``: ``SyncMPClient``, the server's split).

The same requests (random-token prompts, greedy, fixed output lengths, text detokenized, with
``--stop-strings`` stop strings that never match and ``--logprobs`` logprobs, so the matcher and
the logprob text run on every token) go through three ``LLM`` objects built side by side; each
timed round runs every mode once, in turn, and a mode's figure is the median of its rounds
(``--repeats``). Then the same again beside ``--noise-procs`` processes that each spin on a CPU
(``python3 -c 'while True: pass'``). The three modes' outputs are compared token for token.

"outside step" is the serial loop's wall time not spent in ``EngineCore.step()`` (from
``get_stats().timings``): output processing, the share the other two modes can hide.

Examples::

    # the tests' tiny Llama (2 layers, hidden 64: steps of a few ms, output processing matters)
    python benchmarks/output_overlap.py --make-tiny /tmp/overlap-tiny --noise-procs 1
    # the ~100M benchmark model of benchmarks/throughput.py
    python benchmarks/output_overlap.py --make-model /tmp/bench-model --noise-procs 1 \\
        --output-len 64:64 --repeats 3
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
from _common import (agreement, cpu_model, environment, loadavg, logger,  # noqa: E402
                     model_facts, parse_range, prompt_id_space, random_token_requests,
                     spinning_neighbours, warn_if_busy, write_json)

os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")
log = logger("output_overlap")

MODES = ("serial", "thread", "process")
# The tests' tiny Llama (tests/conftest.py TINY).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def make_tiny(path: str | Path) -> Path:
    """Build (once) the tests' tiny random Llama and its 1024-token tokenizer."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    import transformers as tf

    from corellm.checkpoint.demo import train_tokenizer, write_random_checkpoint
    tokenizer = train_tokenizer(vocab_size=1024)
    cfg = tf.LlamaConfig(**TINY, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, pad_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    write_random_checkpoint(path, cfg, tokenizer, seed=1234, init_std=0.15)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (one of)")
    m.add_argument("--model", help="Hugging Face checkpoint directory")
    m.add_argument("--make-tiny", metavar="DIR", help="build (once) the tests' tiny Llama here")
    m.add_argument("--make-model", metavar="DIR",
                   help="build (once) benchmarks/throughput.py's ~100M Llama here")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--input-len", type=parse_range, default=(16, 64), metavar="LO:HI")
    w.add_argument("--output-len", type=parse_range, default=(128, 128), metavar="LO:HI")
    w.add_argument("--stop-strings", type=int, default=4, metavar="N",
                   help="N stop strings per request that never match (the matcher still runs)")
    w.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="ask for K logprobs per token (their token text is decoded too)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--repeats", type=int, default=3, help="timed rounds (every mode each)")
    w.add_argument("--noise-procs", type=int, default=0, metavar="N",
                   help="then the same rounds beside N processes spinning on a CPU each")
    w.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {','.join(MODES)}")
    c = p.add_argument_group("engine")
    c.add_argument("--max-num-seqs", type=int, default=64)
    c.add_argument("--max-num-batched-tokens", type=int, default=2048)
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--dtype", default="float32")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT.json", help="write the results and the environment")
    return p


def _engine_config(args: argparse.Namespace, model: Path, requests: list[dict]) -> dict:
    bs = args.block_size
    longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
    blocks = sum(-(-(len(r["prompt_token_ids"]) + r["output_len"]) // bs) for r in requests)
    return {"model": {"path": str(model), "dtype": args.dtype, "max_model_len": longest,
                      "seed": args.seed},
            "scheduler": {"max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens},
            "kv_cache": {"block_size": bs, "num_blocks": blocks + args.max_num_seqs + 8}}


def _params(args: argparse.Namespace, requests: list[dict]) -> list:
    import random

    from corellm import SamplingParams
    rng = random.Random(args.seed)
    # Strings of characters no generated text contains: the matcher runs, nothing stops.
    stops = ["".join(rng.choice("\u2460\u2461\u2462\u2463") for _ in range(rng.randint(3, 8)))
             for _ in range(args.stop_strings)]
    return [SamplingParams(max_tokens=r["output_len"], temperature=0.0, ignore_eos=True,
                           stop=stops, logprobs=args.logprobs) for r in requests]


def _timed(llm: Any, prompts: list[dict], params: list) -> dict[str, Any]:
    before = llm.get_stats()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = llm.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    step_s = after.timings.get("step", 0.0) - before.timings.get("step", 0.0)
    steps = after.num_steps - before.num_steps
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "steps": steps, "step_s": step_s, "outside_step_s": wall - step_s,
            "caller_cpu_s": cpu, "token_ids": [o.outputs[0].token_ids for o in outs]}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    walls = [r["wall_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return {"wall_s": statistics.median(walls), "walls_s": walls,
            "output_tok_s": mid["output_tokens"] / statistics.median(walls),
            "output_tokens": mid["output_tokens"], "steps": mid["steps"],
            "step_ms": 1e3 * mid["step_s"] / max(mid["steps"], 1),
            "outside_step_ms": 1e3 * mid["outside_step_s"] / max(mid["steps"], 1),
            "outside_step_share": mid["outside_step_s"] / mid["wall_s"]}


def run_benchmark(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if sum(x is not None for x in (args.model, args.make_tiny, args.make_model)) != 1:
        raise SystemExit("give one of --model PATH, --make-tiny DIR, --make-model DIR")
    if args.model:
        model = Path(args.model)
    elif args.make_tiny:
        model = make_tiny(args.make_tiny)
    else:
        from throughput import make_model
        model = make_model(args.make_model)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes: a subset of {','.join(MODES)}")
    warn_if_busy(log)
    from corellm import LLM

    facts = model_facts(model)
    id_space, special = prompt_id_space(model, facts["vocab_size"])
    requests = random_token_requests(args.num_requests, args.input_len, args.output_len,
                                     args.seed, id_space, special)
    warm = random_token_requests(4, (16, 16), (8, 8), args.seed + 1, id_space, special)
    config = _engine_config(args, model, requests + warm)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = _params(args, requests)
    kwargs = {"serial": {"core_thread": False}, "thread": {"core_thread": True},
              "process": {"engine_process": True}}
    llms: dict[str, Any] = {}
    try:
        for mode in modes:
            log(f"{mode}: loading...")
            llms[mode] = LLM(config, **kwargs[mode])
            llms[mode].generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in warm],
                                _params(args, warm), use_tqdm=False)
        conditions = [("quiet", 0)] + ([("noise", args.noise_procs)] if args.noise_procs else [])
        results: dict[str, Any] = {"runs": {}}
        token_ids: dict[str, list] = {}
        for label, procs in conditions:
            runs: dict[str, list] = {m: [] for m in modes}
            load_before = loadavg()
            with spinning_neighbours(procs, log):
                for i in range(args.repeats):
                    for mode in modes:
                        r = _timed(llms[mode], prompts, params)
                        token_ids.setdefault(mode, r.pop("token_ids"))
                        r.pop("token_ids", None)
                        runs[mode].append(r)
                        log(f"{label} round {i + 1}/{args.repeats} {mode}: {r['wall_s']:.3f} s, "
                            f"{r['output_tok_s']:.0f} tok/s")
            # The 1-minute load average (this benchmark's own threads and neighbours count):
            # well above what they explain means another process shared the CPUs.
            results["runs"][label] = {"neighbours": procs, "loadavg_before": load_before,
                                      "loadavg_after": loadavg(),
                                      **{m: _summary(runs[m]) for m in modes}}
    finally:
        for llm in llms.values():
            llm.shutdown()
    results["agreement"] = {f"{m} vs {modes[0]}": agreement(token_ids[m], token_ids[modes[0]])
                            for m in modes[1:]}
    results.update({
        "benchmark": "output_overlap", "cpu_model": cpu_model(), "model": str(model),
        "command": " ".join([os.path.basename(sys.executable), "benchmarks/output_overlap.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "workload": {"requests": len(requests), "input_len": list(args.input_len),
                     "output_len": list(args.output_len), "stop_strings": args.stop_strings,
                     "logprobs": args.logprobs, "max_num_seqs": args.max_num_seqs},
        "environment": environment()})
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [f"CPU: {results['cpu_model']} ({os.cpu_count()} CPUs)",
             f"model: {results['model']}",
             "workload: " + ", ".join(f"{k}={v}" for k, v in results["workload"].items()),
             "", f"{'condition':<10} {'mode':<8} {'tok/s':>9} {'wall s':>8} {'rounds min-max':>15} "
             f"{'vs serial':>9} {'steps':>6} {'step ms':>8} {'outside ms/step':>16}"]
    for label, cond in results["runs"].items():
        base = cond.get("serial")
        for mode in MODES:
            if mode not in cond:
                continue
            r = cond[mode]
            ratio = f"{r['output_tok_s'] / base['output_tok_s']:.3f}x" if base else "-"
            outside = f"{r['outside_step_ms']:.2f} ({100 * r['outside_step_share']:.0f}%)"
            name = f"{label}" + (f" +{cond['neighbours']}" if cond["neighbours"] else "")
            spread = f"{min(r['walls_s']):.3f}-{max(r['walls_s']):.3f}"
            lines.append(f"{name:<10} {mode:<8} {r['output_tok_s']:>9.0f} {r['wall_s']:>8.3f} "
                         f"{spread:>15} {ratio:>9} {r['steps']:>6} {r['step_ms']:>8.2f} "
                         f"{outside:>16}")
    lines.append("")
    for label, cond in results["runs"].items():
        lines.append(f"{label}: 1-min load average {cond['loadavg_before']} before, "
                     f"{cond['loadavg_after']} after (noise processes: {cond['neighbours']})")
    for name, a in results["agreement"].items():
        lines.append(f"greedy outputs {name}: {a['identical']}/{a['of']} identical")
    lines.append("(outside ms/step: wall time not in EngineCore.step(), per step; for thread "
                 "and process the step runs elsewhere, so this is what was not hidden)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    out = build_parser().parse_args(argv).json
    results = run_benchmark(argv)
    print(format_table(results), flush=True)
    if out:
        write_json(results, out, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
