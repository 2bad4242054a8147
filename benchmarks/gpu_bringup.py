#!/usr/bin/env python
"""The Python half of ``benchmarks/gpu_bringup.sh``: corellm's CUDA platform checked on a real
GPU, one subcommand per step, each writing one JSON file (the shell script runs each under its
own timeout, so one failing step hides nothing of the others).

    env            the machine: GPU, driver, torch / CUDA / Triton / transformers versions
    parity         greedy tokens of corellm on CUDA against transformers on CUDA, float32,
                   token for token, on random-weight Llamas built the way tests/conftest.py
                   builds them; with and without CUDA graphs, and with chunked prefills
    make-qwen3     a random-weight checkpoint of Qwen3-0.6B's published shape (bfloat16), with
                   the tests' tokenizer (corellm.checkpoint.demo.train_tokenizer)
    tp-corellm     benchmarks/throughput.py, its engine config amended (``--platform`` JSON:
                   e.g. cuda_graphs off), the rest of the arguments passed through
    profile        where a decode step's time goes: ``EngineCore.step()`` at a fixed batch and
                   context, per step: device time (CUDA events), host phases, kernels and host
                   syncs (torch.profiler), against the step's HBM floor (weights + the batch's
                   KV read once at the measured copy bandwidth); greedy and temperature 0.6
    hf-throughput  transformers ``generate`` on the same workload as benchmarks/throughput.py
                   (same seed, same prompts), on the GPU: the peer of corellm's figure
    summarize      the step table, the test counts, the parity and throughput figures
    register-source  the install's fallback where ``pip install -e .`` cannot build offline:
                   the source tree on sys.path and a dist-info with the entry points

Every subcommand also runs on a machine without a GPU (``--device cpu``, tiny sizes): the
script's own dry run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def log(msg: str) -> None:
    print(f"[gpu_bringup] {msg}", file=sys.stderr, flush=True)


def write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=1, default=str))
        log(f"wrote {path}")


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- env
def cmd_env(args: argparse.Namespace) -> int:
    import platform
    import subprocess

    import torch
    import transformers
    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"missing: {exc}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                    multiprocessors=p.multi_processor_count, total_gib=total / 2**30,
                    free_gib=free / 2**30, device_count=torch.cuda.device_count())
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
             "clocks.max.sm,power.limit", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    from corellm.plugins import load_registry
    from corellm.config import load_config
    registry = load_registry()
    info["auto_platform"] = load_config({}, registry=registry).platform.name
    for name in ("cuda", "cpu"):
        entry = registry.get("platform", name)
        why = entry.spec.availability() if entry.spec.availability else None
        info[f"platform_{name}"] = why or "available"
    print(json.dumps(info, indent=1))
    write_json(args.json, info)
    return 0


# --------------------------------------------------------------------------- parity
def free_device_memory() -> None:
    """What a shut-down engine's last references held goes back to the device."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tiny_llama(tokenizer, path: Path) -> Path:
    """tests/conftest.py's Llama, exactly: TINY sizes (head size 16), seed 1234, std 0.15."""
    from corellm.checkpoint.demo import write_random_checkpoint
    from tests.conftest import _hf_config
    cfg = _hf_config("llama", len(tokenizer), tokenizer.eos_token_id)
    return write_random_checkpoint(path, cfg, tokenizer, seed=1234, init_std=0.15)


def _h128_llama(tokenizer, path: Path) -> Path:
    """The same recipe at a real model's head size (128, GQA 4) and 2048 positions, so that
    prompts over split_kv_min_len (1024) take the split-KV decode path when run eagerly."""
    import transformers as tf

    from corellm.checkpoint.demo import write_random_checkpoint
    eos = tokenizer.eos_token_id
    cfg = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=2048,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=eos, bos_token_id=None,
                         pad_token_id=eos, tie_word_embeddings=False)
    return write_random_checkpoint(path, cfg, tokenizer, seed=1234, init_std=0.15)


