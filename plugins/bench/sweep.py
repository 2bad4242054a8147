"""``corellm bench --sweep KEY=V1,V2,...``: one target per value (per point of a grid), one table
and one plot of the chosen metrics against the value.

A sweep key is any config key ``--set`` takes (``scheduler.max_num_seqs``,
``scheduler.alpha``, ``kv_cache.enable_prefix_caching``); values are read as YAML, as ``--set``
reads them. Several ``--sweep`` flags make a grid (their product). Each base target (every
``--config``, or the default config) is run at every point, so the sweep's targets are
``len(bases) x len(grid)`` configs that all see the same seeded workloads, interleaved as in any
A/B run. Every point's config is validated before anything runs, so a misspelt key or a value
out of range stops the sweep at once with the key path (and the point, the target and its file),
not at its tenth target. A ``--url`` target has no config to change and is refused.

The table has one row per point and one column per metric, each ``mean ± std`` over the
repeats (the run-to-run noise); the plot puts the first swept key on the x axis, one line per
base target and value of the other keys, with the standard deviation as error bars.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corellm.errors import ConfigError

from .progress import log
from .targets import Target

# Summary keys a sweep can chart, with their titles; --sweep-metrics picks from these.
SWEEP_METRICS: dict[str, str] = {
    "request_throughput": "requests/s",
    "output_throughput": "output tok/s",
    "total_token_throughput": "total tok/s",
    "request_goodput": "goodput req/s",
    "num_preemptions": "preemptions",
    "prefix_cache_hit_rate": "prefix cache hit rate",
}
for _m, _t in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
    for _s, _st in (("mean", "mean"), ("median", "p50"), ("p90", "p90"), ("p99", "p99")):
        SWEEP_METRICS[f"{_s}_{_m}_ms"] = f"{_t} {_st} ms"
DEFAULT_SWEEP_METRICS = ["output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms"]


@dataclass(frozen=True)
class SweepAxis:
    key: str                    # dotted config key
    values: tuple[Any, ...]     # as YAML read them
    texts: tuple[str, ...]      # as written on the command line (labels, plot ticks)


@dataclass(frozen=True)
class SweepPoint:
    label: str                  # the target's label
    base: str                   # the base target's label
    values: tuple[tuple[str, Any], ...]     # (key, value) per axis


def _split_values(text: str) -> list[str]:
    """``0,1,10`` -> ``["0", "1", "10"]``; commas inside brackets or quotes stay (``[1,2],[3]``
    is two values)."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def parse_sweep(text: str) -> SweepAxis:
    """``"scheduler.alpha=0,1,10"`` -> a ``SweepAxis``; a ``ConfigError`` naming ``--sweep``
    when it is not KEY=V1,V2,... with distinct values."""
    from corellm.config import parse_override

    key, eq, raw = text.partition("=")
    key = key.strip()
    texts = _split_values(raw) if eq else []
    if not eq or not key or not texts or any(not t for t in texts):
        raise ConfigError([("--sweep", f"{text!r}: expected KEY=V1,V2,... with a dotted config "
                                       "key, e.g. scheduler.max_num_seqs=8,16,32")])
    values = [parse_override(f"{key}={t}")[1] for t in texts]
    # Compared as values: 8 and 8.0, true and True are the same config.
    seen = [json.dumps(v, sort_keys=True) for v in values]
    if len(set(seen)) != len(seen):
        raise ConfigError([("--sweep", f"{key}: a value is given twice ({raw})")])
    return SweepAxis(key, tuple(values), tuple(texts))


def check_axes(axes: Sequence[SweepAxis]) -> None:
    keys = [a.key for a in axes]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ConfigError([("--sweep", f"{dup[0]} is swept twice; give its values in one flag")])


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key by its last part (``alpha``) where that is unambiguous, else in full."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def expand_targets(bases: Sequence[Target], axes: Sequence[SweepAxis]) -> tuple[
        list[Target], list[SweepPoint]]:
    """The sweep's targets: every base target's config with every grid point's overrides
    applied, each config validated (all problems of all points reported together)."""
    from corellm.config import apply_overrides, load_config

    from .targets import config_data

    check_axes(axes)
    urls = [b.label for b in bases if b.url is not None]
    if urls:
        raise ConfigError([("--sweep", f"target {urls[0]!r} is a running server (--url), whose "
                                       "config cannot be changed from here: give its config "
                                       "with --config NAME=FILE (add --start-server to measure "
                                       "it served)")])
    short = short_keys([a.key for a in axes])
    targets, points = [], []
    problems: list[tuple[str, str]] = []
    grid = list(itertools.product(*[range(len(a.values)) for a in axes]))
    for base in bases:
        data = config_data(base.config)
        # Errors name the point, the base target and its file: --sweep x=0 (b, b.yaml): key
        where = f"{base.label}, {base.config_file}" if base.config_file else base.label
        for combo in grid:
            values = tuple((a.key, a.values[i]) for a, i in zip(axes, combo))
            name = ",".join(f"{short[a.key]}={a.texts[i]}" for a, i in zip(axes, combo))
            label = name if len(bases) == 1 else f"{base.label} {name}"
            config = apply_overrides(data, list(values))
            try:
                load_config(config)
            except ConfigError as exc:
                problems += [(f"--sweep {name} ({where}): {path}" if path
                              else f"--sweep {name} ({where})", msg)
                             for path, msg in exc.problems]
                continue
            targets.append(Target(label, config=config, start_server=base.start_server,
                                  source=base.config_file))
            points.append(SweepPoint(label, base.label, values))
    if problems:
        raise ConfigError(problems)
    log(f"sweep: {len(grid)} point(s) x {len(bases)} config(s) = {len(targets)} targets")
    return targets, points


