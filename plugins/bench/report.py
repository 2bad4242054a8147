"""A/B reports: the side-by-side table, the JSON result file and the latency CDF plot.

With several runs per target (``--repeats``) each cell is the mean ± the sample standard
deviation over the runs, and every ratio B/A gets a verdict from **Welch's t-test** on the
per-run values (two-sided, alpha 0.05): "better"/"worse" only when the difference is
significant, "within noise" otherwise. Welch's test is used rather than "the runs' ranges do not
overlap" because non-overlap of two runs each happens by chance one time in three when nothing
changed; the t-test accounts for the number of runs and for unequal spreads, and with two runs
per target it is appropriately hard to convince (few degrees of freedom). With one run per target
there is no estimate of the noise, and the verdict says so ("1 run") instead of declaring a win.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .metrics import (DEFAULT_PERCENTILES, LATENCY_METRICS, RequestRecord,
                      by_priority, percentile_key)
from .progress import log
from .targets import RunResult, Target
from .workload import Workload

ALPHA = 0.05
_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E"}


# ----------------------------------------------------------------------------- statistics
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test that ``a`` and ``b`` have the same mean; None with
    fewer than two values on either side. Two constant samples: 1.0 when equal, else 0.0 (a
    deterministic difference, e.g. a preemption count that never varies)."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return 1.0 if ma == mb else 0.0
    t = (mb - ma) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def verdict(a: Sequence[float], b: Sequence[float], higher_is_better: bool,
            alpha: float = ALPHA) -> tuple[str, float | None]:
    """Whether B differs from A beyond the run-to-run noise: ("better" | "worse" | "within
    noise" | "1 run", p-value)."""
    p = welch_t_test(a, b)
    if p is None:
        return "1 run", None
    if p >= alpha:
        return "within noise", p
    up = statistics.fmean(b) > statistics.fmean(a)
    return ("better" if up == higher_is_better else "worse"), p


# ----------------------------------------------------------------------------- rows
def comparison_rows(percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    metrics: Sequence[str] = LATENCY_METRICS, goodput: bool = False,
                    ) -> list[tuple[str, str, bool]]:
    """(summary key, row title, higher is better) for the table and the JSON comparisons."""
    rows = [("request_throughput", "requests/s", True),
            ("output_throughput", "output tok/s", True),
            ("total_token_throughput", "total tok/s", True)]
    if goodput:
        rows.append(("request_goodput", "goodput req/s", True))
    for m in metrics:
        rows.append((f"mean_{m}_ms", f"{_TITLES[m]} mean ms", False))
        rows.append((f"median_{m}_ms", f"{_TITLES[m]} p50 ms", False))
        for q in percentiles:
            if q != 50:
                key = percentile_key(q)
                rows.append((f"{key}_{m}_ms", f"{_TITLES[m]} {key} ms", False))
    rows += [("num_preemptions", "preemptions", False),
             ("prefix_cache_hit_rate", "prefix cache hit rate", True),
             ("failed", "failed requests", False)]
    return rows


def _values(runs: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in runs if r.get(key) is not None]


def aggregate(runs: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, Any]:
    """Per key: mean, sample std (None for one run), min, max and the per-run values."""
    out = {}
    for key in keys:
        xs = _values(runs, key)
        out[key] = {"mean": statistics.fmean(xs) if xs else None,
                    "std": statistics.stdev(xs) if len(xs) > 1 else None,
                    "min": min(xs) if xs else None, "max": max(xs) if xs else None,
                    "n": len(xs), "values": xs}
    return out


def compare(runs_by_target: Mapping[str, Sequence[Mapping[str, Any]]],
            rows: Sequence[tuple[str, str, bool]]) -> list[dict[str, Any]]:
    """B/A, C/A, ... for every row: ratio of the means, Welch p-value and verdict."""
    labels = list(runs_by_target)
    base = labels[0]
    out = []
    for other in labels[1:]:
        metrics: dict[str, Any] = {}
        for key, _, higher in rows:
            a = _values(runs_by_target[base], key)
            b = _values(runs_by_target[other], key)
            if not a or not b:
                continue
            ma, mb = statistics.fmean(a), statistics.fmean(b)
            ratio = mb / ma if ma else (1.0 if mb == ma else None)
            word, p = verdict(a, b, higher)
            if word == "1 run" and ma == mb:
                word = "same"
            metrics[key] = {"ratio": ratio, "p_value": p, "verdict": word}
        out.append({"baseline": base, "target": other, "metrics": metrics})
    return out


# ----------------------------------------------------------------------------- results
def class_runs(run: Mapping[str, Any], section: str, cls: str) -> dict[str, Any] | None:
    return (run.get(section) or {}).get(cls)


def build_results(runs: Sequence[RunResult], targets: Sequence[Target],
                  workloads: Mapping[int, Workload], *, settings: Mapping[str, Any],
                  goodput: Mapping[str, float] | None = None,
                  percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                  metrics: Sequence[str] = LATENCY_METRICS,
                  environment: Mapping[str, Any] | None = None,
                  detailed: bool = True) -> dict[str, Any]:
    """The JSON result: settings, environment, targets and their configs, the workload spec,
    every run with (``detailed``) its per-request records, per-target aggregates and the
    comparisons.

    vLLM's run-level keys (``num_prompts``, ``request_rate``, ``burstiness``,
    ``max_concurrency``) are at the top; with exactly one run, that run's vLLM-named metrics are
    copied to the top level too, so the file reads like a ``vllm bench serve`` result."""
    kw = dict(goodput=goodput, percentiles=percentiles, metrics=metrics)
    run_json = [r.to_json(**kw, detailed=detailed) for r in runs]
    labels = [t.label for t in targets]
    by_target = {label: [r for r in run_json if r["target"] == label] for label in labels}
    rows = comparison_rows(percentiles, metrics, bool(goodput))
    keys = [k for k, _, _ in rows]
    first = next(iter(workloads.values()))
    results: dict[str, Any] = {
        "backend": "corellm",
        "date": (environment or {}).get("date"),
        "num_prompts": len(first.requests),
        "request_rate": settings.get("request_rate"),
        "burstiness": settings.get("burstiness"),
        "max_concurrency": settings.get("max_concurrency"),
        "settings": dict(settings, goodput=dict(goodput or {}), percentiles=list(percentiles),
                         percentile_metrics=list(metrics)),
        "environment": dict(environment or {}),
        "workload": {"description": first.description, "spec": first.spec,
                     "seeds": sorted(workloads),
                     "num_requests": len(first.requests),
                     "priority_classes": sorted({r.priority for r in first.requests}),
                     "tenants": sorted({r.user for r in first.requests if r.user is not None}),
                     "sessions": len({r.session_id for r in first.requests
                                      if r.session_id is not None})},
        "targets": [t.describe() for t in targets],
        "aggregate": {label: aggregate(by_target[label], keys) for label in labels},
        "comparisons": compare(by_target, rows),
        "class_comparisons": {},
        "runs": run_json,
    }
    for section in ("per_priority", "per_tenant"):
        classes = sorted({c for r in run_json for c in r[section]}, key=_class_key)
        if len(classes) < 2:
            continue
        results["class_comparisons"][section] = {
            cls: compare({label: [s for r in by_target[label]
                                  if (s := class_runs(r, section, cls)) is not None]
                          for label in labels}, rows)
            for cls in classes}
    if len(run_json) == 1:
        single = {k: v for k, v in run_json[0].items()
                  if k not in ("target", "repeat", "seed", "per_priority", "per_tenant",
                               "requests", "info", "engine_counters")}
        results.update(single)
    return results


def _class_key(name: str) -> tuple[int, int, str]:
    """Priority classes in numeric order; tenants by name, "None" (no tenant) last."""
    try:
        return (0, int(name), "")
    except ValueError:
        return (2 if name == "None" else 1, 0, name)


def write_json(results: Mapping[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    log(f"wrote {path}")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


# ----------------------------------------------------------------------------- the table
def _fmt(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    if key in ("failed", "num_preemptions", "completed"):
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    if key == "prefix_cache_hit_rate":
        return f"{100 * value:.1f}%"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _cell(agg: Mapping[str, Any], key: str) -> str:
    entry = agg.get(key) or {}
    mean, std = entry.get("mean"), entry.get("std")
    if mean is None:
        return "-"
    if key == "prefix_cache_hit_rate" and std is not None:
        return f"{100 * mean:.1f}% ± {100 * std:.1f}"
    return _fmt(mean, key) + (f" ± {_fmt(std, key)}" if std is not None else "")


def _ratio_cell(entry: Mapping[str, Any] | None) -> str:
    """``0.07x better``, ``1.02x ~noise``; a baseline of 0 has no ratio, only the verdict."""
    if not entry:
        return "-"
    tag = {"better": "better", "worse": "worse", "within noise": "~noise",
           "1 run": "", "same": ""}[entry["verdict"]]
    if entry.get("ratio") is None:
        return tag or "-"
    return f"{entry['ratio']:.2f}x {tag}".rstrip()


def _table(title: str, labels: Sequence[str], aggs: Mapping[str, Mapping[str, Any]],
           comparisons: Sequence[Mapping[str, Any]],
           rows: Sequence[tuple[str, str, bool]]) -> list[str]:
    ratio_heads = [f"{c['target']}/{c['baseline']}" for c in comparisons]
    body = []
    for key, name, _ in rows:
        cells = [_cell(aggs[label], key) for label in labels]
        if all(c == "-" for c in cells):
            continue
        body.append([name, *cells, *(_ratio_cell(c["metrics"].get(key)) for c in comparisons)])
    heads = [title, *labels, *ratio_heads]
    widths = [max(len(str(row[i])) for row in [heads, *body]) for i in range(len(heads))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                         for i, (c, w) in enumerate(zip(row, widths)))
    return [line(heads), "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, body)]


def format_report(results: Mapping[str, Any], *, tables: bool = True) -> str:
    """The side-by-side table (one column per target, then B/A, C/A ... ratios), and the same
    per priority class and per tenant when the workload has several. ``tables=False`` keeps
    only the header and the failures (a sweep prints its own table instead)."""
    labels = [t["label"] for t in results["targets"]]
    settings = results["settings"]
    rows = comparison_rows(settings["percentiles"], settings["percentile_metrics"],
                           bool(settings["goodput"]))
    n_runs = {label: sum(r["target"] == label for r in results["runs"]) for label in labels}
    lines = [f"workload: {results['workload']['description']}",
             "targets: " + ", ".join(f"{t['label']} ({t['kind']}"
                                      + (f", {t['config_file']}" if t.get("config_file") else "")
                                      + (f", {t['url']}" if t.get("url") else "") + ")"
                                      for t in results["targets"])
             + f"; runs per target: {max(n_runs.values())}"]
    env = results.get("environment") or {}
    if env:
        threads = env.get("torch_threads")
        lines.append(f"machine: {env.get('cpu_model')}, {env.get('cpu_count')} CPUs, torch "
                     f"{env.get('torch')} ("
                     f"{'not loaded' if threads is None else f'{threads} threads'}), "
                     f"{env.get('date')}")
    lines.append("")
    if tables:
        lines += _tables(results, labels, rows, n_runs)
    failed = [(r["target"], r["repeat"], reason, count) for r in results["runs"]
              for reason, count in r["failed_reasons"].items()]
    for target, rep, reason, count in failed:
        lines.append(f"FAILED {target} run {rep + 1}: {count} request(s): {reason}")
    return "\n".join(lines)


def _tables(results: Mapping[str, Any], labels: Sequence[str],
            rows: Sequence[tuple[str, str, bool]], n_runs: Mapping[str, int]) -> list[str]:
    settings = results["settings"]
    lines = _table("overall", labels, results["aggregate"], results["comparisons"], rows)
    for section, name in (("per_priority", "priority"), ("per_tenant", "tenant")):
        for cls, comparisons in results["class_comparisons"].get(section, {}).items():
            aggs = {label: aggregate([s for r in results["runs"] if r["target"] == label
                                      if (s := class_runs(r, section, cls)) is not None],
                                     [k for k, _, _ in rows]) for label in labels}
            lines += ["", *_table(f"{name} {cls}", labels, aggs, comparisons, rows)]
    lines.append("")
    if len(labels) < 2:
        pass
    elif max(n_runs.values()) < 2:
        lines.append("one run per target: ratios carry no noise estimate; use --repeats 3 or "
                     "more to tell a win from noise")
    else:
        lines.append(f"cells: mean ± sample std over runs; ratio marks: better/worse = Welch's "
                     f"t-test p < {ALPHA} on the per-run values, ~noise = not significant")
    if settings["goodput"]:
        lines.append("goodput SLOs (ms): " + ", ".join(f"{k} <= {v:g}"
                                                      for k, v in settings["goodput"].items()))
    return lines


# ----------------------------------------------------------------------------- the plot
def _cdf(ax: Any, values: Sequence[float], **style: Any) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", **style)


def pyplot_for(path: str | Path, warn: Callable[[str], None] | None = None) -> Any:
    """matplotlib.pyplot on the Agg backend, or None (logged: the plot at ``path`` is skipped)
    when matplotlib is not installed. ``warn`` logs the skip (default: the bench's own log);
    the benchmark scripts (``benchmarks/_common.py``'s ``pyplot``) pass their own."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        (warn or log)(f"--plot {path}: matplotlib is not installed (pip install matplotlib); "
                      "skipped")
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: str | Path) -> None:
    """Lay out, write (creating the directory) and close a figure."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    log(f"wrote {path}")


def write_plot(results: Mapping[str, Any], path: str | Path) -> bool:
    """CDFs of TTFT and E2E latency per target (all runs pooled), and per priority class when
    there are several. False (logged) when matplotlib is missing."""
    plt = pyplot_for(path)
    if plt is None:
        return False
    labels = [t["label"] for t in results["targets"]]
    records = {label: [RequestRecord.from_json(q) for r in results["runs"]
                       if r["target"] == label for q in r["requests"]] for label in labels}
    classes = list(by_priority(next(iter(records.values()))))
    per_class = len(classes) > 1
    fig, axes = plt.subplots(2 if per_class else 1, 2, figsize=(12, 8 if per_class else 4.2),
                             dpi=110, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for col, (metric, title) in enumerate((("ttft", "time to first token"),
                                           ("e2el", "end-to-end latency"))):
        ax = axes[0][col]
        for i, label in enumerate(labels):
            values = [1e3 * v for r in records[label] if r.ok
                      if (v := getattr(r, metric)) is not None]
            _cdf(ax, values, color=colors[i % len(colors)], label=label)
        ax.set_title(f"{title}, all requests", fontsize=9)
        if per_class:
            ax = axes[1][col]
            for i, label in enumerate(labels):
                for j, (cls, recs) in enumerate(by_priority(records[label]).items()):
                    values = [1e3 * v for r in recs if r.ok
                              if (v := getattr(r, metric)) is not None]
                    _cdf(ax, values, color=colors[i % len(colors)],
                         linestyle=styles[j % len(styles)], label=f"{label}, priority {cls}")
            ax.set_title(f"{title}, per priority class", fontsize=9)
    for ax in axes.flat:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.lines:
            lo = min(min(line.get_xdata()) for line in ax.lines)
            hi = max(max(line.get_xdata()) for line in ax.lines)
            if lo > 0 and hi / lo > 50:
                ax.set_xscale("log")
            ax.legend(fontsize=7)
    env = results.get("environment") or {}
    seeds = results["workload"]["seeds"]
    fig.suptitle(f"corellm bench: {results['workload']['description']}"
                 + (f" (runs with seeds {seeds[0]}..{seeds[-1]} pooled)" if len(seeds) > 1
                    else "")
                 + (f"\n{env.get('cpu_model', 'CPU')}, {env['cpu_count']} CPUs, {env.get('date', '')}"
                    if env.get("cpu_count") else ""), fontsize=10)
    save_figure(plt, fig, path)
    return True