def _hf_reference(path: Path, prompts: list[list[int]], new_tokens: int, device: str):
    """transformers' greedy generate on ``device`` in float32, one prompt at a time (no
    padding): per prompt, its new tokens and the logits of each step (on the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            r = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen,
                               return_dict_in_generate=True, output_logits=True)
            out.append((r.sequences[0, len(ids):].tolist(),
                        [lg[0].float().cpu() for lg in r.logits]))
    attn = getattr(model.config, "_attn_implementation", "?")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out, attn


def _classify(ours: list[int], theirs: list[int], logits) -> dict[str, Any]:
    """identical / near tie (tests/test_hf_equivalence.py's rule: at the first difference the
    reference's logits of the two tokens differ by less than NEAR_TIE) / mismatch."""
    from tests.test_hf_equivalence import NEAR_TIE
    if len(ours) != len(theirs):
        return {"result": "mismatch", "why": f"lengths {len(ours)} vs {len(theirs)}"}
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is None:
        return {"result": "identical"}
    gap = float(logits[first][theirs[first]] - logits[first][ours[first]])
    return {"result": "near_tie" if gap < NEAR_TIE else "mismatch", "position": first,
            "ours": ours[first], "theirs": theirs[first], "logit_gap": gap}


def cmd_parity(args: argparse.Namespace) -> int:
    import torch

    from corellm import LLM, SamplingParams
    from corellm.checkpoint.demo import train_tokenizer
    from tests.test_hf_equivalence import make_prompts
    device = args.device or default_device()
    tok = train_tokenizer(vocab_size=1024)
    tmp = Path(tempfile.mkdtemp(prefix="corellm-parity-"))
    new = args.new_tokens
    models = {
        # name: (builder, prompts, max_model_len, max_num_seqs, num_blocks)
        "tiny_llama_h16": (_tiny_llama, make_prompts(len(tok)), 512, 8, 256),
        # two more prompts of 1272 and 1800 tokens: the split-KV decode path, when eager
        "llama_h128": (_h128_llama, make_prompts(len(tok))
                       + [p * 6 for p in make_prompts(len(tok), seed=2)[6:8]], 2048, 16, 512),
    }
    if device == "cuda":
        settings = {
            "cuda_graphs": ({"platform": {"name": "cuda", "cuda_graphs": True}}, True),
            "eager": ({"platform": {"name": "cuda", "cuda_graphs": False}}, False),
            "chunked_prefill_graphs": ({"platform": {"name": "cuda", "cuda_graphs": True},
                                        "scheduler": {"max_num_batched_tokens": 64}}, True),
        }
    else:                                    # the dry run: the script's logic on the CPU
        settings = {"cpu": ({"platform": {"name": "cpu"}}, False),
                    "cpu_chunked": ({"platform": {"name": "cpu"},
                                     "scheduler": {"max_num_batched_tokens": 64}}, False)}
    if args.quick:
        models = {k: v for k, v in models.items() if k == "tiny_llama_h16"}
    report: dict[str, Any] = {"device": device, "dtype": "float32", "new_tokens": new,
                              "models": {}}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name(0)
    failures = 0
    for name, (build, prompts, max_len, max_seqs, blocks) in models.items():
        t0 = time.perf_counter()
        path = build(tok, tmp / name)
        log(f"{name}: checkpoint in {time.perf_counter() - t0:.1f}s; prompts of "
            f"{[len(p) for p in prompts]} tokens")
        t0 = time.perf_counter()
        ref, attn_impl = _hf_reference(path, prompts, new, device)
        entry: dict[str, Any] = {"prompt_lens": [len(p) for p in prompts],
                                 "hf_attn_implementation": attn_impl,
                                 "hf_seconds": time.perf_counter() - t0, "settings": {}}
        tokens_by_setting = {}
        for sname, (sections, graphs) in settings.items():
            cfg = {"model": {"path": str(path), "dtype": "float32", "max_model_len": max_len},
                   "kv_cache": {"num_blocks": blocks, "block_size": 16},
                   "scheduler": {"max_num_seqs": max_seqs}}
            for k, v in sections.items():
                cfg[k] = {**cfg.get(k, {}), **v}
            t0 = time.perf_counter()
            row: dict[str, Any] = {"config": cfg}
            try:
                with LLM(cfg) as llm:
                    runner = llm.engine.executor.worker.runner
                    stepper = runner.stepper
                    row["attention"] = runner.attn_entry.spec.name
                    row["stepper"] = type(stepper).__name__
                    row["captured_sizes"] = sorted(getattr(stepper, "captured", {}))
                    row["load_seconds"] = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(max_tokens=new, temperature=0.0,
                                                       ignore_eos=True), use_tqdm=False)
                    row["generate_seconds"] = time.perf_counter() - t1
                    row["graph_replays"] = getattr(stepper, "replays", None)
                    stats = llm.get_stats()
                    row["kv_blocks_whole"] = stats.kv_blocks_free == stats.kv_blocks_total
                    row["num_steps"] = stats.num_steps
                    ours = [o.outputs[0].token_ids for o in outs]
                del llm, runner, stepper       # shut down on leaving the block: memory freed
                free_device_memory()
            except Exception as exc:          # noqa: BLE001 -- recorded, the next one runs
                import traceback
                row["error"] = f"{type(exc).__name__}: {exc}"
                row["traceback"] = traceback.format_exc()[-3000:]
                log(f"{name}/{sname}: ERROR {row['error']}")
                entry["settings"][sname] = row
                failures += 1
                continue
            per = [_classify(o, r[0], r[1]) for o, r in zip(ours, ref)]
            row["per_prompt"] = per
            row["identical"] = sum(p["result"] == "identical" for p in per)
            row["near_ties"] = sum(p["result"] == "near_tie" for p in per)
            row["mismatches"] = sum(p["result"] == "mismatch" for p in per)
            if graphs and device == "cuda" and not row.get("graph_replays"):
                row["problem"] = "graphs were on but no decode step replayed one"
            row["passed"] = (row["mismatches"] == 0 and row["kv_blocks_whole"]
                             and "problem" not in row)
            failures += not row["passed"]
            tokens_by_setting[sname] = ours
            entry["settings"][sname] = row
            log(f"{name}/{sname}: {row['identical']}/{len(per)} identical, "
                f"{row['near_ties']} near ties, {row['mismatches']} mismatches; attention "
                f"{row['attention']}, replays {row['graph_replays']}, "
                f"{row['generate_seconds']:.2f}s")
        if "cuda_graphs" in tokens_by_setting and "eager" in tokens_by_setting:
            a, b = tokens_by_setting["cuda_graphs"], tokens_by_setting["eager"]
            entry["graphs_vs_eager_identical"] = sum(x == y for x, y in zip(a, b))
            entry["graphs_vs_eager_of"] = len(a)
        report["models"][name] = entry
    report["failures"] = failures
    report["passed"] = failures == 0
    write_json(args.json, report)
    print(json.dumps({m: {s: {k: r.get(k) for k in ("identical", "near_ties", "mismatches",
                                                       "graph_replays", "error")}
                          for s, r in e["settings"].items()}
                      for m, e in report["models"].items()}, indent=1))
    return 0 if failures == 0 else 1


