"""Production traces replayed as a workload: ``corellm bench --dataset-name trace``.

Two formats, told apart by the extension (``.csv``; ``.jsonl``/``.json``) or else the first line:

* the Azure LLM inference traces (CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``, the
  timestamp a datetime such as ``2023-11-16 18:15:46.6805900``): prompts are random token ids of
  ``ContextTokens`` length, drawn from the same token space as random prompts;
* the Mooncake traces (JSONL, ``{"timestamp": ms, "input_length": N, "output_length": M,
  "hash_ids": [...]}``): each hash id names one block of ``block_size`` (512) prompt tokens, so
  the prompt is the concatenation of its ids' blocks, cut to ``input_length``; every id maps to
  one seeded random block, so requests that share ids share those tokens and the prefix cache
  sees the trace's own reuse.

A request arrives at its timestamp minus the first kept request's, divided by the speed-up; its
output length is the trace's, sent with ``ignore_eos``. A window of trace time, a seeded
Bernoulli sample and a count cap choose which rows are sent, in that order.
"""

from __future__ import annotations

import calendar
import csv
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .progress import log
from .workload import _STREAM, BenchRequest, Workload, _rng, allowed_token_ids, draw_tokens
from .workload_spec import WorkloadError, json_objects

MOONCAKE_BLOCK_SIZE = 512
AZURE_COLUMNS = ("timestamp", "contexttokens", "generatedtokens")


@dataclass(frozen=True)
class TraceRow:
    t: float                             # seconds of trace time
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None     # Mooncake's prompt blocks
    lineno: int


@dataclass
class Trace:
    path: Path
    format: str                          # "azure" or "mooncake"
    rows: list[TraceRow]                 # in timestamp order
    clamped: Counter = field(default_factory=Counter)


_DATETIME = re.compile(
    r"^\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?\s*$")


def parse_timestamp(text: str) -> float:
    """Seconds since the epoch of an Azure trace timestamp: ``YYYY-MM-DD HH:MM:SS[.fraction]``
    with any number of fractional digits (the traces have 7, more than ``datetime`` takes) and
    an optional ``Z``/``+HH:MM``; a plain number is taken as seconds. Raises ValueError."""
    m = _DATETIME.match(text)
    if m is None:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 61):
        raise ValueError(text)
    seconds = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) + float(f"0.{m.group(7) or 0}")
    tz = m.group(8)
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return seconds


def detect_format(path: Path, first_line: str) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "mooncake"
    head = first_line.lstrip("\ufeff").strip()
    if head.startswith("{"):
        return "mooncake"
    if head.lower().startswith("timestamp") or "contexttokens" in head.lower():
        return "azure"
    return None


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, str):
        value = value.strip()
        try:
            value = int(value) if re.fullmatch(r"[+-]?\d+", value) else float(value)
        except ValueError:
            raise ValueError(f"{where}: {what} must be an integer >= 0, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            isinstance(value, int) or float(value).is_integer()) or value < 0:
        raise ValueError(f"{where}: {what} must be an integer >= 0, got {value!r}")
    return int(value)


def _read_azure(path: Path, lines: list[str]) -> list[TraceRow]:
    rows = []
    reader = csv.reader(lines)
    header = next(reader, None)
    names = [h.strip().lstrip("\ufeff").lower() for h in header or []]
    missing = [c for c in AZURE_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{path.name}:1: expected the header TIMESTAMP,ContextTokens,"
                         f"GeneratedTokens (an Azure LLM inference trace), got "
                         f"{','.join(header or [])!r}")
    ti, ci, gi = (names.index(c) for c in AZURE_COLUMNS)
    for cells in reader:
        lineno = reader.line_num
        if not any(c.strip() for c in cells):
            continue
        where = f"{path.name}:{lineno}"
        if len(cells) < len(names):
            raise ValueError(f"{where}: expected {len(names)} columns, got {len(cells)}")
        try:
            t = parse_timestamp(cells[ti])
        except ValueError:
            raise ValueError(f"{where}: TIMESTAMP {cells[ti]!r} is not a date and time "
                             "(YYYY-MM-DD HH:MM:SS.fraction) or a number of seconds") from None
        rows.append(TraceRow(t, _count(cells[ci], "ContextTokens", where),
                             _count(cells[gi], "GeneratedTokens", where), None, lineno))
    return rows


def _read_mooncake(path: Path, lines: list[str]) -> list[TraceRow]:
    rows = []
    for lineno, where, obj in json_objects(lines, path.name):
        missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)} (a Mooncake trace line "
                             "has timestamp, input_length, output_length and hash_ids)")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise ValueError(f"{where}: timestamp must be a number of milliseconds, got {ts!r}")
        ids = obj.get("hash_ids")
        if ids is not None and (not isinstance(ids, list) or any(
                isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids)):
            raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
        rows.append(TraceRow(ts / 1000.0, _count(obj["input_length"], "input_length", where),
                             _count(obj["output_length"], "output_length", where),
                             tuple(ids) if ids else None, lineno))
    return rows


