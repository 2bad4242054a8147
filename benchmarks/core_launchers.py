"""What running the engine core as a Ray actor costs against a process of this machine: the
``ray`` core launcher (ZeroMQ over TCP with CURVE, an actor among Ray's daemons) against the
``mp`` one (IPC sockets, a spawned process), one ``AsyncLLM`` engine each, both up at once and
measured alternately, on the same model and CPUs.

    python benchmarks/core_launchers.py --tiny /tmp/tiny-model --json out.json --plot out.png
    python benchmarks/core_launchers.py --tiny /tmp/tiny-model --busy 1    # beside a busy process
    python benchmarks/core_launchers.py --model PATH --requests 200

Three measures, each alternating between the two engines: the round trip of a one-token request
on an idle engine (submission to its last output: the channel both ways plus one step), the time
per output token of a lone long request (one output batch crosses the channel per step), and a
burst of requests submitted at once (their TTFT, and the burst's wall time). Runs itself in a
loopback-only network namespace (``unshare -n``; ``--no-netns`` where one cannot be made).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (cpu_model, environment, in_netns, logger, report,  # noqa: E402
                     spinning_neighbours)
from tp_executors import tiny_model  # noqa: E402

_log = logger("launchers")
LAUNCHERS = ("mp", "ray")


async def _collect(stream) -> list[float]:
    """Arrival times of the stream's outputs."""
    times = []
    async for _ in stream:
        times.append(time.perf_counter())
    return times


async def _measure(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from corellm.engine.async_llm import AsyncLLM
    from corellm.sampling_params import SamplingParams
    base = {"model": {"path": str(model), "dtype": "float32"},
            "kv_cache": {"num_blocks": args.num_blocks}}
    engines = {}
    for name in LAUNCHERS:
        t0 = time.perf_counter()
        launcher = {"name": name} if name == "mp" else {"name": name, "pin_cpus": False}
        engines[name] = await AsyncLLM.create({**base, "core_launcher": launcher})
        _log(f"{name}: engine up in {time.perf_counter() - t0:.1f} s ({engines[name].where})")
    out: dict[str, Any] = {n: {"round_trip_ms": [], "per_token_ms": [], "burst_ttft_ms": [],
                               "burst_s": []} for n in LAUNCHERS}
    prompt = {"prompt_token_ids": [11 + i for i in range(args.input_len)]}
    one = SamplingParams(max_tokens=1, temperature=0)
    long = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    burst = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    try:
        for i in range(args.requests):
            for name in LAUNCHERS:
                t0 = time.perf_counter()
                times = await _collect(await engines[name].add_request(prompt, one, f"r{i}"))
                out[name]["round_trip_ms"].append(1e3 * (times[-1] - t0))
        _log(f"round trips: {args.requests} each")
        for i in range(args.rounds):
            for name in LAUNCHERS:
                times = await _collect(await engines[name].add_request(prompt, long, f"l{i}"))
                out[name]["per_token_ms"].append(1e3 * (times[-1] - times[0])
                                                 / max(1, len(times) - 1))
                t0 = time.perf_counter()
                streams = [await engines[name].add_request(
                    {"prompt_token_ids": [11 + (j * 7 + k) % 200 for k in range(args.input_len)]},
                    burst, f"b{i}-{j}") for j in range(args.burst)]
                firsts = await asyncio.gather(*(_collect(s) for s in streams))
                out[name]["burst_ttft_ms"].append(statistics.mean(
                    1e3 * (t[0] - t0) for t in firsts))
                out[name]["burst_s"].append(max(t[-1] for t in firsts) - t0)
            _log(f"round {i + 1}/{args.rounds}: long request and burst, each engine")
    finally:
        for engine in engines.values():
            await engine.shutdown()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(Path(args.tiny)) if args.tiny else Path(args.model)
    with spinning_neighbours(args.busy, _log):
        raw = asyncio.run(_measure(model, args))
    summary = {}
    for name, r in raw.items():
        rt = sorted(r["round_trip_ms"])
        summary[name] = {"round_trip_ms_p50": statistics.median(rt),
                         "round_trip_ms_p99": rt[int(0.99 * (len(rt) - 1))],
                         "per_token_ms": statistics.median(r["per_token_ms"]),
                         "burst_ttft_ms": statistics.median(r["burst_ttft_ms"]),
                         "burst_s": statistics.median(r["burst_s"])}
    return {"benchmark": "core_launchers", "environment": environment(), "cpu": cpu_model(),
            "model": str(model), "settings": vars(args), "summary": summary, "raw": raw}


def format_tables(r: dict[str, Any]) -> str:
    s, st = r["summary"], r["settings"]
    rows = [("round trip, one-token request, p50 (ms)", "round_trip_ms_p50", "{:.2f}"),
            ("round trip, p99 (ms)", "round_trip_ms_p99", "{:.2f}"),
            (f"time per output token, one request of {st['output_len']} (ms)", "per_token_ms",
             "{:.3f}"),
            (f"burst of {st['burst']}: mean TTFT (ms)", "burst_ttft_ms", "{:.1f}"),
            (f"burst of {st['burst']}: wall time (s)", "burst_s", "{:.3f}")]
    lines = [f"{r['model']}, {r['cpu']}; {st['requests']} round trips and {st['rounds']} rounds "
             "each, alternating" + (f", beside {st['busy']} busy process(es)"
                                    if st.get("busy") else ", quiet"), "| | mp | ray | ray / mp |", "| --- | ---: | ---: | ---: |"]
    for label, key, fmt in rows:
        a, b = s["mp"][key], s["ray"][key]
        lines.append(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f}x |")
    return "\n".join(lines)


def write_plot(r: dict[str, Any], path: str) -> bool:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([r["raw"][n]["round_trip_ms"] for n in LAUNCHERS], tick_labels=list(LAUNCHERS))
    ax.set_ylabel("one-token round trip (ms)")
    ax.set_title(f"engine core: a process here (mp) or a Ray actor (ray)\n{r['cpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", help="a checkpoint directory")
    m.add_argument("--tiny", metavar="DIR", help="build (once) the tests' tiny Llama")
    p.add_argument("--requests", type=int, default=300, help="round trips per engine")
    p.add_argument("--rounds", type=int, default=5, help="long requests and bursts per engine")
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--burst", type=int, default=64)
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
    report(run(args), args, format_tables, write_plot, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