# --------------------------------------------------------------------------- Qwen3-0.6B shape
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                 attention_bias=False)
QWEN3_TINY = dict(QWEN3_06B, vocab_size=4096, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=4096)


def cmd_make_qwen3(args: argparse.Namespace) -> int:
    """Qwen3-0.6B's config with random weights (initializer_range 0.02, norms perturbed as
    corellm.checkpoint.demo.write_random_checkpoint does), built directly in bfloat16 on the GPU
    (seconds, where the CPU in float32 takes a minute and twice the disk), and the tests'
    tokenizer
    (1024 tokens: prompts are drawn below it; generated ids above it decode to nothing)."""
    import torch
    import transformers as tf

    from corellm.checkpoint.demo import train_tokenizer
    device = args.device or default_device()
    out = Path(args.path)
    if (out / ".complete").exists():
        log(f"{out} exists")
        return 0
    t0 = time.perf_counter()
    tok = train_tokenizer(vocab_size=1024)
    sizes = QWEN3_TINY if args.tiny else QWEN3_06B
    cfg = tf.Qwen3Config(**sizes, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         pad_token_id=tok.pad_token_id)
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / ".complete").write_text(json.dumps(sizes))
    log(f"{out}: Qwen3 {'tiny' if args.tiny else '0.6B'} shape, {params / 1e6:.1f}M parameters "
        f"(tied embeddings), bfloat16, in {time.perf_counter() - t0:.1f}s")
    return 0


