"""Request latency metrics: the one implementation of TTFT, TPOT, ITL and E2E latency, used by
both ``corellm bench`` targets (in-process engine, live server) and ``benchmarks/serve.py``.

A ``RequestRecord`` holds what was observed of one request: when it arrived at the target, when
each chunk of output tokens came back, when it ended, and how many tokens it had. Every latency
is derived from those timestamps by the properties below, so the two targets cannot drift apart:

* TTFT: arrival to the first chunk that carries tokens;
* ITL: every gap between two consecutive token-carrying chunks (a chunk with several tokens
  counts one gap, as in vLLM; offline every step returns one token per request);
* E2E latency (``e2el``): arrival to the end of the response;
* TPOT: (E2E - TTFT) / (output tokens - 1), for requests with at least two tokens.

``summarize`` aggregates records into a dict whose keys are those of ``vllm bench serve
--save-result`` wherever the metric is the same (``completed``, ``request_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ``request_goodput``, ...). Differences from vLLM, on purpose:
statistics of an empty list are None (vLLM reports 0), and ``failed_reasons`` counts failures by
their error message.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

MS_PER_S = 1000.0
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")          # vLLM's --goodput keys
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestRecord:
    """One request of a run, as the benchmark client saw it. Times are seconds since the run
    started (``time.perf_counter`` based); ``error`` None means the request succeeded."""

    index: int                               # the workload's BenchRequest.index
    expected_output_tokens: int
    priority: int = 0
    user: str | None = None
    session_id: str | None = None
    follows: int | None = None
    prompt_tokens: int = 0                   # the whole prompt sent (follow-ups: with history)
    output_tokens: int = 0
    cached_tokens: int | None = None         # prompt tokens served from the prefix cache
    arrival_s: float | None = None           # handed to the target (sent / due in the engine)
    chunk_times_s: list[float] = field(default_factory=list)   # each token-carrying chunk
    end_s: float | None = None               # the response ended
    num_preemptions: int | None = None       # offline only (the server does not report it)
    queue_time_s: float | None = None        # arrival to first scheduled (offline only)
    error: str | None = None
    # A server of replicas: the A/B arm and the replica that answered (response headers).
    arm: str | None = None
    replica: int | None = None
    # Kept only when asked (RunOptions.keep_outputs): offline the ids, from a server the text.
    output_token_ids: list[int] | None = None
    output_text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        if self.arrival_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.arrival_s

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el(self) -> float | None:
        if self.arrival_s is None or self.end_s is None:
            return None
        return self.end_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        ttft, e2el = self.ttft, self.e2el
        if ttft is None or e2el is None or self.output_tokens < 2:
            return None
        return (e2el - ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        """Everything observed plus the derived latencies (seconds), for result files."""
        # What ``dataclasses.asdict`` gives (the fields in order, lists copied), built directly:
        # asdict deep-copies every float of every list, which a large run pays per token.
        out = {name: getattr(self, name) for name in _field_names(type(self))}
        for name, value in out.items():
            if isinstance(value, list):
                out[name] = list(value)
        out.update(ok=self.ok, ttft_s=self.ttft, tpot_s=self.tpot, e2el_s=self.e2el,
                   itl_s=self.itl)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


# ----------------------------------------------------------------------------- statistics
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating linearly between the
    closest ranks (``numpy.percentile``'s default, which vLLM uses)."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentile_key(q: float) -> str:
    """``99`` -> ``"p99"``, ``99.9`` -> ``"p99.9"`` (vLLM's spelling)."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q:g}"


def distribution(values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                 ) -> dict[str, float | None]:
    """Mean, median, population standard deviation (as ``numpy.std``, vLLM's) and the given
    percentiles of some values; every entry None when there are none."""
    # numpy sorts and subtracts (a run's inter-token latencies are millions of values); the sums
    # are math.fsum's, exactly rounded, so the order of the values changes nothing.
    arr = np.sort(np.asarray(values if isinstance(values, (list, tuple, np.ndarray))
                             else list(values), dtype=np.float64))
    xs = arr.tolist()
    out: dict[str, float | None] = {"mean": None, "median": None, "std": None}
    out.update({percentile_key(q): None for q in percentiles})
    if not xs:
        return out
    mean = math.fsum(xs) / len(xs)
    out["mean"] = mean
    out["median"] = percentile(xs, 50)
    deviations = arr - mean
    out["std"] = math.sqrt(math.fsum((deviations * deviations).tolist()) / len(xs))
    for q in percentiles:
        out[percentile_key(q)] = percentile(xs, q)
    return out


# ----------------------------------------------------------------------------- goodput
def parse_goodput(pairs: Iterable[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds), checked
    the way ``vllm bench serve --goodput`` checks them."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms):
            raise ValueError(f"--goodput {pair!r}: expected KEY:VALUE with a number of "
                             "milliseconds, e.g. ttft:200")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput {pair!r}: unknown metric {name!r}; use one of "
                             f"{', '.join(SLO_METRICS)}")
        if ms < 0:
            raise ValueError(f"--goodput {pair!r}: the objective must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A request is good when it succeeded and meets every given objective (ms, inclusive).
    As in vLLM, a one-token request's TPOT counts as 0."""
    if not record.ok:
        return False
    for name, limit_ms in slos.items():
        value = record.tpot if name == "tpot" else getattr(record, name)
        if value is None and name == "tpot":
            value = 0.0
        if value is None or value * MS_PER_S > limit_ms:
            return False
    return True


# ----------------------------------------------------------------------------- aggregation
def latency_values(records: Iterable[RequestRecord], metric: str) -> Sequence[float]:
    """Every observation of one latency metric over the successful records (ITL: every gap)."""
    ok = [r for r in records if r.ok]
    if metric == "itl":
        # Every record's chunk times in one array: its differences are the gaps (the same
        # subtractions as RequestRecord.itl), less those from one record's last to the next's first.
        times = [r.chunk_times_s for r in ok if len(r.chunk_times_s) > 1]
        if not times:
            return []
        sizes = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
        flat = np.fromiter(itertools.chain.from_iterable(times), dtype=np.float64,
                           count=int(sizes.sum()))
        return np.delete(np.diff(flat), np.cumsum(sizes)[:-1] - 1)
    return [v for r in ok if (v := getattr(r, metric)) is not None]


def summarize(records: Sequence[RequestRecord], duration: float, *,
              goodput: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              metrics: Sequence[str] = LATENCY_METRICS) -> dict[str, Any]:
    """Aggregate metrics of a run (or of one class of its requests) over ``duration`` seconds,
    under vLLM's key names. Throughputs of a subset are that subset's share of the run's rate.

    ``request_goodput`` is None without SLOs (vLLM's convention). ``prefix_cache_hit_rate``
    here is cached / prompt tokens of the successful requests (what they saw); a run's engine
    counters are reported next to it by the runner.
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "request_goodput": (rate(sum(meets_slos(r, goodput) for r in ok))
                            if goodput else None),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    for metric in metrics:
        stats = distribution(latency_values(ok, metric), percentiles)
        for stat, value in stats.items():
            out[f"{stat}_{metric}_ms"] = None if value is None else value * MS_PER_S
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out["cached_tokens"] = sum(cached) if cached else None
    out["prefix_cache_hit_rate"] = (sum(cached) / total_in if cached and total_in else None)
    preempt = [r.num_preemptions for r in ok if r.num_preemptions is not None]
    out["num_preemptions"] = sum(preempt) if preempt else None
    out["failed_reasons"] = dict(Counter(r.error for r in failed).most_common())
    return out


def group_records(records: Iterable[RequestRecord],
                  key: Callable[[RequestRecord], Any]) -> dict[str, list[RequestRecord]]:
    """Records by class (``str(key(record))``), classes sorted by their key."""
    groups: dict[Any, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return {str(k): groups[k] for k in sorted(groups, key=_class_order)}


def _class_order(key: Any) -> tuple[int, Any]:
    """Numbers in numeric order (priority -1, 0, 10), then names, then None (no tenant)."""
    if key is None:
        return (2, "")
    if isinstance(key, (int, float)):
        return (0, key)
    return (1, str(key))


def by_priority(records: Iterable[RequestRecord]) -> dict[str, list[RequestRecord]]:
    return group_records(records, lambda r: r.priority)


def by_tenant(records: Iterable[RequestRecord]) -> dict[str, list[RequestRecord]]:
    return group_records(records, lambda r: r.user)


def vllm_request_lists(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """The per-request lists of a ``vllm bench serve --save-result`` file (seconds, in workload
    order), so tools that read those files read ours."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.ok else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.e2el for r in records],
        "start_times": [r.arrival_s for r in records],
        "errors": [r.error or "" for r in records],
    }
