#!/usr/bin/env python
"""Multi-LoRA throughput and memory: one engine serving several adapters at once, against the
base model alone and against one merged model per adapter (what serving without multi-LoRA
takes).

The workload: ``--requests`` prompts of random ids (uniform over the vocabulary; lengths in
``--input-len``) generating ``--output-len`` tokens each (greedy, ``ignore_eos``), all submitted
at once. Three arms, each in its own process, alternating over ``--rounds`` rounds:

* ``base``: the base model, LoRA off, every request on it;
* ``multi-lora``: LoRA on (``max_loras`` = ``--adapters``), the requests spread round-robin over
  ``--adapters`` random PEFT adapters of rank ``--rank`` on every projection (q, k, v, o, gate,
  up, down), mixed in every step;
* ``merged``: each adapter merged into its own copy of the model (PEFT's ``merge_and_unload``),
  each copy an engine serving its share of the requests, one after another (the machine's
  cores are shared, so running them at once would not be faster): tok/s = all tokens over the
  sum of the engines' times. Its memory is one model copy per adapter.

``--busy N`` runs every arm beside N processes that each spin on a CPU. The table gives each
arm's output tok/s (median over the rounds), the ratio to ``base``, the weights' memory (the
model's weights, plus the adapters' device slots for ``multi-lora``, times the adapters for
``merged``) and the peak RSS of its process; and how many of the requests give the same greedy
tokens with an adapter applied at run time as with it merged (they differ only by float
rounding).

    python benchmarks/lora.py --make-model /tmp/bench-model
    python benchmarks/lora.py --make-model /tmp/bench-model --requests 16 --output-len 16 \\
        --rounds 1                                         # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, logger, pyplot, report, spinning_neighbours  # noqa: E402

_log = logger("lora")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, out: Path, n: int, rank: int) -> list[Path]:
    """``n`` random PEFT adapters of ``base`` (rank ``rank``, every projection), and each merged
    into its own copy of the model; built once, reused."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(n):
        adapter, merged = out / f"adapter-{i}", out / f"merged-{i}"
        paths.append(adapter)
        if (merged / ".complete").exists():
            continue
        _log(f"making adapter {i + 1}/{n} and its merged model in {out}")
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=TARGETS,
                                                      init_lora_weights=False))
        with torch.no_grad():                     # a trained adapter's size of update
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        peft_model.save_pretrained(adapter)
        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged_model = PeftModel.from_pretrained(base_model, adapter).merge_and_unload()
        shutil.rmtree(merged, ignore_errors=True)
        shutil.copytree(base, merged, ignore=shutil.ignore_patterns(".bench-complete"))
        merged_model.save_pretrained(merged)
        (merged / ".complete").write_text("")
    return paths


# ------------------------------------------------------------------ one arm, in its own process
def worker(spec: dict[str, Any]) -> dict[str, Any]:
    from corellm import LLM, LoRARequest, SamplingParams

    arm, prompts, n = spec["arm"], spec["prompts"], spec["adapters"]
    params = SamplingParams(max_tokens=spec["output_len"], temperature=0, ignore_eos=True)
    cfg = {"model": {"path": spec["model"], "max_model_len": spec["max_model_len"]},
           "scheduler": {"max_num_seqs": len(prompts)}}
    wall, tokens, weights, outputs = 0.0, 0, 0, []
    if arm == "merged":
        for i in range(n):
            mine = prompts[i::n]
            llm = LLM({**cfg, "model": {**cfg["model"], "path": spec["merged"][i]}})
            weights += sum(llm.engine.executor.worker.runner.weight_memory.values())
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in mine], params, use_tqdm=False)
            wall += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            outputs += [(k * n + i, o.outputs[0].token_ids) for k, o in enumerate(outs)]
            llm.shutdown()
        outputs = [t for _, t in sorted(outputs)]
    else:
        lora = arm == "multi-lora"
        if lora:
            cfg["lora"] = {"enable": True, "max_loras": n, "max_lora_rank": spec["rank"]}
        llm = LLM(cfg)
        runner = llm.engine.executor.worker.runner
        weights = sum(runner.weight_memory.values())
        if lora:
            weights += sum(x.nbytes for x in runner.lora.layers.values())
        requests = [LoRARequest(f"adapter-{i}", i + 1, a) for i, a in enumerate(spec["loras"])]
        which = [requests[k % n] for k in range(len(prompts))] if lora else None
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=which, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        outputs = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
    return {"arm": arm, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "weights_bytes": weights,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "outputs": outputs}


