"""``GET /metrics``: Prometheus metrics through prometheus-client.

Engine state comes from the StepStats stream (the same records a ``corellm_step_finished``
plugin and ``corellm bench`` see); request latencies are observed where the client receives
tokens.

- Engine gauges and counters (running/waiting requests, KV-cache usage, prefix-cache hits,
  preemptions, token and step counters) are the latest ``StepStats`` record's cumulative
  snapshot. The engine core sends one after every step that scheduled work and one after each
  abort or prefix-cache reset between steps, so the snapshot is never behind the engine (a
  request just added shows at the step that follows, at once on a running engine). The records
  reach ``EngineMetrics.on_stats`` through ``AsyncLLM.add_stats_listener``, on the event loop,
  with the outputs: a scrape reads the snapshot and asks the engine nothing of its state.
- Before the first record (a fresh server), the snapshot is seeded once at start-up from one
  ``get_stats`` call (``EngineMetrics.start``, awaited by the server before it accepts
  connections; an app built without it seeds at its first scrape instead). A record that
  arrived first wins over the seed.
- The tokens-per-step histogram (``iteration_tokens_total``) is observed from each step record.
- Liveness is checked at every scrape, cheaply: ``engine.is_dead`` (the process is gone or its
  loop failed), then ``engine.check_health`` (one ping through the busy loop, answered between
  two steps, bounded by ``frontend.health_timeout_s``, as ``/health``). A silent stream cannot
  tell an idle engine from a stuck one, so the ping is what makes ``corellm:engine_alive`` 0
  for a stuck loop. While the engine is dead or stuck, its gauges and counters are left out
  rather than shown stale (in both naming modes).
- Per-request latency histograms (TTFT, TPOT, end-to-end, queue time, and vLLM's prefill,
  decode, inference and inter-token times) stay observed in this process, from the request
  states that ``AsyncLLM.finished_callbacks`` reports (``observe_finished``): they measure what
  the client sees (``n`` > 1 aggregated, gaps between token arrivals, tokenization included).
- Response sizes (``corellm:response_bytes``, corellm naming only: vLLM has no counterpart) are
  the body bytes each ``/v1/completions`` and ``/v1/chat/completions`` response sends, observed
  where they are written (``count_response``): a stream's server-sent events as Starlette sends
  them, its error event and ``[DONE]`` included, and what a client that left mid-stream was sent
  until then; a JSON answer (or error) whole. One request's ``n`` and ``top_logprobs`` can make
  hundreds of MB of a small body: the buckets reach 1 GiB.

Each server has its own ``CollectorRegistry``: nothing global, so several servers (or tests)
never collide.

``frontend.metrics_prefix: vllm`` names every metric as vLLM's V1 engine does (``vllm:*``, labels
``model_name`` and ``engine``), so dashboards written for vLLM work unchanged. Only metrics with
an honest counterpart here are exposed; corellm-only ones are left out in that mode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corellm.engine.output_processor import RequestState
from corellm.outputs import EngineStats, SchedulerStats, StepStats

from .streaming import _EventStream

PREFIXES = ("corellm", "vllm")
# vLLM's label names, and the value of its "engine" label (corellm runs one engine core).
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"

logger = logging.getLogger("corellm.server")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
# Bytes of one response: powers of 4 from 1 KiB to 1 GiB (a few chunks to n * top_logprobs
# streams of hundreds of MB).
_BYTE_BUCKETS = tuple(1024 * 4 ** k for k in range(11))
# vLLM's buckets of vllm:iteration_tokens_total (tokens scheduled in one engine step).
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _iteration_buckets(max_step_tokens: int | None) -> list[int]:
    """vLLM's tokens-per-step buckets, up to the first that holds the largest possible step
    (``scheduler.max_num_batched_tokens``): the ones above it could never be reached."""
    buckets = []
    for b in _ITERATION_BUCKETS:
        buckets.append(b)
        if max_step_tokens is not None and b >= max_step_tokens:
            break
    return buckets


class _Part:
    """One engine's view on /metrics: the latest snapshot of its StepStats stream and its
    liveness at the last scrape. A server has one; a data-parallel server one per replica
    (``labels``: its replica label values)."""

    def __init__(self, engine: Any, labels: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.labels = labels
        # (scheduler snapshot, engine steps so far) of the latest StepStats record (or of the
        # start-up seed); replaced as a whole, so a reader never sees half of an update.
        self.snapshot: tuple[SchedulerStats, int] | None = None
        self.snapshot_time = time.time()
        # The engine's liveness at the last scrape (is_dead, then a ping through its loop).
        self.alive = False
        # The engine object the snapshot is of (a replica's changes when it restarts).
        self.seen: Any = getattr(engine, "engine", engine) if hasattr(engine, "rank") \
            else engine

    def on_stats(self, stats: StepStats) -> None:
        self.snapshot, self.snapshot_time = (stats.scheduler, stats.step), time.time()


class _EngineCollector(Collector):
    def __init__(self, owner: EngineMetrics) -> None:
        self.owner = owner

    def _family(self, cls: type, name: str, doc: str, labels: list[str], value: list[str],
                get: Any, parts: list[_Part]) -> Any:
        """A family with one sample per part: ``get(snapshot)``."""
        f = cls(name, doc, labels=labels + list(self.owner.part_labels))
        for part in parts:
            f.add_metric(value + list(part.labels), get(part.snapshot[0], part.snapshot[1]))
        return f

    def collect(self) -> Iterator[Any]:
        if self.owner.prefix == "vllm":
            yield from self._collect_vllm()
            return
        labels = ["model_name"]
        value = [self.owner.model_name]
        extra = list(self.owner.part_labels)
        alive = GaugeMetricFamily("corellm:engine_alive", "1 while the engine core answers, "
                                  "0 once it is dead or stuck.", labels=labels + extra)
        for part in self.owner.parts:
            alive.add_metric(value + list(part.labels), 1.0 if part.alive else 0.0)
        yield alive
        # no stale gauges for a dead engine
        parts = [p for p in self.owner.parts if p.alive and p.snapshot is not None]
        if not parts:
            return

        def gauge(name: str, doc: str, get: Any) -> GaugeMetricFamily:
            return self._family(GaugeMetricFamily, name, doc, labels, value, get, parts)

        def counter(name: str, doc: str, get: Any) -> CounterMetricFamily:
            return self._family(CounterMetricFamily, name, doc, labels, value, get, parts)

        yield gauge("corellm:num_requests_running", "Requests in the running batch.",
                    lambda s, n: s.num_running_reqs)
        yield gauge("corellm:num_requests_waiting", "Requests waiting (or preempted) for "
                    "admission.", lambda s, n: s.num_waiting_reqs)
        yield gauge("corellm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by "
                    "requests (free cached blocks count as free).",
                    lambda s, n: (s.kv_blocks_total - s.kv_blocks_free) / s.kv_blocks_total
                    if s.kv_blocks_total else 0.0)
        yield gauge("corellm:kv_cache_blocks_total", "KV-cache blocks in the pool.",
                    lambda s, n: s.kv_blocks_total)
        yield gauge("corellm:kv_cache_blocks_free", "KV-cache blocks an allocation could take.",
                    lambda s, n: s.kv_blocks_free)
        yield gauge("corellm:prefix_cache_blocks", "Blocks findable in the prefix cache.",
                    lambda s, n: s.kv_blocks_cached)
        yield counter("corellm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", lambda s, n: s.prefix_cache_queries)
        yield counter("corellm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      lambda s, n: s.prefix_cache_hits)
        yield counter("corellm:num_preemptions", "Requests preempted for KV-cache space.",
                      lambda s, n: s.num_preemptions)
        yield counter("corellm:prompt_tokens", "Prompt tokens of admitted requests.",
                      lambda s, n: s.num_prompt_tokens)
        yield counter("corellm:generation_tokens", "Tokens generated.",
                      lambda s, n: s.num_generation_tokens)
        yield counter("corellm:engine_steps", "Engine steps run.", lambda s, n: n)
        if self.owner.max_loras:
            for state in ("running", "waiting"):
                g = GaugeMetricFamily(f"corellm:lora_requests_{state}", f"Requests {state} per "
                                      "LoRA adapter.", labels=["model_name", "lora_name", *extra])
                for part in parts:
                    for name, k in getattr(part.snapshot[0], f"{state}_lora_adapters").items():
                        g.add_metric([self.owner.model_name, name, *part.labels], k)
                yield g
            yield self._lora_info("corellm:lora_requests_info", parts)

    def _lora_info(self, name: str, parts: list[_Part]) -> GaugeMetricFamily:
        """vLLM's ``lora_requests_info``: the adapters running and waiting as labels (names,
        comma-separated) and ``max_lora``; the value is the time of the snapshot."""
        info = GaugeMetricFamily(name, "Running and waiting LoRA adapters (labels); the value "
                                 "is the time of the snapshot.",
                                 labels=["max_lora", "running_lora_adapters",
                                         "waiting_lora_adapters", *self.owner.part_labels])
        for part in parts:
            s = part.snapshot[0]
            info.add_metric([str(self.owner.max_loras), ",".join(sorted(s.running_lora_adapters)),
                             ",".join(sorted(s.waiting_lora_adapters)), *part.labels],
                            part.snapshot_time)
        return info

    def _collect_vllm(self) -> Iterator[Any]:
        # dead or stuck: no stale gauges
        parts = [p for p in self.owner.parts if p.alive and p.snapshot is not None]
        if not parts:
            return
        labels = list(VLLM_LABELS)

        def family(cls: type, name: str, doc: str, get: Any) -> Any:
            f = cls(name, doc, labels=labels)
            for part in parts:      # vLLM's "engine" label: the data-parallel rank
                f.add_metric([self.owner.model_name, part.labels[0] if part.labels
                              else VLLM_ENGINE], get(part.snapshot[0]))
            return f

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "vllm:num_requests_running", "Requests in the running batch.",
                     lambda s: s.num_running_reqs)
        yield family(g, "vllm:num_requests_waiting", "Requests waiting (or preempted) for "
                     "admission.", lambda s: s.num_waiting_reqs)
        yield family(g, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by "
                     "requests; 1 means full.",
                     lambda s: (s.kv_blocks_total - s.kv_blocks_free) / s.kv_blocks_total
                     if s.kv_blocks_total else 0.0)
        yield family(c, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                     "cache.", lambda s: s.prefix_cache_queries)
        yield family(c, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s: s.prefix_cache_hits)
        yield family(c, "vllm:num_preemptions", "Requests preempted for KV-cache space.",
                     lambda s: s.num_preemptions)
        yield family(c, "vllm:prompt_tokens", "Prompt tokens of admitted requests.",
                     lambda s: s.num_prompt_tokens)
        yield family(c, "vllm:generation_tokens", "Tokens generated.",
                     lambda s: s.num_generation_tokens)
        if self.owner.max_loras:
            info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA "
                                     "adapters (labels); the value is the time of the snapshot.",
                                     labels=["max_lora", "running_lora_adapters",
                                             "waiting_lora_adapters"])
            for part in parts[:1]:
                s = part.snapshot[0]
                info.add_metric([str(self.owner.max_loras),
                                 ",".join(sorted(s.running_lora_adapters)),
                                 ",".join(sorted(s.waiting_lora_adapters))], part.snapshot_time)
            yield info


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len``: buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class EngineMetrics:
    """One server's metrics. ``engine`` is the server's ``AsyncLLM`` (or anything with its
    ``add_stats_listener``, ``get_stats``, ``check_health``, ``is_dead`` and ``model_info``).
    ``max_step_tokens`` caps the tokens-per-step buckets (default: the engine's
    ``scheduler.max_num_batched_tokens``)."""

    def __init__(self, engine: Any, model_name: str, prefix: str = "corellm",
                 max_model_len: int | None = None, *, health_timeout_s: float = 5.0,
                 max_step_tokens: int | None = None) -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix
        self.health_timeout_s = health_timeout_s
        # A data-parallel server (an EngineGroup): one part per replica, labelled with it (and
        # its arm, in an A/B split), and per-arm request histograms.
        replicas = getattr(engine, "replicas", None)
        self.arm_names = sorted({r.arm for r in replicas if r.arm}) if replicas else []
        if replicas:
            self.part_labels: tuple[str, ...] = ("replica", "arm") if self.arm_names \
                else ("replica",)
            self.parts = [_Part(rep, (str(rep.index), rep.arm) if self.arm_names
                                else (str(rep.index),)) for rep in replicas]
        else:
            self.part_labels = ()
            self.parts = [_Part(engine)]
        lora = getattr(getattr(engine, "config", None), "lora", None)
        self.max_loras = lora.max_loras if lora is not None and lora.enable else 0
        if max_step_tokens is None:
            max_step_tokens = getattr(getattr(getattr(engine, "config", None), "scheduler", None),
                                      "max_num_batched_tokens", None)
        self._kids: dict[str | None, dict[str, Any]] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(self))
        if prefix == "vllm":
            if max_model_len is None:
                max_model_len = engine.model_info.max_model_len
            self._init_vllm(max_model_len, max_step_tokens)
        else:
            self._init_corellm(max_step_tokens)
        if replicas:
            engine.add_replica_stats_listener(
                lambda rep, stats: self._on_part_stats(self.parts[rep.index], stats))
        else:
            engine.add_stats_listener(self.on_stats)

    # The one engine's (a single-engine server's) snapshot and liveness.
    @property
    def snapshot(self) -> tuple[SchedulerStats, int] | None:
        return self.parts[0].snapshot

    @property
    def alive(self) -> bool:
        return all(p.alive for p in self.parts)

    def attach_finished(self, engine: Any) -> None:
        """Observe the requests ``engine`` ends (per arm for an A/B group, per replica in
        vLLM's naming)."""
        if getattr(engine, "replicas", None):
            engine.replica_finished_callbacks.append(
                lambda rep, states: self.observe_finished(states, rep.arm or None,
                                                          str(rep.index)))
        else:
            engine.finished_callbacks.append(self.observe_finished)

    def _init_corellm(self, max_step_tokens: int | None) -> None:
        model_name = self.model_name
        labels = ["model_name"]
        # An A/B server's request histograms and counters carry the arm.
        arm = ["arm"] if self.arm_names else []
        r = self.registry
        self._ttft = Histogram("corellm:time_to_first_token_seconds",
                               "Time from arrival to the first generated token.", labels + arm,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._tpot = Histogram("corellm:time_per_output_token_seconds",
                               "Mean time between generated tokens after the first, per "
                               "request.", labels + arm, buckets=_TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("corellm:e2e_request_latency_seconds",
                              "Time from arrival to the last token.", labels + arm,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._queue = Histogram("corellm:request_queue_time_seconds",
                                "Time from arrival until the engine first scheduled the "
                                "request.", labels + arm, buckets=_LATENCY_BUCKETS, registry=r)
        self._success = Counter("corellm:request_success", "Finished samples by finish reason "
                                "(abort: ended before finishing).",
                                ["model_name", "finished_reason", *arm], registry=r)
        self._aborted = Counter("corellm:request_aborted", "Requests ended before they "
                                "finished, by reason (client_disconnected, shutdown, ...).",
                                ["model_name", "reason", *arm], registry=r)
        for name in self.arm_names or [None]:          # present (at 0) before any request
            self._for_arm(name)
        self.iteration_tokens = Histogram(
            "corellm:iteration_tokens_total", "Tokens scheduled in one engine step (prefill and "
            "decode together), per step that scheduled work.", labels,
            buckets=_iteration_buckets(max_step_tokens), registry=r).labels(model_name)
        # stream="true": server-sent events; "false": one JSON body (the answer, or an error).
        response_bytes = Histogram(
            "corellm:response_bytes", "Body bytes sent for one /v1/completions or "
            "/v1/chat/completions request: server-sent events (stream true) as written, until "
            "[DONE] or the client left; a JSON body (stream false) whole.",
            ["model_name", "stream"], buckets=_BYTE_BUCKETS, registry=r)
        self.response_bytes = {stream: response_bytes.labels(model_name, str(stream).lower())
                               for stream in (True, False)}    # both present (at 0) at once

    # vLLM's request histograms, by name: (description, buckets' kind).
    _VLLM_HISTS = {
        "ttft": ("vllm:time_to_first_token_seconds",
                 "Time from arrival to the first generated token.", "lat"),
        "e2e": ("vllm:e2e_request_latency_seconds",
                "Time from arrival until the request finished.", "lat"),
        "queue": ("vllm:request_queue_time_seconds",
                  "Time from arrival until the engine first scheduled the request.", "lat"),
        "prefill": ("vllm:request_prefill_time_seconds",
                    "Time from first scheduled to the first generated token.", "lat"),
        "decode": ("vllm:request_decode_time_seconds",
                   "Time from the first generated token to the last.", "lat"),
        "inference": ("vllm:request_inference_time_seconds",
                      "Time from first scheduled to the last generated token.", "lat"),
        "tpot": ("vllm:request_time_per_output_token_seconds",
                 "Per request: decode time / (generated tokens - 1); 0 for requests of one "
                 "token.", "tpot"),
        "itl": ("vllm:inter_token_latency_seconds",
                "Time between consecutive arrivals of a request's new tokens.", "tpot"),
        "prompt_tokens": ("vllm:request_prompt_tokens", "Prompt tokens, per finished sample.",
                          "tokens"),
        "gen_tokens": ("vllm:request_generation_tokens",
                       "Generated tokens, per finished sample.", "tokens"),
        "max_gen_tokens": ("vllm:request_max_num_generation_tokens",
                           "Generated tokens of the longest of a request's n samples.",
                           "tokens"),
        "iteration_tokens": ("vllm:iteration_tokens_total",
                             "Histogram of number of tokens per engine_step.", "steps"),
    }

    def _init_vllm(self, max_model_len: int, max_step_tokens: int | None) -> None:
        """vLLM's histograms and counters, labelled (model_name, engine): the engine is the
        replica (vLLM's data-parallel rank), "0" for one engine."""
        r, labels = self.registry, list(VLLM_LABELS)
        buckets = {"lat": _LATENCY_BUCKETS, "tpot": _TPOT_BUCKETS,
                   "tokens": _token_buckets(max_model_len),
                   "steps": _iteration_buckets(max_step_tokens)}
        self._v_hists = {key: Histogram(name, doc, labels, buckets=buckets[kind], registry=r)
                         for key, (name, doc, kind) in self._VLLM_HISTS.items()}
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 [*labels, "finished_reason"], registry=r)
        self._v_kids: dict[str, dict[str, Any]] = {}
        for part in self.parts:       # present (at 0) before the first request
            engine = self._vllm_engine(part)
            self._vllm(engine)
            for reason in ("stop", "length", "abort"):
                self.v_success.labels(self.model_name, engine, reason)

    @staticmethod
    def _vllm_engine(part: _Part) -> str:
        return part.labels[0] if part.labels else VLLM_ENGINE

    def _vllm(self, engine: str) -> dict[str, Any]:
        """vLLM's histograms' children for one engine label."""
        kids = self._v_kids.get(engine)
        if kids is None:
            kids = self._v_kids[engine] = {key: h.labels(self.model_name, engine)
                                           for key, h in self._v_hists.items()}
        return kids

    # ------------------------------------------------------------------ the StepStats stream
    def on_stats(self, stats: StepStats) -> None:
        """A record from the engine core (a stats listener, called on the event loop): keep
        its snapshot; a step that scheduled work is one observation of tokens per step."""
        self._on_part_stats(self.parts[0], stats)

    def _on_part_stats(self, part: _Part, stats: StepStats) -> None:
        part.on_stats(stats)
        if stats.kind == "step":
            if self.prefix == "vllm":
                self._vllm(self._vllm_engine(part))["iteration_tokens"].observe(
                    stats.num_scheduled_tokens)
            else:
                self.iteration_tokens.observe(stats.num_scheduled_tokens)

    @staticmethod
    def _engine_of(part: _Part) -> Any:
        """The part's engine now (a replica's changes when it is restarted), or None."""
        return part.engine.engine if hasattr(part.engine, "rank") else part.engine

    async def start(self) -> None:
        """Seed each snapshot with one ``get_stats`` call, so the gauges are right before the
        engine's first record (a fresh server that has run nothing). No-op once a record or a
        seed is there; a failure is logged and leaves the seeding to the next scrape."""
        for part in self.parts:
            engine = self._engine_of(part)
            if part.snapshot is not None or engine is None or engine.is_dead:
                continue
            try:
                stats: EngineStats = await engine.get_stats(timeout=self.health_timeout_s)
            except Exception as exc:
                logger.warning("metrics: could not read the engine's initial stats: %s", exc)
                continue
            if part.snapshot is None:   # else a record came meanwhile: it wins (the next
                part.snapshot = (stats, stats.num_steps)  # step's record follows if it lags)
                part.snapshot_time = time.time()

    async def _check_alive(self, part: _Part) -> bool:
        engine = self._engine_of(part)
        if engine is not part.seen:      # a replica restarted: its old snapshot is not its own
            part.seen, part.snapshot = engine, None
        if engine is None or engine.is_dead:
            return False
        try:
            await engine.check_health(self.health_timeout_s)
        except Exception as exc:       # dead, or its loop did not answer in time (stuck)
            logger.warning("metrics: engine unavailable: %s", exc)
            return False
        return True

    # ------------------------------------------------------------------ request latencies
    def _for_arm(self, arm: str | None) -> dict[str, Any]:
        """The request histograms' and counters' children for an arm (None: no A/B split)."""
        kids = self._kids.get(arm)
        if kids is None:
            value = [self.model_name] + ([arm] if self.arm_names else [])
            kids = self._kids[arm] = {name: getattr(self, f"_{name}").labels(*value)
                                      for name in ("ttft", "tpot", "e2e", "queue")}
        return kids

    def _counter(self, counter: Any, label: str, arm: str | None) -> Any:
        return counter.labels(self.model_name, label, *([arm or ""] if self.arm_names else []))

    def observe_finished(self, states: list[RequestState], arm: str | None = None,
                         replica: str = VLLM_ENGINE) -> None:
        """Requests that ended: finished ones, and aborted ones (counted, not timed: the time
        until a client gave up is not a latency of the server). ``arm``: the A/B arm that
        served them; ``replica``: the replica (vLLM's ``engine`` label)."""
        if self.prefix == "vllm":
            for st in states:
                if st.abort_reason is not None:
                    for s in st.samples:
                        self.v_success.labels(self.model_name, replica,
                                              s.finish_reason or "abort").inc()
                else:
                    self._observe_vllm(st, replica)
            return
        kids = self._for_arm(arm if self.arm_names else None)
        for st in states:
            if st.abort_reason is not None:
                self._counter(self._aborted, st.abort_reason, arm).inc()
                for s in st.samples:
                    self._counter(self._success, s.finish_reason or "abort", arm).inc()
                continue
            m = st.metrics
            if m.time_to_first_token is not None:
                kids["ttft"].observe(m.time_to_first_token)
            if m.time_per_output_token is not None:
                kids["tpot"].observe(m.time_per_output_token)
            if m.latency is not None:
                kids["e2e"].observe(m.latency)
            if m.queue_time is not None:
                kids["queue"].observe(max(m.queue_time, 0.0))
            for s in st.samples:
                self._counter(self._success, s.finish_reason or "unknown", arm).inc()

    def _observe_vllm(self, st: RequestState, engine: str) -> None:
        """vLLM's per-request histograms from the request's timestamps. Counts are per sample,
        as vLLM counts each of n samples; corellm keeps one set of timestamps per request, so the
        timings are observed once per request (identical to vLLM for n = 1)."""
        m, h = st.metrics, self._vllm(engine)
        for s in st.samples:
            self.v_success.labels(self.model_name, engine, s.finish_reason or "unknown").inc()
            h["prompt_tokens"].observe(len(st.prompt_token_ids))
            h["gen_tokens"].observe(len(s.token_ids))
        h["max_gen_tokens"].observe(max(len(s.token_ids) for s in st.samples))
        if m.latency is not None:
            h["e2e"].observe(max(m.latency, 0.0))
        if m.time_to_first_token is not None:
            h["ttft"].observe(max(m.time_to_first_token, 0.0))
        sched, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if sched is not None:
            h["queue"].observe(max(sched - m.arrival_time, 0.0))
        if first is not None and last is not None:
            if sched is not None:
                h["prefill"].observe(max(first - sched, 0.0))
                h["inference"].observe(max(last - sched, 0.0))
            h["decode"].observe(max(last - first, 0.0))
            for gap in m.inter_token_latencies:
                h["itl"].observe(gap)
            if len(st.samples) == 1:       # n > 1: tokens of parallel samples interleave
                k = m.num_generation_tokens
                h["tpot"].observe(max(last - first, 0.0) / (k - 1) if k > 1 else 0.0)

    # ------------------------------------------------------------------ response sizes
    def count_response(self, response: Response) -> Response:
        """``response`` (of a completions route), its body bytes observed in
        ``corellm:response_bytes``: an event stream's as it sends them (``on_sent``, once it
        ends, however it ends: a runaway stream is only seen in full when it does), any other
        body at once, whole (Starlette sends it in one message). A client that left before the
        answer gets a bodiless 499: 0 bytes. Nothing in vLLM's naming, which has no such
        metric."""
        if self.prefix == "vllm":
            return response
        if isinstance(response, _EventStream):
            response.on_sent = self.response_bytes[True].observe
        else:
            self.response_bytes[False].observe(len(response.body))
        return response

    async def render(self) -> tuple[bytes, str]:
        """The scrape: a liveness check of every engine, then the registry as it stands (no
        stats call, but the one-time seed if ``start`` was never awaited or failed)."""
        alive = await asyncio.gather(*(self._check_alive(part) for part in self.parts))
        if any(ok and part.snapshot is None for ok, part in zip(alive, self.parts)):
            await self.start()
        for ok, part in zip(alive, self.parts):
            part.alive = ok            # no await from here to the end of the collection
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