# --------------------------------------------------------------------------- decode-step profile
# CUDA runtime calls that make the host wait for the device.
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "cudaStreamWaitEvent_host")


def _copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    import torch
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def _checkpoint_bytes(path: Path) -> int:
    """The weights' bytes as stored (safetensors headers: what a decode step reads once)."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__")
    return total


def _profile_case(args: argparse.Namespace, device: str, temperature: float,
                  bandwidth: float) -> dict[str, Any]:
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    from corellm import LLM
    from corellm.request import EngineCoreRequest
    from corellm.sampling_params import SamplingParams
    batch, context, steps = args.batch, args.context, args.steps
    bs = 16
    platform = {"name": device}
    if args.platform:
        platform.update(json.loads(args.platform))
    max_len = context + args.warmup + 2 * steps + 64
    cfg = {"model": {"path": args.model, "dtype": args.dtype, "max_model_len": max_len},
           "platform": platform,
           "scheduler": {"max_num_seqs": batch,
                         "max_num_batched_tokens": max(args.max_num_batched_tokens, context)},
           "kv_cache": {"block_size": bs, "num_blocks": batch * (max_len // bs + 1)}}
    llm = LLM(cfg, skip_tokenizer_init=True)
    engine = llm.engine
    arch = json.loads((Path(args.model) / "config.json").read_text())
    layers = int(arch["num_hidden_layers"])
    kv_heads = int(arch.get("num_key_value_heads", arch["num_attention_heads"]))
    head_dim = int(arch.get("head_dim")
                   or arch["hidden_size"] // arch["num_attention_heads"])
    elem = 2 if args.dtype in ("bfloat16", "float16") else 4
    params = SamplingParams(max_tokens=args.warmup + 2 * steps + 32, ignore_eos=True,
                            temperature=temperature, seed=None)
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(100, 900, (context,), generator=g).tolist()
        engine.add_request(EngineCoreRequest(f"p{i}", ids, params, eos_token_id=None,
                                             arrival_time=0.0))
    decoding: set[str] = set()
    prefill_steps = 0
    while len(decoding) < batch:           # every request prefilled, each has a first token
        for o in engine.step():
            if o.new_token_ids:
                decoding.add(o.request_id)
        prefill_steps += 1
        if prefill_steps > 10 * batch + 100:
            raise RuntimeError("the batch never reached its decode steps")
    for _ in range(args.warmup):
        engine.step()
    cuda = device == "cuda"
    host_ms, device_ms, tokens = [], [], 0
    t_phase = dict(engine.timings)
    for _ in range(steps):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = engine.step()
        if cuda:
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        host_ms.append((time.perf_counter() - t0) * 1e3)
        tokens += sum(len(o.new_token_ids) for o in out)
    phases = {k: (engine.timings[k] - t_phase.get(k, 0.0)) / steps * 1e3
              for k in ("schedule", "execute", "update") if k in engine.timings}
    # The profiled steps: kernels and host syncs per step (one step at a time is enough
    # for counts; the time figures above are unprofiled).
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof_steps = min(steps, args.profile_steps)
    with profile(activities=activities) as prof:
        for _ in range(prof_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    kernels = syncs = 0
    kernel_us = 0.0
    names: dict[str, int] = {}
    for evt in prof.events():
        if cuda and evt.device_type == torch.autograd.DeviceType.CUDA:
            if not evt.name.startswith(("Memcpy", "Memset", "[memory]")):
                kernels += 1
                kernel_us += evt.device_time
                names[evt.name] = names.get(evt.name, 0) + 1
        elif evt.name in _SYNC_CALLS or evt.name.startswith("cudaMemcpy") and "Async" not in \
                evt.name:
            syncs += 1
    mean_context = context + args.warmup + steps // 2 + 1
    kv_bytes = 2 * layers * kv_heads * head_dim * elem * mean_context * batch
    weight_bytes = _checkpoint_bytes(Path(args.model))
    floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1e3
    step_ms = statistics.median(device_ms) if device_ms else statistics.median(host_ms)
    engine.abort_requests([f"p{i}" for i in range(batch)])
    llm.shutdown()
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    return {
        "temperature": temperature, "batch": batch, "mean_context": mean_context,
        "step_ms_device": statistics.median(device_ms) if device_ms else None,
        "step_ms_host": statistics.median(host_ms), "phase_ms": phases,
        "tok_s": tokens / (sum(host_ms) / 1e3),
        "floor_ms": floor_ms, "vs_floor": step_ms / floor_ms,
        "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
        "kernels_per_step": kernels / prof_steps if cuda else None,
        "kernels_per_layer": kernels / prof_steps / layers if cuda else None,
        "kernel_ms_per_step": kernel_us / prof_steps / 1e3 if cuda else None,
        "host_syncs_per_step": syncs / prof_steps, "top_kernels": top,
    }


def cmd_profile(args: argparse.Namespace) -> int:
    """A decode step at ``--batch`` sequences of ``--context`` tokens, measured: the table
    and ``--json``. On a CPU (the dry run) the device columns are empty and the floor is the
    host's copy bandwidth."""
    import torch
    device = args.device or default_device()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = _copy_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s ({device})")
    rows = []
    for t in args.temperature:
        log(f"profile: batch {args.batch}, context {args.context}, temperature {t}")
        rows.append(_profile_case(args, device, t, bandwidth))
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print("| temperature | batch | context | step ms (device) | step ms (host) | floor ms | "
          "vs floor | kernels/step | kernels/layer | syncs/step | tok/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['temperature']} | {r['batch']} | {r['mean_context']} | "
              f"{fmt(r['step_ms_device'], '.2f')} | {r['step_ms_host']:.2f} | "
              f"{r['floor_ms']:.2f} | {r['vs_floor']:.2f}x | "
              f"{fmt(r['kernels_per_step'], '.0f')} | {fmt(r['kernels_per_layer'], '.1f')} | "
              f"{r['host_syncs_per_step']:.1f} | {r['tok_s']:.0f} |")
    write_json(args.json, {"device": device, "copy_bandwidth_Bps": bandwidth,
                           "model": args.model, "dtype": args.dtype, "rows": rows})
    return 0