# ----------------------------------------------------------------------------- results
def sweep_results(results: Mapping[str, Any], axes: Sequence[SweepAxis],
                  points: Sequence[SweepPoint], metrics: Sequence[str]) -> dict[str, Any]:
    """The ``sweep`` section of the JSON result: per point its values and, per metric, the
    mean, sample std and per-run values over the repeats."""
    from .report import aggregate

    out_points = []
    for p in points:
        agg = aggregate([r for r in results["runs"] if r["target"] == p.label], metrics)
        cells = {m: {k: agg[m][k] for k in ("mean", "std", "values")} for m in metrics}
        out_points.append({"label": p.label, "base": p.base,
                           "values": {k: v for k, v in p.values}, "metrics": cells})
    return {"keys": [a.key for a in axes], "values": {a.key: list(a.values) for a in axes},
            "metrics": list(metrics), "points": out_points}


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric == "prefix_cache_hit_rate":
        return f"{100 * value:.1f}%"
    if metric == "num_preemptions":
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def format_sweep(sweep: Mapping[str, Any]) -> str:
    """One row per point, one column per metric (mean ± std over the repeats)."""
    keys = sweep["keys"]
    bases = {p["base"] for p in sweep["points"]}
    heads = (["config"] if len(bases) > 1 else []) + keys + [SWEEP_METRICS[m]
                                                             for m in sweep["metrics"]]
    body = []
    for p in sweep["points"]:
        row = [p["base"]] if len(bases) > 1 else []
        row += [_value_text(p["values"][k]) for k in keys]
        for m in sweep["metrics"]:
            cell = p["metrics"][m]
            text = _fmt(cell["mean"], m)
            if cell["std"] is not None:
                text += f" ± {_fmt(cell['std'], m).rstrip('%')}"
            row.append(text)
        body.append(row)
    widths = [max(len(str(r[i])) for r in [heads, *body]) for i in range(len(heads))]
    n_text = (1 if len(bases) > 1 else 0) + len(keys)

    def line(row: Sequence[str]) -> str:
        return "  ".join(f"{c:<{w}}" if i < n_text else f"{c:>{w}}"
                         for i, (c, w) in enumerate(zip(row, widths)))
    single = all(p["metrics"][m]["std"] is None for p in sweep["points"]
                 for m in sweep["metrics"])
    title = ("sweep (one run per point: no noise estimate; use --repeats 3 or more)" if single
             else "sweep (mean ± sample std over the repeats)")
    return "\n".join([title, line(heads),
                      "-" * (sum(widths) + 2 * (len(widths) - 1)), *map(line, body)])


def _value_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def write_sweep_plot(sweep: Mapping[str, Any], path: str | Path, title: str = "") -> bool:
    """One panel per metric: the metric against the first swept key's value, a line per base
    config and combination of the other keys, error bars the std over repeats. False (logged)
    when matplotlib is missing."""
    from .report import pyplot_for, save_figure

    plt = pyplot_for(path)
    if plt is None:
        return False
    keys, metrics = sweep["keys"], sweep["metrics"]
    x_key = keys[0]
    x_values = sweep["values"][x_key]
    numeric = _numeric(x_values)
    series: dict[str, list[Mapping[str, Any]]] = {}
    multi_base = len({p["base"] for p in sweep["points"]}) > 1
    short = short_keys(keys)
    for p in sweep["points"]:
        parts = ([p["base"]] if multi_base else []) + [
            f"{short[k]}={_value_text(p['values'][k])}" for k in keys[1:]]
        series.setdefault(", ".join(parts) or "_single", []).append(p)
    cols = min(len(metrics), 2)
    rows = (len(metrics) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), dpi=110,
                             squeeze=False)
    for ax, m in zip(axes.flat, metrics):
        for name, pts in series.items():
            xs, ys, errs = [], [], []
            for p in pts:
                cell = p["metrics"][m]
                if cell["mean"] is None:
                    continue
                x = p["values"][x_key]
                xs.append(x if numeric else x_values.index(x))
                scale = 100.0 if m == "prefix_cache_hit_rate" else 1.0
                ys.append(scale * cell["mean"])
                errs.append(scale * (cell["std"] or 0.0))
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3,
                        label=None if name == "_single" else name)
        ax.set_title(SWEEP_METRICS[m] + (" (%)" if m == "prefix_cache_hit_rate" else ""),
                     fontsize=9)
        ax.set_xlabel(x_key)
        if not numeric:
            ax.set_xticks(range(len(x_values)), [_value_text(v) for v in x_values])
        elif len(x_values) > 2 and min(x_values) > 0 and max(x_values) / min(x_values) >= 50:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if any(line.get_label() and not line.get_label().startswith("_")
               for line in ax.containers):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    save_figure(plt, fig, path)
    return True
