#!/usr/bin/env python
"""What one constrained request costs the batch around it.

A batch of ``--batch`` (64) requests decodes ``--tokens`` tokens each (``ignore_eos``, greedy).
In the *constrained* run one of them carries ``structured_outputs`` (a regex any length of
output satisfies, so it stays constrained to the end; ``--kind json`` uses a JSON schema
instead); in the *plain* run none does. Runs alternate (plain, constrained, ...) ``--repeats``
times on one engine. Reported: the output throughput of the unconstrained requests (the same
``batch - 1`` in both runs), its ratio constrained / plain (the goal: at least 0.95), and the
logits processors' own time per constrained token (masks filled and applied, tokens accepted:
``LogitsProcessorSet.apply`` + ``accept``), next to the engine's forward and sample phases of
each run (the forward, the same work in both, carries the machine's noise), with the CPU model
and load.

Examples::

    python benchmarks/structured.py                       # the default model, 64 x 64 tokens
    python benchmarks/structured.py --model /path/ckpt --repeats 5 --json structured.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks._common import cpu_model, loadavg, logger, warn_if_busy, write_json  # noqa: E402

log = logger("structured")
REGEX = "[a-z ,.]{1,4000}"
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def _timed(obj: Any, name: str, acc: list[float]) -> None:
    """Wrap ``obj.name`` to add its seconds to ``acc[0]``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from corellm import LLM, SamplingParams
    from corellm.sampling_params import StructuredOutputsParams

    config: dict[str, Any] = {"scheduler": {"max_num_seqs": args.batch},
                              "model": {"max_model_len": 512}}
    if args.model:
        config["model"]["path"] = args.model
    llm = LLM(config)
    runner = llm.engine.executor.worker.runner
    spent = [0.0]
    _timed(runner.logits_processors, "apply", spent)
    _timed(runner.logits_processors, "accept", spent)
    constraint = (StructuredOutputsParams(regex=REGEX) if args.kind == "regex"
                  else StructuredOutputsParams(json=SCHEMA))
    prompt = [{"prompt_token_ids": [1 + (i * 7 + j) % 200 for j in range(32)]}
              for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                                 structured_outputs=constraint)
    llm.generate(prompt[:4], plain, use_tqdm=False)                 # warm-up
    llm.generate(prompt[:1], constrained, use_tqdm=False)           # compiles the grammar once
    rows: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for mode in ("plain", "constrained"):
            params = [constrained if mode == "constrained" and i == 0 else plain
                      for i in range(args.batch)]
            spent[0] = 0.0
            before = dict(llm.engine.timings)
            t0 = time.perf_counter()
            outs = llm.generate(prompt, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            phases = {k: v - before.get(k, 0.0) for k, v in llm.engine.timings.items()}
            others = sum(len(o.outputs[0].token_ids) for o in outs[1:])
            first = len(outs[0].outputs[0].token_ids)
            rows.append({"repeat": rep, "mode": mode, "wall_s": wall,
                         "others_tok_s": others / wall, "constrained_tokens": first
                         if mode == "constrained" else 0,
                         "processor_s": spent[0], "forward_s": phases.get("forward", 0.0),
                         "sample_s": phases.get("sample", 0.0)})
            log(f"#{rep + 1} {mode}: {wall:.2f} s, others {others / wall:.1f} tok/s, "
                f"processors {spent[0] * 1e3:.1f} ms")
    llm.shutdown()
    med = {m: statistics.median(r["others_tok_s"] for r in rows if r["mode"] == m)
           for m in ("plain", "constrained")}
    cons = [r for r in rows if r["mode"] == "constrained"]
    per_token = statistics.median(r["processor_s"] / max(r["constrained_tokens"], 1)
                                  for r in cons)
    sample = {m: statistics.median(r["sample_s"] for r in rows if r["mode"] == m)
              for m in ("plain", "constrained")}
    forward = {m: statistics.median(r["forward_s"] for r in rows if r["mode"] == m)
               for m in ("plain", "constrained")}
    return {"cpu": cpu_model(), "sample_s": sample, "forward_s": forward, "loadavg": loadavg(), "batch": args.batch,
            "tokens": args.tokens, "kind": args.kind, "model": args.model or "default",
            "runs": rows, "others_tok_s_plain": med["plain"],
            "others_tok_s_constrained": med["constrained"],
            "ratio": med["constrained"] / med["plain"],
            "processor_ms_per_constrained_token": per_token * 1e3}


def table(res: dict[str, Any]) -> str:
    return "\n".join([
        f"{res['cpu']}; batch {res['batch']} x {res['tokens']} tokens, one {res['kind']}-"
        f"constrained request; model {res['model']}; load {res['loadavg']}",
        "",
        "| run | unconstrained requests' throughput (tok/s, median) |",
        "|---|---|",
        f"| none constrained | {res['others_tok_s_plain']:.1f} |",
        f"| one constrained | {res['others_tok_s_constrained']:.1f} |",
        f"| ratio | {res['ratio']:.3f} (goal >= 0.95) |",
        "",
        f"engine phases per run (median s): forward {res['forward_s']['plain']:.2f} / "
        f"{res['forward_s']['constrained']:.2f}, sample {res['sample_s']['plain']:.3f} / "
        f"{res['sample_s']['constrained']:.3f} (none / one constrained)",
        f"logits processors' time per constrained token: "
        f"{res['processor_ms_per_constrained_token']:.3f} ms"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint (default: the default model)")
    p.add_argument("--batch", type=int, default=64, help="requests per batch")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--kind", choices=("regex", "json"), default="regex",
                   help="the constraint of the one constrained request")
    p.add_argument("--repeats", type=int, default=3, help="plain/constrained pairs")
    p.add_argument("--json", help="also write the results as JSON")
    args = p.parse_args(argv)
    warn_if_busy(log)
    res = run(args)
    print(table(res), flush=True)
    if args.json:
        write_json(res, args.json, log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