# --------------------------------------------------------------------------- transformers peer
def cmd_hf_throughput(args: argparse.Namespace) -> int:
    """transformers ``generate`` on the workload benchmarks/throughput.py draws for the same
    arguments (random_token_requests with the same seed and id space): static batches of
    ``--batch-size``, left-padded, greedy, every row run to its batch's longest output
    (min_new_tokens, as ignore_eos); output tok/s counts each request's own output length."""
    import torch
    from transformers import AutoModelForCausalLM

    from _common import left_padded, prompt_id_space, random_token_requests
    device = args.device or default_device()
    model_dir = Path(args.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    id_space, special = prompt_id_space(model_dir, cfg["vocab_size"])
    requests = random_token_requests(args.num_requests, args.input_len, args.output_len,
                                     args.seed, id_space, special)
    warmup = random_token_requests(4, (32, 32), (16, 16), seed=args.seed + 1,
                                   vocab_size=id_space, exclude_ids=special)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0
    pad = cfg.get("pad_token_id") or 0

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def generate(batch: list[dict]) -> tuple[int, int]:
        ids, mask, longest = left_padded(batch, pad)
        new = max(r["output_len"] for r in batch)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=pad, num_beams=1, use_cache=True)
        assert out.shape[1] == longest + new, (out.shape, longest, new)
        return sum(r["output_len"] for r in batch), len(batch) * new

    generate(warmup)
    sync()
    batches = [requests[i:i + args.batch_size]
               for i in range(0, len(requests), args.batch_size)]
    useful = generated = 0
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        tb = time.perf_counter()
        u, g = generate(batch)
        sync()
        useful += u
        generated += g
        log(f"transformers: batch {b + 1}/{len(batches)} ({len(batch)} requests, {g} tokens "
            f"generated, {u} useful) in {time.perf_counter() - tb:.1f}s")
    wall = time.perf_counter() - t0
    result = {
        "engine": "transformers", "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "transformers_attn": getattr(hf.config, "_attn_implementation", "?"),
        "dtype": args.dtype, "model": str(model_dir), "requests": len(requests),
        "batch_size": args.batch_size, "prompt_tokens": sum(len(r["prompt_token_ids"])
                                                            for r in requests),
        "output_tokens": useful, "generated_tokens_incl_padding": generated,
        "wall_s": wall, "output_tok_s": useful / wall, "load_s": load_s,
        "peak_gib": (torch.cuda.max_memory_allocated() / 2**30) if device == "cuda" else None,
        "workload": {"num_requests": args.num_requests,
                     "input_len": f"{args.input_len[0]}:{args.input_len[1]}",
                     "output_len": f"{args.output_len[0]}:{args.output_len[1]}",
                     "seed": args.seed},
    }
    log(f"transformers: {useful} output tokens in {wall:.1f}s = {useful / wall:.1f} tok/s")
    write_json(args.json, result)
    return 0


