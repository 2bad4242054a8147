"""``corellm bench --ray``: the runs of an A/B comparison or a sweep as Ray tasks, one per
(config, repeat, sweep point), on a Ray cluster.

The driver builds every seed's workload (as a local run does), submits one task per run, shows
progress as tasks end, and returns the runs in the local run's order (repeat by repeat, target
by target), so the results are those of the local run: identical for a simulated executor,
whose clock is virtual; for real engines, measured wherever each task ran (give each the
machine to itself: ``--ray-cpus-per-run``). Only in-process targets run as tasks: a server
target is reached over HTTP from the driver, as in a local run.

The cluster: ``--ray ADDRESS`` (or ``RAY_ADDRESS``) joins a running one; ``--ray`` alone starts
a local one for the run and stops it after. Every node needs corellm and the model files at
the same paths (a shared file system, or the same image), as Ray's tasks import the driver's
modules there. ``pip install 'corellm[ray]'`` installs Ray.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from .progress import log
from .targets import RunOptions, RunResult, Target
from .workload import Workload

INSTALL_HINT = "pip install 'corellm[ray]'"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs Ray, which is not installed ({INSTALL_HINT})") from None
    return ray


def run_ab_on_ray(run: Callable[..., RunResult], targets: Sequence[Target],
                  make_workload: Callable[[int], Workload], options: RunOptions, *,
                  repeats: int, seed: int, address: str | None, cpus_per_run: float = 1.0,
                  gpus_per_run: float = 0.0) -> tuple[list[RunResult], dict[int, Workload]]:
    """``run_ab``'s result, each run ``run(target, workload, options, repeat=, seed=)`` (the
    runner's ``run_target``: the run exactly as a local one makes it) as a Ray task (see the
    module's docstring)."""
    servers = [t.label for t in targets if t.kind != "engine"]
    if servers:
        raise ValueError(f"--ray runs in-process targets only; {', '.join(servers)} "
                         "is a server (run it without --ray)")
    ray = _ray()
    address = address if address not in (None, "auto") else os.environ.get("RAY_ADDRESS")
    started = not ray.is_initialized()
    if started:
        t0 = time.perf_counter()
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        log(f"ray: {'joined ' + address if address else 'started a local cluster'} "
            f"({nodes} node(s), {ray.cluster_resources().get('CPU', 0):g} CPUs) in "
            f"{time.perf_counter() - t0:.1f} s")
    try:
        # A task sees the GPUs it reserves, and no others (Ray sets CUDA_VISIBLE_DEVICES).
        task = ray.remote(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=0)(run)
        quiet = dataclasses.replace(options, progress=False)
        workloads: dict[int, Workload] = {}
        pending: dict[Any, tuple[int, str]] = {}
        order = []
        for rep in range(repeats):
            s = seed + rep
            workloads[s] = make_workload(s)
            shared = ray.put(workloads[s])
            for target in targets:
                ref = task.remote(target, shared, quiet, repeat=rep, seed=s)
                pending[ref] = (rep, target.label)
                order.append(ref)
        done: dict[Any, RunResult] = {}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    rep, label = pending.pop(ref)
                    result = done[ref] = ray.get(ref)
                    failed = sum(not r.ok for r in result.records)
                    log(f"ray: {len(done)}/{len(order)} runs done: {label!r} #{rep + 1}, "
                        f"{len(result.records) - failed}/{len(result.records)} ok"
                        + (f", {failed} FAILED" if failed else ""))
        finally:
            for ref in pending:                  # a run failed: the others stop too
                ray.cancel(ref, force=True)
        return [done[ref] for ref in order], workloads
    finally:
        if started:
            ray.shutdown()
