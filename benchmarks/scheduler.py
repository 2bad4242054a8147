#!/usr/bin/env python
"""The cost of ``schedule()`` with a deep waiting queue, per scheduling policy. No model runs.

Builds a ``BatchScheduler`` directly over the real paged KV-cache manager (prefix caching on),
enqueues ``--num-requests`` requests at once (mixed prompt lengths, ``--tenants`` tenants, a
quarter of the prompts opening with one of a few shared system prompts, mixed priorities), then
runs ``--steps`` steps: ``schedule()`` (timed) and an ``update_from_output`` fed with a fake
``ModelRunnerOutput`` that samples a token for every row that reached the end of its tokens. The
queue stays deep: a step admits at most ``max_num_seqs`` requests.

Policies: the built-ins ``fcfs`` and ``priority`` and the examples ``residual_sjf`` and
``fair_share``, imported from their folders under ``examples/`` (no install needed).

Examples::

    python benchmarks/scheduler.py                          # 10,000 requests, 200 steps
    python benchmarks/scheduler.py --num-requests 1000 --steps 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
for example in ("corellm-residual-sjf", "corellm-fair-share"):
    if str(REPO / "examples" / example) not in sys.path:
        sys.path.insert(0, str(REPO / "examples" / example))

from benchmarks._common import cpu_model  # noqa: E402
from corellm.components import SchedulerOptions  # noqa: E402
from corellm.interfaces import SchedulingPolicy  # noqa: E402
from corellm.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from corellm.request import EngineCoreRequest, Request  # noqa: E402
from corellm.sampling_params import SamplingParams  # noqa: E402
from corellm.scheduling import BatchScheduler  # noqa: E402
from corellm_fairshare import FairSharePolicy  # noqa: E402
from corellm.kv.paged import PagedKVCacheManager  # noqa: E402
from corellm_plugins.scheduler_fcfs import FCFSPolicy  # noqa: E402
from corellm_plugins.scheduler_priority import PriorityPolicy  # noqa: E402
from corellm_rsjf import ResidualSJFPolicy  # noqa: E402

POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "residual_sjf": ResidualSJFPolicy,
    "fair_share": FairSharePolicy,
}
MAX_MODEL_LEN = 4096


def make_requests(n: int, tenants: int, seed: int) -> list[EngineCoreRequest]:
    """``n`` requests: prompts of 16 to 1024 tokens (log-uniform, so most are short), a quarter
    of them opening with one of 4 shared 256-token system prompts, outputs of 8 to 128 tokens,
    tenants with Zipf-like volumes, priorities 0 to 3. Arrivals are spread over the last
    minute."""
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 30000) for _ in range(256)] for _ in range(4)]
    tenant_names = [f"tenant-{i}" for i in range(tenants)]
    tenant_weights = [1 / (i + 1) for i in range(tenants)]
    now = time.time()
    out = []
    for i in range(n):
        length = int(2 ** rng.uniform(4, 10))
        prompt = [rng.randrange(10, 30000) for _ in range(length)]
        if rng.random() < 0.25:
            prompt = rng.choice(systems) + prompt
        params = SamplingParams(max_tokens=rng.randrange(8, 129), ignore_eos=True)
        out.append(EngineCoreRequest(
            f"req-{i}", prompt, params, eos_token_id=None,
            arrival_time=now - 60 + 60 * i / n, priority=rng.randrange(4),
            user=rng.choices(tenant_names, tenant_weights)[0]))
    return out


def fake_runner_output(scheduler: BatchScheduler, plan: SchedulerOutput,
                       rng: random.Random) -> ModelRunnerOutput:
    """A sampled token for every planned request whose tokens this step reaches the end of (a
    partial prefill chunk samples nothing), as the workers would return."""
    rows = [rid for rid, n in plan.num_scheduled_tokens.items()
            if scheduler.requests[rid].num_computed_tokens + n
            >= scheduler.requests[rid].num_tokens]
    return ModelRunnerOutput(req_ids=rows,
                             sampled_token_ids=[rng.randrange(10, 30000) for _ in rows])


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bench_policy(name: str, requests: list[EngineCoreRequest], args: argparse.Namespace,
                 ) -> dict[str, Any]:
    options = SchedulerOptions(max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    kv = PagedKVCacheManager(args.num_blocks, args.block_size, hash_seed="bench")
    scheduler = BatchScheduler(options, kv, POLICIES[name]())
    t = time.perf_counter()
    for core in requests:
        scheduler.add_request(Request(core, MAX_MODEL_LEN))
    enqueue_s = time.perf_counter() - t
    waiting = len(scheduler.waiting)

    rng = random.Random(args.seed)
    times, update_times, admitted, finished = [], [], 0, 0
    for _ in range(args.steps):
        t = time.perf_counter()
        plan = scheduler.schedule()
        times.append(time.perf_counter() - t)
        admitted += len(plan.scheduled_new_reqs)
        runner_output = fake_runner_output(scheduler, plan, rng)
        t = time.perf_counter()
        outputs = scheduler.update_from_output(plan, runner_output)
        update_times.append(time.perf_counter() - t)
        finished += sum(o.finished for o in outputs)
    ms = [1000 * s for s in times]
    return {
        "policy": name, "waiting": waiting, "steps": args.steps,
        "enqueue_us_per_request": 1e6 * enqueue_s / len(requests),
        "schedule_ms": {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50),
                        "p99": percentile(ms, 99), "max": max(ms)},
        "update_ms_mean": 1000 * sum(update_times) / len(update_times),
        "admitted": admitted, "finished": finished,
        "waiting_after": len(scheduler.waiting), "preemptions": scheduler.num_preemptions,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated subset of " + ", ".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    names = [p for p in args.policies.split(",") if p]
    unknown = set(names) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies: {', '.join(sorted(unknown))}")

    requests = make_requests(args.num_requests, args.tenants, args.seed)
    results = [bench_policy(name, requests, args) for name in names]

    print(f"{'policy':<14}{'waiting':>9}{'mean ms':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'steps':>7}{'admitted':>10}{'enqueue us':>12}")
    for r in results:
        s = r["schedule_ms"]
        print(f"{r['policy']:<14}{r['waiting']:>9}{s['mean']:>10.3f}{s['p50']:>9.3f}"
              f"{s['p99']:>9.3f}{r['steps']:>7}{r['admitted']:>10}"
              f"{r['enqueue_us_per_request']:>12.1f}")
    report = {"environment": {"cpu": cpu_model(), "python": platform.python_version(),
                              "platform": platform.platform()},
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
