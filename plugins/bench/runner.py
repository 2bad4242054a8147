"""Running a workload against targets, side by side, and recording every request.

A target (``targets.Target``) is one of:

* an in-process engine built from a config (``Target(config=...)``), driven step by step by
  ``engine_driver``;
* a live OpenAI-compatible server (``Target(url=...)``), sent the workload by ``server_client``;
* a config served by ``corellm serve`` started here (``Target(config=..., start_server=True)``,
  see ``server_process``), then sent the workload like any server.

Arrivals follow the workload contract (``workload``): a first turn is due ``delay_s`` after the
run starts; a follow-up is due ``delay_s`` (think time) after its previous turn finished, with
prompt = previous prompt + previous output + its new message (``sessions``). Offline the
previous output is the exact token ids; from a server it is the returned text, re-tokenized
(``server_client`` says what that costs).

Every run gets its own ``cache_salt``, so no run (or warm-up) finds another's prompts in the
prefix cache, while requests of one run share prefixes as the workload intends.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .engine_driver import run_engine
from .progress import log
from .server_client import run_server
from .server_process import started_server
from .targets import RunOptions, RunResult, Target
from .workload import Workload


def run_target(target: Target, workload: Workload, options: RunOptions, *, repeat: int = 0,
               seed: int | None = None, tokenizer: Any = None) -> RunResult:
    """One run of ``workload`` against ``target``, whatever its kind."""
    if target.kind == "engine":
        return run_engine(target, workload, options, repeat=repeat, seed=seed)
    if target.kind == "server":
        return run_server(target, workload, options, repeat=repeat, seed=seed,
                          tokenizer=tokenizer)
    with started_server(target.config, options) as server:
        return run_server(target, workload, options, repeat=repeat, seed=seed,
                          tokenizer=tokenizer, server=server)


def run_ab(targets: Sequence[Target], make_workload: Callable[[int], Workload],
           options: RunOptions, *, repeats: int = 1, seed: int = 0, tokenizer: Any = None,
           ray_address: str | None = None, ray_cpus: float = 1.0, ray_gpus: float = 0.0,
           ) -> tuple[list[RunResult], dict[int, Workload]]:
    """Every target on the same seeded workload, ``repeats`` times with seeds seed, seed+1, ...
    Runs are interleaved (A, B, A, B, ...) so slow drift of the machine hits every target
    alike. Returns the runs in execution order and the workload of each seed. With
    ``ray_address`` ("auto": ``RAY_ADDRESS``, else a local cluster) each run is a Ray task
    (``ray_runs``), the runs returned in the same order."""
    if not targets:
        raise ValueError("no targets")
    if len({t.label for t in targets}) != len(targets):
        raise ValueError("target labels must differ")
    if ray_address is not None:
        from .ray_runs import run_ab_on_ray
        return run_ab_on_ray(run_target, targets, make_workload, options, repeats=repeats,
                             seed=seed, address=ray_address, cpus_per_run=ray_cpus,
                             gpus_per_run=ray_gpus)
    runs: list[RunResult] = []
    workloads: dict[int, Workload] = {}
    for rep in range(repeats):
        s = seed + rep
        workloads[s] = make_workload(s)
        for target in targets:
            log(f"run {rep + 1}/{repeats} of {target.label!r} ({target.kind}), seed {s}: "
                f"{workloads[s].description}")
            run = run_target(target, workloads[s], options, repeat=rep, seed=s,
                             tokenizer=tokenizer)
            failed = sum(not r.ok for r in run.records)
            steps = (run.counters or {}).get("engine_steps")
            log(f"{target.label!r} #{rep + 1}: {len(run.records) - failed}/{len(run.records)} "
                f"ok in {run.duration:.2f} s" + (f", {failed} FAILED" if failed else "")
                + (f" ({int(steps)} engine steps)" if steps is not None else ""))
            runs.append(run)
    return runs, workloads


UNROUTED = "unrouted"


def split_by_arm(runs: Sequence[RunResult], targets: Sequence[Target]
                 ) -> tuple[list[RunResult], list[Target]]:
    """A server that splits its traffic into A/B arms (``X-Corellm-Arm``) as one target per
    arm, ``LABEL/ARM``: each run's records by the arm that answered them, over the run's
    duration (the engine counters, the server's as a whole, are not split). Requests answered
    without an arm (refused before routing, or never answered) are the target
    ``LABEL/unrouted``, never dropped. Targets without arms are as they were."""
    arms: dict[str, list[str]] = {}
    for run in runs:
        found = {r.arm for r in run.records if r.arm}
        if found:
            if any(not r.arm for r in run.records):
                found.add(UNROUTED)
            arms[run.target] = sorted(set(arms.get(run.target, [])) | found)
    if not arms:
        return list(runs), list(targets)
    out_runs: list[RunResult] = []
    for run in runs:
        if run.target not in arms:
            out_runs.append(run)
            continue
        for arm in arms[run.target]:
            mine = [r for r in run.records if (r.arm or UNROUTED) == arm]
            out_runs.append(dataclasses.replace(
                run, target=f"{run.target}/{arm}", records=mine, counters=None,
                info={**run.info, "arm": arm, "arm_of": run.target}))
    out_targets: list[Target] = []
    for t in targets:
        if t.label in arms:
            out_targets += [dataclasses.replace(t, label=f"{t.label}/{arm}")
                            for arm in arms[t.label]]
        else:
            out_targets.append(t)
    return out_runs, out_targets