def read_trace(path: str | Path, *, flag: str = "--dataset-path") -> Trace:
    """Read an Azure (CSV) or Mooncake (JSONL) trace; rows sorted by time. A zero prompt or
    output length is sent as 1 token (counted in ``clamped``). Raises ``WorkloadError`` naming
    the file and line of a bad row."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise WorkloadError([(flag, f"cannot read {path}: {reason or exc}")]) from None
    first = next((line for line in lines if line.strip()), "")
    fmt = detect_format(path, first)
    if fmt is None:
        raise WorkloadError([(flag, f"{path}: not a trace this reads: expected an Azure LLM "
                                    "inference trace (CSV with TIMESTAMP,ContextTokens,"
                                    "GeneratedTokens) or a Mooncake trace (JSONL with "
                                    "timestamp, input_length, output_length, hash_ids)")])
    try:
        rows = _read_azure(path, lines) if fmt == "azure" else _read_mooncake(path, lines)
    except ValueError as exc:
        raise WorkloadError([(flag, str(exc))]) from None
    if not rows:
        raise WorkloadError([(flag, f"{path}: no requests")])
    trace = Trace(path, fmt, sorted(rows, key=lambda r: r.t))
    for r in trace.rows:
        trace.clamped["prompt"] += r.input_len == 0
        trace.clamped["output"] += r.output_len == 0
    return trace


# ============================================================================ the workload
@dataclass(frozen=True)
class TraceOptions:
    speedup: float = 1.0
    window: tuple[float | None, float | None] = (None, None)   # seconds of trace time
    sample: float = 1.0                  # fraction kept (seeded Bernoulli)
    num_prompts: int | None = None       # at most this many: the first after window and sample
    block_size: int = MOONCAKE_BLOCK_SIZE


def select_rows(trace: Trace, options: TraceOptions, seed: int,
                max_model_len: int | None = None) -> tuple[list[TraceRow], dict[str, int]]:
    """The rows a run sends, and how many each step kept: the window (relative to the
    trace's first timestamp), the seeded sample, the context limit, the count cap."""
    t0 = trace.rows[0].t
    lo, hi = options.window
    # One draw per row of the file, so a row's fate under a seed is the same whatever the
    # window: samples of nested windows nest.
    draw = (_rng(seed, "trace_sample").random(len(trace.rows)) if options.sample < 1.0
            else None)
    picked = [(k, r) for k, r in enumerate(trace.rows)
              if (lo is None or r.t - t0 >= lo) and (hi is None or r.t - t0 < hi)]
    kept = {"rows": len(trace.rows), "window": len(picked)}
    if draw is not None:
        picked = [(k, r) for k, r in picked if draw[k] < options.sample]
    rows = [r for _, r in picked]
    kept["sample"] = len(rows)
    if max_model_len is not None:
        rows = [r for r in rows
                if max(r.input_len, 1) + max(r.output_len, 1) <= max_model_len]
    kept["fit"] = len(rows)
    if options.num_prompts is not None:
        rows = rows[:options.num_prompts]
    kept["sent"] = len(rows)
    return rows, kept


class _Blocks:
    """Token blocks named by Mooncake hash ids: one seeded random block per id."""

    def __init__(self, seed: int, allowed: np.ndarray, size: int) -> None:
        self.seed, self.allowed, self.size = seed, allowed, size
        self.cache: dict[int, list[int]] = {}

    def __getitem__(self, hash_id: int) -> list[int]:
        block = self.cache.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, _STREAM["trace_blocks"], hash_id])
            block = self.cache[hash_id] = rng.choice(self.allowed, size=self.size).tolist()
        return block


