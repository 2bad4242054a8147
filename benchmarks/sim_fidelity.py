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
  caching).

    python benchmarks/sim_fidelity.py --json fidelity.json --plot fidelity.png

Goal: within 5% on throughput and TPOT and 10% on TTFT, verdicts agreeing.
"""

from __future__ import annotations

import argparse
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
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", help="use this profile instead of calibrating")
    p.add_argument("--quick-calibration", action="store_true")
    p.add_argument("--load", type=float, default=0.9,
                   help="Poisson rate as a fraction of the backlog's real request rate")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--model", help="checkpoint for both configs (default: the default model)")
    p.add_argument("--workloads", default="backlog,poisson,chat")
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
    profile = args.profile
    if profile is None:
        profile = str(Path(args.json or "fidelity.json").with_suffix(".profile.json"))
        t0 = time.perf_counter()
        prof, rep = calibrate(configs["fcfs"], quick=args.quick_calibration)
        prof.save(profile)
        results["calibration"] = {"profile": profile, "seconds": time.perf_counter() - t0,
                                  "report": rep, "diagnostics": prof.cost_model.diagnostics}
        log(f"calibrated in {time.perf_counter() - t0:.0f} s -> {profile}")
    results["profile"] = profile

    _, vocab, exclude = prompt_token_space(config_model_dir(configs["fcfs"]))
    specs = {"backlog": load_yaml(WORKLOADS / "backlog-priority.yaml"),
             "chat": load_yaml(WORKLOADS / "chat-sessions.yaml")}
    wanted = args.workloads.split(",")
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
        for label, cfg in configs.items():
            per[label] = run_pair(f"{name}/{label}", cfg, profile, wl, args.repeats)
        if name == "backlog":
            real = per["fcfs"]["real"]
            backlog_rate = 48 / real["duration_s"] if real["duration_s"] else 1.0
        results["workloads"][name] = {"description": wl.description, "spec": spec,
                                      "runs": per, "verdicts": verdicts(per)}
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
        lines.append(f"# calibration: {a['steps']} steps in {cal['seconds']:.0f} s, mean |step "
                     f"error| {a['mean_abs_error_pct']:.1f}%")
    lines.append("")
    head = f"{'workload':<9} {'sched':<9} {'metric':<20} {'real':>9} {'sim':>9} {'error':>8} " \
           f"{'goal':>6}"
    lines += [head, "-" * len(head)]
    for name, w in results["workloads"].items():
        for label, r in w["runs"].items():
            for key, text, _, goal in [*METRICS, P0]:
                if key not in r["real"]:
                    continue
                err = r["error_pct"].get(key)
                ok = "" if err is None else ("ok" if abs(err) <= goal else "MISS")
                lines.append(f"{name:<9} {label:<9} {text:<20} {r['real'][key]:>9.1f} "
                             f"{r['sim'][key]:>9.1f} {err:>+7.1f}% {ok:>6}")
            pre = (r["real"]["num_preemptions"], r["sim"]["num_preemptions"])
            lines.append(f"{'':<9} {label:<9} {'preemptions':<20} {pre[0]:>9.0f} {pre[1]:>9.0f}")
    lines += ["", f"{'workload':<9} {'metric':<20} {'real winner':>12} {'sim winner':>11} "
                  f"{'agree':>6} {'real A/B gap':>13}"]
    for name, w in results["workloads"].items():
        for key, v in w["verdicts"].items():
            text = next(t for k, t, *_ in [*METRICS, P0] if k == key)
            lines.append(f"{name:<9} {text:<20} {v['real']:>12} {v['sim']:>11} "
                         f"{'yes' if v['agree'] else 'NO':>6} {v['real_difference_pct']:>12.1f}%")
    return "\n".join(lines)


def write_plot(results: dict[str, Any], path: str) -> bool:
    plt = pyplot(path, log)
    if plt is None:
        return False
    keys = [*METRICS, P0]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), sharey=False)
    for ax, (key, text, _, goal) in zip(axes, keys):
        names, errs = [], []
        for name, w in results["workloads"].items():
            for label, r in w["runs"].items():
                if key in r["error_pct"]:
                    names.append(f"{name}\n{label}")
                    errs.append(r["error_pct"][key])
        ax.bar(range(len(errs)), errs, color=["tab:green" if abs(e) <= goal else "tab:red"
                                              for e in errs])
        ax.axhspan(-goal, goal, color="0.9", zorder=0)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks(range(len(names)), names, fontsize=7)
        ax.set_title(f"{text}: sim error %", fontsize=9)
    env = results["env"]
    fig.suptitle(f"sim vs real on {env['cpu_model']}, {env['date'][:10]} (band: goal)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