def run_arm(spec: dict[str, Any], arm: str, tmp: Path) -> dict[str, Any]:
    path = tmp / f"spec-{arm}.json"
    path.write_text(json.dumps({**spec, "arm": arm}))
    out = subprocess.run([sys.executable, __file__, "--worker", str(path)], text=True,
                         stdout=subprocess.PIPE)
    if out.returncode != 0:
        raise SystemExit(f"the {arm} arm failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    from throughput import make_model

    base = Path(args.model) if args.model else make_model(args.make_model)
    work = Path(args.work_dir or (str(base) + "-lora"))
    loras = make_adapters(base, work, args.adapters, args.rank)
    lo, hi = (int(v) for v in args.input_len.split(":"))
    rng = random.Random(args.seed)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.requests)]
    spec = {"model": str(base), "loras": [str(p) for p in loras], "adapters": args.adapters,
            "merged": [str(work / f"merged-{i}") for i in range(args.adapters)],
            "rank": args.rank, "prompts": prompts, "output_len": args.output_len,
            "max_model_len": hi + args.output_len}
    arms = ["base", "multi-lora", "merged"]
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with spinning_neighbours(args.busy, _log):
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                res = run_arm(spec, arm, work)
                runs[arm].append(res)
                _log(f"round {r + 1}/{args.rounds} {arm}: {res['tok_s']:.1f} tok/s "
                     f"({res['tokens']} tokens in {res['wall_s']:.1f} s)")
    results: dict[str, Any] = {"environment": environment(), "config": vars(args),
                               "arms": {}}
    base_tok_s = statistics.median(x["tok_s"] for x in runs["base"])
    for arm in arms:
        tok_s = statistics.median(x["tok_s"] for x in runs[arm])
        results["arms"][arm] = {
            "tok_s": tok_s, "tok_s_all": [x["tok_s"] for x in runs[arm]],
            "vs_base": tok_s / base_tok_s,
            "weights_bytes": runs[arm][0]["weights_bytes"],
            "peak_rss_bytes": max(x["peak_rss_bytes"] for x in runs[arm])}
    same = sum(a == b for a, b in zip(runs["multi-lora"][0]["outputs"],
                                      runs["merged"][0]["outputs"]))
    results["agreement_multi_lora_vs_merged"] = {"identical": same, "of": args.requests}
    return results


def format_tables(res: dict[str, Any]) -> str:
    c = res["config"]
    busy = f", beside {c['busy']} busy process(es)" if c.get("busy") else ""
    lines = [f"{c['requests']} requests ({c['input_len']} prompt tokens, {c['output_len']} new), "
             f"{c['adapters']} adapters of rank {c['rank']}; {res['environment']['cpu_model']}, "
             f"{res['environment']['cpu_count']} CPUs{busy}",
             f"{'arm':<12}{'tok/s':>10}{'x base':>9}{'weights MiB':>14}{'peak RSS MiB':>15}"]
    for arm, a in res["arms"].items():
        lines.append(f"{arm:<12}{a['tok_s']:>10.1f}{a['vs_base']:>9.2f}"
                     f"{a['weights_bytes'] / 2**20:>14.0f}{a['peak_rss_bytes'] / 2**20:>15.0f}")
    ag = res["agreement_multi_lora_vs_merged"]
    lines.append(f"greedy outputs identical, adapters at run time vs merged: {ag['identical']} "
                 f"of {ag['of']} requests")
    return "\n".join(lines)


def write_plot(res: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, _log)
    if plt is None:
        return False
    arms = list(res["arms"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.bar(arms, [res["arms"][x]["tok_s"] for x in arms], color=["#888", "#3a7", "#c84"])
    a.set_ylabel("output tok/s")
    b.bar(arms, [res["arms"][x]["weights_bytes"] / 2**20 for x in arms],
          color=["#888", "#3a7", "#c84"])
    b.set_ylabel("weights, MiB")
    c = res["config"]
    fig.suptitle(f"{c['requests']} requests over {c['adapters']} rank-{c['rank']} adapters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", help="a Hugging Face Llama-family checkpoint directory")
    m.add_argument("--make-model", metavar="DIR", default="/tmp/bench-model",
                   help="build (once) the ~100M random benchmark Llama here")
    p.add_argument("--work-dir", help="where the adapters and merged models go (default: "
                                      "MODEL-lora)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", default="64:128", help="MIN:MAX prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run every arm beside N processes that each spin on a CPU")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(Path(args.worker).read_text()))), flush=True)
        return 0
    res = run(args)
    report(res, args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
