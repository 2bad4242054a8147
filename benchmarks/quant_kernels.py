#!/usr/bin/env python
"""The CPU platform's quantized GEMM kernels, layout against layout, on this machine.

For each GGUF format (``--formats``), weight shape (``--shapes``, N x K: rows x columns) and
activation row count (``--rows``: 1 is a decode step's GEMV, 48 and 200 a batch and a prefill),
the GFLOP/s of ``plugins/platform_cpu/quant_gemm.c`` on the same random blocks in two layouts:

* ``interleaved``: the weight's rows interleaved by 8 (``corellm.quant``), 8 output columns per
  vector, what the platform runs;
* ``rows``: one weight row at a time (the 32-value formats in the ``grouped`` layout, the
  k-quants in the file's), what it runs for the rows after a weight's last whole group of 8.

The two run alternately, ``--rounds`` rounds of about ``--seconds`` each, on the platform's
thread pool (``platform.threads`` as the engine sizes it: the process's CPUs); the table gives
each layout's median GFLOP/s and the median of the paired ratios. The outputs of the two are
compared too (they differ in the last bits: the two sum a block's products in different
orders). The default shapes are the default model's (SmolLM2-135M: 960x576 QKV, 3072x576
gate|up, 576x1536 down) and a ~1B Llama's (2048x2048, 11264x2048 gate|up).

    python benchmarks/quant_kernels.py
    python benchmarks/quant_kernels.py --formats Q4_K --shapes 2048x2048 --rows 1,64 --json o.json
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

_log = logger("quant_kernels")
SHAPES = "960x576,3072x576,576x1536,2048x2048,11264x2048"
# the fp16 fields of each format's block (scale, and offset / dmin): set to small scales
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, seed: int):
    """A [rows, cols] tensor of random blocks of ``qtype``, its fp16 scales in [1e-3, 1e-2]."""
    import torch

    from corellm.quant import GGUF_FORMATS, QuantizedTensor
    fmt = GGUF_FORMATS[qtype]
    g = torch.Generator().manual_seed(seed)
    nb = cols // fmt.block
    data = torch.randint(0, 256, (rows, nb, fmt.type_size), generator=g, dtype=torch.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = (torch.rand(rows, nb, generator=g) * 9e-3 + 1e-3).half()
        data[..., off:off + 2] = scale.view(torch.uint8).view(rows, nb, 2)
    return QuantizedTensor(data.reshape(rows, -1).contiguous(), qtype, cols)


def _timer(kernels, t, interleaved: bool, x):
    """A call of the kernel on ``t`` (in the layout ``interleaved`` says) and its output."""
    import torch

    from corellm.quant import GROUPABLE
    from corellm_plugins.platform_cpu.qlinear import FORMAT_IDS, INTERLEAVED
    t = t.interleaved() if interleaved else (t.grouped() if t.qtype in GROUPABLE else t)
    m, k = x.shape
    n = t.shape[0]
    y = torch.empty(m, n)
    fmt = FORMAT_IDS[t.qtype] | (INTERLEAVED if interleaved else 0)
    args = (fmt, t.data.data_ptr(), n, k, x.data_ptr(), k, m, y.data_ptr(), n, None, None, 0)

    def call() -> None:
        if kernels._q(*args) != 0:
            raise SystemExit(f"the kernel refused {t.qtype} {n}x{k}")
    return call, y, t


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from corellm.quant import GGUF_FORMATS
    from corellm_plugins.platform_cpu.native import thread_pool
    from corellm_plugins.platform_cpu.qlinear import quant_kernels
    kernels = quant_kernels()
    if kernels is None:
        raise SystemExit("the quantized CPU kernels did not build (no C compiler?)")
    thread_pool()
    results: dict[str, Any] = {"environment": environment(), "config": vars(args), "cases": []}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cases = [(q, n, k, m) for q in args.formats.split(",") for n, k in shapes
             for m in parse_int_list(args.rows) if k % GGUF_FORMATS[q].block == 0]
    for i, (qtype, n, k, m) in enumerate(cases, 1):
        t = random_blocks(qtype, n, k, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(i))
        calls = {name: _timer(kernels, t, name == "interleaved", x)
                 for name in ("interleaved", "rows")}
        for call, _, _ in calls.values():
            call()                                                   # warm-up
        start = time.perf_counter()
        calls["rows"][0]()
        reps = max(1, int(args.seconds / max(time.perf_counter() - start, 1e-6)))
        gflops: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, (call, _, _) in calls.items():
                start = time.perf_counter()
                for _ in range(reps):
                    call()
                gflops[name].append(2 * n * k * m * reps / (time.perf_counter() - start) / 1e9)
        ratios = [a / b for a, b in zip(gflops["interleaved"], gflops["rows"])]
        y_new, y_old = calls["interleaved"][1], calls["rows"][1]
        rel = float((y_new - y_old).abs().max() / y_old.abs().max().clamp(min=1e-30))
        case = {"format": qtype, "n": n, "k": k, "rows": m,
                "gflops": {name: statistics.median(v) for name, v in gflops.items()},
                "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                "max_rel_diff": rel}
        results["cases"].append(case)
        _log(f"{i}/{len(cases)} {qtype} {n}x{k}, {m} rows: interleaved "
             f"{case['gflops']['interleaved']:.0f}, rows {case['gflops']['rows']:.0f} GFLOP/s "
             f"({case['ratio']:.2f}x)")
    return results


def format_tables(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [f"quantized GEMM kernels, interleaved rows vs one row at a time; CPU: "
             f"{env['cpu_model']}; {env['date']}",
             f"{'format':7}{'N x K':>13}{'rows':>6}{'interleaved GF/s':>18}{'rows GF/s':>11}"
             f"{'ratio (paired)':>16}{'max rel diff':>14}"]
    for c in results["cases"]:
        lines.append(f"{c['format']:7}{c['n']:>7} x {c['k']:<4}{c['rows']:>5}"
                     f"{c['gflops']['interleaved']:>18.1f}{c['gflops']['rows']:>11.1f}"
                     f"{c['ratio']:>15.2f}x{c['max_rel_diff']:>14.1e}")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, _log)
    if plt is None:
        return False
    cases = results["cases"]
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(cases)), 3.5))
    labels = [f"{c['format']} {c['n']}x{c['k']} M{c['rows']}" for c in cases]
    ax.bar(labels, [c["ratio"] for c in cases], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("interleaved / rows GFLOP/s")
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    env = results["environment"]
    ax.set_title(f"quantized GEMM layouts: {env['cpu_model']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="Q4_1,Q8_0,Q4_K,Q6_K")
    p.add_argument("--shapes", default=SHAPES, help="N x K weight shapes, comma-separated")
    p.add_argument("--rows", default="1,48,200", help="activation rows, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.2, help="per layout and round")
    p.add_argument("--json")
    p.add_argument("--plot")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    report(run(args), args, format_tables, write_plot, _log)


if __name__ == "__main__":
    main()