# --------------------------------------------------------------------------- corellm, amended
def cmd_tp_corellm(args: argparse.Namespace, rest: list[str]) -> int:
    """benchmarks/throughput.py as is, but every engine it builds gets ``--platform`` merged
    into its config's platform section (throughput.py has no option for it)."""
    import corellm
    extra = json.loads(args.platform)
    original = corellm.LLM

    class AmendedLLM(original):                       # throughput.py imports corellm.LLM late
        def __init__(self, config=None, *a, **kw):
            if isinstance(config, dict):
                config = {**config, "platform": {**config.get("platform", {}), **extra}}
                log(f"platform section: {config['platform']}")
            super().__init__(config, *a, **kw)
    corellm.LLM = AmendedLLM
    import throughput
    return throughput.main(rest)


# --------------------------------------------------------------------------- summary
def _junit_counts(path: Path, gpu_tests: set[str]) -> dict[str, Any]:
    import xml.etree.ElementTree as ET
    out: dict[str, Any] = {}
    if not path.exists():
        return {"missing": str(path)}
    root = ET.parse(path).getroot()
    rows = []
    for case in root.iter("testcase"):
        name = case.get("name")
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                state = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                if tag != "skipped":
                    out.setdefault("failures", []).append(
                        {"test": name, "message": (el.get("message") or "")[:600]})
        rows.append((name, state))
    for label, subset in (("all", rows), ("gpu", [r for r in rows if r[0] in gpu_tests])):
        counts: dict[str, int] = {}
        for _, state in subset:
            counts[state] = counts.get(state, 0) + 1
        out[label] = counts
    out["gpu_tests"] = {n: s for n, s in rows if n in gpu_tests}
    return out


