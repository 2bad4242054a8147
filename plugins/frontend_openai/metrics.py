"""``GET /metrics``: Prometheus metrics through prometheus-client.

Engine gauges and counters (running/waiting requests, KV-cache usage, prefix-cache hits,
preemptions, token counters) are read from the engine core at scrape time (one ``get_stats``
call between two steps), so they are exact and cost nothing while nobody scrapes. Latency
histograms are observed in this process as requests finish. Each server has its own
``CollectorRegistry``: nothing global, so several servers (or tests) never collide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corellm.engine.output_processor import RequestState

logger = logging.getLogger("corellm.server")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    def __init__(self, owner: EngineMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        labels = ["model_name"]
        value = [self.owner.model_name]
        alive = GaugeMetricFamily("corellm:engine_alive", "1 while the engine core answers, "
                                  "0 once it is dead or stuck.", labels=labels)
        alive.add_metric(value, 0.0 if self.owner.stats is None else 1.0)
        yield alive
        s = self.owner.stats
        if s is None:
            return

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("corellm:num_requests_running", "Requests in the running batch.",
                    s.num_running_reqs)
        yield gauge("corellm:num_requests_waiting", "Requests waiting (or preempted) for "
                    "admission.", s.num_waiting_reqs)
        used = s.kv_blocks_total - s.kv_blocks_free
        yield gauge("corellm:kv_cache_usage_perc", "Fraction of KV-cache blocks held by "
                    "requests (free cached blocks count as free).",
                    used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield gauge("corellm:kv_cache_blocks_total", "KV-cache blocks in the pool.",
                    s.kv_blocks_total)
        yield gauge("corellm:kv_cache_blocks_free", "KV-cache blocks an allocation could take.",
                    s.kv_blocks_free)
        yield gauge("corellm:prefix_cache_blocks", "Blocks findable in the prefix cache.",
                    s.kv_blocks_cached)
        yield counter("corellm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", s.prefix_cache_queries)
        yield counter("corellm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hits)
        yield counter("corellm:num_preemptions", "Requests preempted for KV-cache space.",
                      s.num_preemptions)
        yield counter("corellm:prompt_tokens", "Prompt tokens of admitted requests.",
                      s.num_prompt_tokens)
        yield counter("corellm:generation_tokens", "Tokens generated.",
                      s.num_generation_tokens)
        yield counter("corellm:engine_steps", "Engine steps run.", s.num_steps)


class EngineMetrics:
    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.stats: Any = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(self))
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("corellm:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("corellm:time_per_output_token_seconds",
                              "Mean time between generated tokens after the first, per request.",
                              labels, buckets=_TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("corellm:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("corellm:request_queue_time_seconds",
                               "Time from arrival until the engine first scheduled the request.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.success = Counter("corellm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=r)

    def observe_finished(self, states: list[RequestState]) -> None:
        for st in states:
            m = st.metrics
            if m.time_to_first_token is not None:
                self.ttft.observe(m.time_to_first_token)
            if m.time_per_output_token is not None:
                self.tpot.observe(m.time_per_output_token)
            if m.latency is not None:
                self.e2e.observe(m.latency)
            if m.queue_time is not None:
                self.queue.observe(max(m.queue_time, 0.0))
            for s in st.samples:
                self.success.labels(self.model_name, s.finish_reason or "unknown").inc()

    async def render(self) -> tuple[bytes, str]:
        try:
            self.stats = None if self.engine.is_dead else await self.engine.get_stats(timeout=5.0)
        except (asyncio.TimeoutError, TimeoutError, Exception) as exc:  # dead or stuck engine
            logger.warning("metrics: engine stats unavailable: %s", exc)
            self.stats = None
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