def _window_text(window: tuple[float | None, float | None]) -> str:
    lo, hi = window
    return f"{'' if lo is None else f'{lo:g}'}:{'' if hi is None else f'{hi:g}'} s"


def trace_workload(trace: Trace, *, vocab_size: int, exclude_ids: Any = frozenset(),
                   seed: int = 0, options: TraceOptions = TraceOptions(),
                   max_model_len: int | None = None, quiet: bool = False) -> Workload:
    """The requests of a trace: arrivals at (timestamp - first kept) / speed-up, the trace's
    lengths (sent with ignore_eos), prompts of random ids or of the hash ids' blocks."""
    rows, kept = select_rows(trace, options, seed, max_model_len)
    if not rows:
        raise WorkloadError([("--trace-window" if kept["window"] == 0 else
                              "--trace-sample" if kept["sample"] == 0 else "--dataset-path",
                              f"{trace.path}: no request left to send ({_kept_text(kept)})")])
    allowed = allowed_token_ids(vocab_size, exclude_ids)
    blocks = _Blocks(seed, allowed, options.block_size)
    token_rng = _rng(seed, "tokens")
    t_first = rows[0].t
    requests, beyond_blocks = [], 0
    for i, r in enumerate(rows):
        n = max(r.input_len, 1)
        if r.hash_ids:
            ids: list[int] = []
            for h in r.hash_ids:
                if len(ids) >= n:
                    break
                ids += blocks[h]
            if len(ids) < n:
                beyond_blocks += 1
                ids += draw_tokens(token_rng, allowed, n - len(ids))
            ids = ids[:n]
        else:
            ids = draw_tokens(token_rng, allowed, n)
        requests.append(BenchRequest(index=i, prompt_token_ids=ids,
                                     output_len=max(r.output_len, 1),
                                     delay_s=(r.t - t_first) / options.speedup))
    span = requests[-1].delay_s
    if not quiet:
        notes = [_kept_text(kept)]
        if trace.clamped["prompt"] or trace.clamped["output"]:
            notes.append(f"{trace.clamped['prompt']:,} empty prompts and "
                         f"{trace.clamped['output']:,} zero output lengths in the file sent as "
                         "1 token")
        if beyond_blocks:
            notes.append(f"{beyond_blocks:,} prompts longer than their hash blocks, completed "
                         "with random tokens")
        log(f"trace {trace.path.name} ({trace.format}), seed {seed}: " + "; ".join(notes))
    parts = [f"{len(requests):,} of {len(trace.rows):,} requests over {span:.1f} s"
             + (f" (speed-up {options.speedup:g}x)" if options.speedup != 1 else "")]
    if options.window != (None, None):
        parts.append(f"window {_window_text(options.window)}")
    if options.sample < 1:
        parts.append(f"sample {options.sample:g}")
    if trace.format == "mooncake":
        parts.append(f"blocks of {options.block_size}")
    parts.append(f"seed {seed}")
    spec = {"dataset": "trace", "path": str(trace.path), "format": trace.format,
            "speedup": options.speedup, "window": list(options.window),
            "sample": options.sample, "num_prompts": options.num_prompts,
            "block_size": options.block_size, "seed": seed, "kept": kept}
    return Workload(requests, f"trace {trace.path.name}: " + ", ".join(parts), spec)


def _kept_text(kept: dict[str, int]) -> str:
    out = f"{kept['rows']:,} rows"
    for step, what in (("window", "in the window"), ("sample", "sampled"),
                       ("fit", "fit max_model_len"), ("sent", "under --num-prompts")):
        prev = list(kept)[list(kept).index(step) - 1]
        if kept[step] != kept[prev]:
            out += f", {kept[step]:,} {what}"
    return out + f", {kept['sent']:,} sent"