def cmd_summarize(args: argparse.Namespace) -> int:
    out = Path(args.out)
    summary: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}

    def load(name: str) -> Any:
        f = out / name
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError) as exc:
            return {"missing": f"{name}: {exc}"}
    if args.steps and Path(args.steps).exists():
        summary["steps"] = [line.split("\t") for line in
                            Path(args.steps).read_text().splitlines() if line]
    env = load("env.json")
    summary["env"] = {k: env.get(k) for k in ("device", "capability", "total_gib", "torch",
                                              "torch_cuda", "triton", "transformers",
                                              "nvidia_smi", "auto_platform", "missing")}
    gpu_tests = set(Path(args.gpu_tests).read_text().split()) if args.gpu_tests and \
        Path(args.gpu_tests).exists() else set()
    summary["pytest_platform_cuda"] = _junit_counts(out / "pytest_cuda.xml", gpu_tests)
    parity = load("parity.json")
    summary["parity"] = {"passed": parity.get("passed"), "missing": parity.get("missing"),
                         "models": {m: {"graphs_vs_eager_identical":
                                        e.get("graphs_vs_eager_identical"),
                                        **{s: {k: r.get(k) for k in (
                                            "identical", "near_ties", "mismatches",
                                            "graph_replays", "attention", "error", "passed")}
                                           for s, r in e.get("settings", {}).items()}}
                                    for m, e in parity.get("models", {}).items()}}
    runs = []
    for f in sorted(out.glob("tp_corellm*.json")):
        tp = load(f.name)
        for r in tp.get("engines", []):
            runs.append({"file": f.name, "workload": tp.get("workload"),
                         **{k: r.get(k) for k in ("engine", "output_tokens", "wall_s",
                                                  "output_tok_s", "load_s", "num_steps",
                                                  "mean_step_ms", "num_preemptions",
                                                  "time_split")}})
    summary["throughput_corellm"] = runs
    hf = load("tp_hf.json")
    summary["throughput_transformers"] = {k: hf.get(k) for k in (
        "output_tokens", "generated_tokens_incl_padding", "wall_s", "output_tok_s",
        "batch_size", "transformers_attn", "peak_gib", "workload", "missing")}
    summary["profile"] = {}
    for f in sorted(out.glob("profile*.json")):
        prof = load(f.name)
        summary["profile"][f.name] = [{k: v for k, v in r.items() if k != "top_kernels"}
                                      for r in prof.get("rows", [])] or prof
    write_json(str(out / "summary.json"), summary)

    lines = [f"== corellm CUDA bring-up, {summary['date_utc']} UTC, "
             f"{summary['env'].get('device')} (torch {summary['env'].get('torch')}, "
             f"triton {summary['env'].get('triton')})"]
    for row in summary.get("steps", []):
        lines.append("  step " + "  ".join(row))
    pc = summary["pytest_platform_cuda"]
    lines.append(f"pytest tests/test_platform_cuda.py: {pc.get('all')}  gpu-marked: "
                 f"{pc.get('gpu')}")
    for f in pc.get("failures", []):
        lines.append(f"  FAILED {f['test']}: {f['message'][:300]}")
    lines.append(f"parity (fp32, vs transformers on the same device): passed="
                 f"{summary['parity']['passed']}")
    for m, e in summary["parity"]["models"].items():
        for s, r in e.items():
            lines.append(f"  {m:16} {s:24} {r}")
    for r in runs:
        w = r["workload"] or {}
        lines.append(f"corellm throughput ({r['file']}: {w.get('num_requests')} requests, in "
                     f"{w.get('input_len')}, out {w.get('output_len')}): "
                     f"{r['output_tokens']} tokens in "
                     f"{(r['wall_s'] or 0):.2f}s = {(r['output_tok_s'] or 0):.0f} tok/s "
                     f"(steps {r['num_steps']}, mean step {(r['mean_step_ms'] or 0):.2f} ms)")
    for name, rows in summary["profile"].items():
        for r in rows if isinstance(rows, list) else []:
            lines.append(f"decode step ({name}, T={r['temperature']}, batch {r['batch']}, "
                         f"context {r['mean_context']}): {r['step_ms_device']} ms device, "
                         f"{r['step_ms_host']:.2f} ms host, floor {r['floor_ms']:.2f} ms "
                         f"({r['vs_floor']:.2f}x), kernels/layer {r['kernels_per_layer']}, "
                         f"syncs/step {r['host_syncs_per_step']}")
    if hf.get("output_tok_s"):
        lines.append(f"transformers generate: {hf['output_tokens']} tokens in "
                     f"{hf['wall_s']:.2f}s = {hf['output_tok_s']:.0f} tok/s (batch "
                     f"{hf['batch_size']}, {hf['transformers_attn']})")
        same = [r for r in runs if r["file"] == "tp_corellm.json" and r.get("output_tok_s")]
        if same:
            lines.append(f"corellm / transformers (same workload): "
                         f"{same[0]['output_tok_s'] / hf['output_tok_s']:.2f}x")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- install fallback
