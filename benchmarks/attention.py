"""Decode attention of each attention backend against the memory-bandwidth floor (and, with
``--phase prefill``, prefill attention against each other).

One decode step of one layer: B requests, each with a context of L tokens in a paged KV cache
(scattered blocks), one new token each. Each backend's ``forward`` (write the new K/V, attend)
is timed on the same inputs, built through its own metadata builder as the engine builds them,
and its output is checked against the first backend's. The floor is the time to read the K/V
the step must read once (B x L x Hkv x D x 2 values) at the device's bandwidth, measured here
with a large device-to-device copy; ``of floor`` is floor / measured time (1.0: at the floor).

    python3 benchmarks/attention.py                                    # CUDA: torch_sdpa vs triton
    python3 benchmarks/attention.py --batch 1,16,64 --context 512,2048 --json a.json --plot a.png
    python3 benchmarks/attention.py --backends torch_sdpa              # the CPU
    python3 benchmarks/attention.py --backends "torch_sdpa:decode=gather,torch_sdpa"  # CPU paths
    TRITON_INTERPRET=1 python3 benchmarks/attention.py --backends torch_sdpa,triton \\
        --batch 2 --context 64 --iters 1                            # the script, checked on a CPU

``--phase prefill``: one step of one layer in which B prompts of L tokens each are prefilled
(no cached context), timed per backend and reported in GFLOP/s of causal attention (the scores
and the weighted sum over the keys each query sees: 4 x heads x head size x L(L+1)/2 per
prompt), e.g. the CPU's SDPA path against its native kernel:

    python3 benchmarks/attention.py --phase prefill \
        --backends "torch_sdpa:prefill=sdpa,torch_sdpa" --batch 8 --context 64,160,256 \
        --heads 12 --kv-heads 4 --head-size 64 --block-size 128

The default shape is Qwen3-0.6B's attention (16 query heads, 8 KV heads, head size 128), bf16
on CUDA and fp32 on the CPU. Under the interpreter, times are of numpy, not of the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, logger, parse_int_list, pyplot, report  # noqa: E402

_log = logger("attention")
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    import torch
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def decode_step(backend, layer, batch: int, context: int, block_size: int, dtype, device,
                seed: int):
    """(query, key, value, kv_cache, metadata) of one decode step through ``backend``'s builder,
    the cache's context filled with random K/V in scattered blocks."""
    import numpy as np
    import torch

    from corellm.attention import AttentionBuildLimits, CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    seq = context + 1
    per_req = -(-seq // block_size)
    num_blocks = batch * per_req + 1
    spec = backend.kv_cache_spec(layer, num_blocks, block_size, dtype)
    cache = torch.randn(spec.shape, generator=gen).to(dtype=spec.dtype, device=device)
    table = torch.randperm(num_blocks, generator=gen)[:batch * per_req].view(batch, per_req)
    table = table.numpy().astype(np.int64)
    slots = table[:, context // block_size] * block_size + context % block_size
    common = CommonAttentionMetadata(
        num_reqs=batch, num_decodes=batch, num_actual_tokens=batch,
        query_start_loc=np.arange(batch + 1, dtype=np.int64),
        seq_lens=np.full(batch, seq, dtype=np.int64),
        context_lens=np.full(batch, context, dtype=np.int64), block_table=table,
        slot_mapping=slots.astype(np.int64), max_seq_len=seq, max_query_len=1,
        block_size=block_size)
    builder = backend.make_metadata_builder(AttentionBuildLimits(
        block_size=block_size, max_num_seqs=batch, max_num_batched_tokens=batch,
        max_model_len=seq, device=device))
    md = builder.build(common)
    q, k, v = (torch.randn(batch, h, layer.head_size, generator=gen).to(dtype=dtype,
                                                                        device=device)
               for h in (layer.num_heads, layer.num_kv_heads, layer.num_kv_heads))
    return q, k, v, cache, md


def prefill_step(backend, layer, batch: int, length: int, block_size: int, dtype, device,
                 seed: int):
    """(query, key, value, kv_cache, metadata) of one step prefilling ``batch`` prompts of
    ``length`` tokens each (no cached context) through ``backend``'s builder."""
    import numpy as np
    import torch

    from corellm.attention import AttentionBuildLimits, CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    per_req = -(-length // block_size)
    num_blocks = batch * per_req + 1
    spec = backend.kv_cache_spec(layer, num_blocks, block_size, dtype)
    cache = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    table = torch.randperm(num_blocks, generator=gen)[:batch * per_req].view(batch, per_req)
    table = table.numpy().astype(np.int64)
    pos = np.arange(length)
    slots = (table[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    t = batch * length
    common = CommonAttentionMetadata(
        num_reqs=batch, num_decodes=0, num_actual_tokens=t,
        query_start_loc=np.arange(0, t + 1, length, dtype=np.int64),
        seq_lens=np.full(batch, length, dtype=np.int64),
        context_lens=np.zeros(batch, dtype=np.int64), block_table=table,
        slot_mapping=slots.astype(np.int64), max_seq_len=length, max_query_len=length,
        block_size=block_size)
    builder = backend.make_metadata_builder(AttentionBuildLimits(
        block_size=block_size, max_num_seqs=batch, max_num_batched_tokens=t,
        max_model_len=length, device=device))
    md = builder.build(common)
    q, k, v = (torch.randn(t, h, layer.head_size, generator=gen).to(dtype=dtype, device=device)
               for h in (layer.num_heads, layer.num_kv_heads, layer.num_kv_heads))
    return q, k, v, cache, md


def make_backend(label: str, registry, device, dtype):
    """``name`` or ``name:key=value,...`` (the backend's options, e.g.
    ``torch_sdpa:decode=gather``)."""
    from corellm.components import BuildContext
    from corellm.config import load_config

    name, _, opts = label.partition(":")
    options = dict(kv.split("=", 1) for kv in opts.split(";") if kv)
    entry = registry.get("attention", name)
    reason = entry.spec.check_device(device)
    if reason:
        raise SystemExit(f"attention backend {name!r} cannot run on {device}: {reason}")
    ctx = BuildContext(config=load_config({}), registry=registry, device=device, dtype=dtype)
    return entry.spec.factory(entry.spec.options(name=name, **options), ctx)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from corellm.interfaces import AttentionLayerSpec
    from corellm.plugins import load_registry

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    layer = AttentionLayerSpec(0, args.heads, args.kv_heads, args.head_size,
                               scale=args.head_size ** -0.5)
    registry = load_registry()
    backends = {}
    for name in args.backends.split(","):
        backend = make_backend(name, registry, device, dtype)
        problem = backend.supports(layer, dtype, device)
        if problem:
            raise SystemExit(f"attention backend {name!r}: {problem}")
        backends[name] = backend
    bandwidth = measure_bandwidth(device, args.bandwidth_mib << 20)
    elem = torch.empty((), dtype=dtype).element_size()
    env = environment()
    _log(f"{device} ({env.get('gpus', [env['cpu_model']])[0]}), {dtype_name}; copy bandwidth "
         f"{bandwidth / 1e9:.1f} GB/s; heads {args.heads}/{args.kv_heads}, head size "
         f"{args.head_size}, block size {args.block_size}")
    rows = []
    prefill = args.phase == "prefill"
    step = prefill_step if prefill else decode_step
    for batch in args.batch:
        for context in args.context:
            kv_bytes = batch * (context + 1) * args.kv_heads * args.head_size * 2 * elem
            floor = kv_bytes / bandwidth
            flop = batch * 4 * args.heads * args.head_size * context * (context + 1) / 2
            reference = None
            for name, backend in backends.items():
                q, k, v, cache, md = step(backend, layer, batch, context, args.block_size,
                                          dtype, device, args.seed)
                with torch.inference_mode():
                    out = backend.forward(layer, q, k, v, cache, md)       # warm-up, compile
                    _sync(device)
                    times = []
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        backend.forward(layer, q, k, v, cache, md)
                        _sync(device)
                        times.append(time.perf_counter() - t0)
                diff = None
                if reference is None:
                    reference = out.float().cpu()
                else:
                    diff = float((out.float().cpu() - reference).abs().max())
                t = statistics.median(times)
                row = {"backend": name, "batch": batch, "context": context,
                       "median_us": t * 1e6, "max_abs_diff_vs_first": diff}
                if prefill:
                    row["gflops"] = flop / t / 1e9
                    _log(f"B={batch} L={context} {name}: {t * 1e6:.1f} us "
                         f"({row['gflops']:.1f} GFLOP/s)")
                else:
                    row.update(kv_mib=kv_bytes / 2**20, floor_us=floor * 1e6,
                               of_floor=floor / t)
                    _log(f"B={batch} L={context} {name}: {t * 1e6:.1f} us "
                         f"({floor / t:.2f} of the floor)")
                rows.append(row)
    return {"environment": env, "device": str(device), "dtype": dtype_name, "phase": args.phase,
            "bandwidth_gb_s": bandwidth / 1e9,
            "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                      "head_size": args.head_size, "block_size": args.block_size},
            "rows": rows}


def format_tables(results: dict[str, Any]) -> str:
    env = results["environment"]
    where = env.get("gpus", [env["cpu_model"]])[0]
    prefill = results.get("phase") == "prefill"
    if prefill:
        lines = [f"# prefill attention, one layer: {where}, {results['dtype']}, "
                 f"{env['date'][:10]}", "",
                 "| backend | prompts | tokens each | time | GFLOP/s | vs first |",
                 "| --- | ---: | ---: | ---: | ---: | ---: |"]
    else:
        lines = [f"# decode attention, one layer: {where}, {results['dtype']}, copy bandwidth "
                 f"{results['bandwidth_gb_s']:.1f} GB/s, {env['date'][:10]}",
                 "", "| backend | B | context | K/V read | time | floor | of floor | vs first |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    first: dict[tuple, float] = {}
    for r in results["rows"]:
        key = (r["batch"], r["context"])
        first.setdefault(key, r["median_us"])
        diff = r["max_abs_diff_vs_first"]
        cells = ([f"{r['median_us']:.1f} us", f"{r['gflops']:.1f}"] if prefill else
                 [f"{r['kv_mib']:.1f} MiB", f"{r['median_us']:.1f} us", f"{r['floor_us']:.1f} us",
                  f"{r['of_floor']:.2f}"])
        lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | " + " | ".join(cells)
                     + f" | {first[key] / r['median_us']:.2f}x"
                     + (f" (max diff {diff:.1e})" if diff is not None else "") + " |")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, _log)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    prefill = results.get("phase") == "prefill"
    for name in dict.fromkeys(r["backend"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["backend"] == name]
        ax.plot(range(len(rows)), [r["gflops" if prefill else "of_floor"] for r in rows],
                marker="o", label=name)
        ax.set_xticks(range(len(rows)), [f"B={r['batch']}\nL={r['context']}" for r in rows],
                      fontsize=7)
    if prefill:
        ax.set_ylabel("GFLOP/s (causal attention)")
    else:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_ylabel("fraction of the bandwidth floor (1 = floor)")
    env = results["environment"]
    ax.set_title(f"{'prefill' if prefill else 'decode'} attention: "
                 f"{env.get('gpus', [env['cpu_model']])[0]}, {results['dtype']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch_sdpa,triton",
                   help="comma-separated attention backends, each NAME or NAME:KEY=VALUE[;...] "
                        "with its options (torch_sdpa:decode=gather); the first is the "
                        "reference")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="decode: B requests with L tokens of context, one new token each; "
                        "prefill: B prompts of L tokens each")
    p.add_argument("--batch", type=parse_int_list, default=[1, 8, 32, 128])
    p.add_argument("--context", type=parse_int_list, default=[512, 2048, 8192])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=1024,
                   help="size of the copy that measures the bandwidth")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG plot here")
    args = p.parse_args(argv)
    report(run(args), args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
