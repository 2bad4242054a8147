"""What the data-parallel router adds to a request: ``EngineGroup.add_request`` (pick the arm
and the replica, submit there, keep the books) against the same replica's
``AsyncLLM.add_request`` called directly, on real engine replicas, alternating call by call;
and the routing decision alone (``Router.arm_for`` + ``Router.pick``).

    python benchmarks/router_overhead.py --tiny /tmp/tiny-model
    python benchmarks/router_overhead.py --model PATH --requests 2000 --json out.json

Each request is submitted and then read to its end (one token) before the next, so the engines
are idle when a submission is timed: the figure is the submission's own cost.
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
from _common import cpu_model, environment, logger, report  # noqa: E402
from tp_executors import tiny_model  # noqa: E402

_log = logger("router")


async def _measure(model: Path, requests: int, replicas: int) -> dict[str, Any]:
    from corellm.config.compose import load_config
    from corellm.engine.replicas import Arm, EngineGroup
    from corellm.plugins import load_registry
    from corellm.sampling_params import SamplingParams
    config = load_config({"model": {"path": str(model), "dtype": "float32"},
                          "kv_cache": {"num_blocks": 256}}, registry=load_registry())
    group = await EngineGroup.create([Arm("", config, replicas)])
    params = SamplingParams(max_tokens=1, temperature=0)
    direct_engine = group.replicas[0].engine
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18]}
    via_group, direct = [], []
    try:
        for i in range(requests):
            for which in ("group", "direct"):
                t0 = time.perf_counter()
                if which == "group":
                    stream = await group.add_request(prompt, params, f"g{i}", user=f"u{i}",
                                                     session_id=f"s{i % 50}")
                else:
                    stream = await direct_engine.add_request(prompt, params, f"d{i}",
                                                             user=f"u{i}")
                took = time.perf_counter() - t0
                async for _ in stream:
                    pass
                (via_group if which == "group" else direct).append(took)
    finally:
        await group.shutdown()
    return {"group_us": [1e6 * t for t in via_group], "direct_us": [1e6 * t for t in direct]}


def _decision_us(n: int = 200_000) -> float:
    from corellm.serving.router import Router
    router = Router({"a": 1, "b": 1})
    load, up = [3, 1, 4, 1], [True] * 4
    t0 = time.perf_counter()
    for i in range(n):
        arm = router.arm_for(f"user-{i % 1000}", None, "r")
        router.pick(arm, load, up, f"s{i % 500}")
    return 1e6 * (time.perf_counter() - t0) / n


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(Path(args.tiny)) if args.tiny else Path(args.model)
    raw = asyncio.run(_measure(model, args.requests, args.replicas))
    g, d = raw["group_us"], raw["direct_us"]
    # the paired difference, call by call (alternating), then its median
    diffs = [a - b for a, b in zip(g, d)]
    return {"benchmark": "router_overhead", "environment": environment(), "cpu": cpu_model(),
            "model": str(model), "settings": vars(args),
            "group_add_request_us": {"p50": statistics.median(g),
                                     "p99": sorted(g)[int(0.99 * len(g))]},
            "direct_add_request_us": {"p50": statistics.median(d),
                                      "p99": sorted(d)[int(0.99 * len(d))]},
            "added_us_p50": statistics.median(diffs),
            "decision_us": _decision_us()}


def format_tables(r: dict[str, Any]) -> str:
    return "\n".join([
        f"{r['settings']['replicas']} replicas of {r['model']}, {r['cpu']}; "
        f"{r['settings']['requests']} requests each way, alternating",
        "| submission | p50 | p99 |", "| --- | ---: | ---: |",
        f"| AsyncLLM.add_request (one replica, direct) | {r['direct_add_request_us']['p50']:.0f} "
        f"us | {r['direct_add_request_us']['p99']:.0f} us |",
        f"| EngineGroup.add_request (routed) | {r['group_add_request_us']['p50']:.0f} us | "
        f"{r['group_add_request_us']['p99']:.0f} us |",
        f"| added by the router (paired median) | {r['added_us_p50']:.1f} us | |",
        f"| the routing decision alone (arm_for + pick) | {r['decision_us']:.2f} us | |"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model")
    m.add_argument("--tiny", metavar="DIR", help="build (once) the tests' tiny Llama")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    report(run(args), args, format_tables, lambda r, path: False, _log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