def cmd_register_source(args: argparse.Namespace) -> int:
    """What an editable install leaves, made by hand (no build backend needed): a folder of
    links named as the packages (``corellm`` and ``corellm_plugins``, which is ``plugins/``)
    on sys.path through a .pth file, and a dist-info whose entry points are pyproject.toml's,
    so that plugin discovery (the ``corellm`` entry-point group) finds the built-ins."""
    import sysconfig
    import tomllib
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    purelib = Path(args.site or sysconfig.get_paths()["purelib"])
    links = Path(args.links)
    links.mkdir(parents=True, exist_ok=True)
    for name, src in (("corellm", ROOT / "corellm"), ("corellm_plugins", ROOT / "plugins")):
        link = links / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(src, target_is_directory=True)
    (purelib / "corellm-source.pth").write_text(f"{links}\n")
    dist = purelib / f"corellm-{meta['version']}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: corellm\n"
                                   f"Version: {meta['version']}\n")
    eps = "[corellm]\n" + "".join(f"{k} = {v}\n" for k, v in
                                    meta["entry-points"]["corellm"].items())
    eps += "\n[console_scripts]\n" + "".join(f"{k} = {v}\n"
                                             for k, v in meta.get("scripts", {}).items())
    (dist / "entry_points.txt").write_text(eps)
    (dist / "INSTALLER").write_text("gpu_bringup\n")
    (dist / "RECORD").write_text("")
    log(f"registered {ROOT} through {links} and {dist}")
    return 0


# --------------------------------------------------------------------------- driver
def _range(text: str) -> tuple[int, int]:
    from corellm_plugins.bench.workload_cli import parse_range
    return parse_range(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--json")
    q = sub.add_parser("parity")
    q.add_argument("--json")
    q.add_argument("--device", choices=["cuda", "cpu"])
    q.add_argument("--new-tokens", type=int, default=32)
    q.add_argument("--quick", action="store_true", help="the tests' tiny Llama only")
    m = sub.add_parser("make-qwen3")
    m.add_argument("path")
    m.add_argument("--device", choices=["cuda", "cpu"])
    m.add_argument("--tiny", action="store_true", help="a tiny Qwen3 (the dry run)")
    h = sub.add_parser("hf-throughput")
    h.add_argument("--model", required=True)
    h.add_argument("--device", choices=["cuda", "cpu"])
    h.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    h.add_argument("--num-requests", type=int, default=128)
    h.add_argument("--input-len", type=_range, default=(100, 1024))
    h.add_argument("--output-len", type=_range, default=(100, 1024))
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--batch-size", type=int, default=128)
    h.add_argument("--json")
    f = sub.add_parser("profile")
    f.add_argument("--model", required=True)
    f.add_argument("--device", choices=["cuda", "cpu"])
    f.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    f.add_argument("--batch", type=int, default=256)
    f.add_argument("--context", type=int, default=768,
                   help="prompt tokens of every sequence (nano-vllm's workload: 100..1024 in, "
                        "100..1024 out, so ~830 on average while decoding)")
    f.add_argument("--steps", type=int, default=30, help="timed decode steps")
    f.add_argument("--warmup", type=int, default=5)
    f.add_argument("--profile-steps", type=int, default=3)
    f.add_argument("--temperature", type=lambda t: [float(x) for x in t.split(",")],
                   default=[0.0, 0.6])
    f.add_argument("--max-num-batched-tokens", type=int, default=16384)
    f.add_argument("--platform", help="JSON merged into the platform section")
    f.add_argument("--json")
    s = sub.add_parser("summarize")
    s.add_argument("out")
    s.add_argument("--steps")
    s.add_argument("--gpu-tests")
    r = sub.add_parser("register-source")
    r.add_argument("--site", help="default: this interpreter's purelib")
    r.add_argument("--links", default="/tmp/corellm-source")
    t = sub.add_parser("tp-corellm", help="then --, then benchmarks/throughput.py's arguments")
    t.add_argument("--platform", default="{}", help="JSON merged into the platform section")
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    args = p.parse_args(argv)
    if args.cmd == "tp-corellm":
        return cmd_tp_corellm(args, rest)
    return {"register-source": cmd_register_source, "env": cmd_env, "parity": cmd_parity,
            "make-qwen3": cmd_make_qwen3, "hf-throughput": cmd_hf_throughput,
            "profile": cmd_profile,
            "summarize": cmd_summarize}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
