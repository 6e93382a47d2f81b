"""The server's counters and their Prometheus exposition (``GET /metrics``).

:class:`ServerStats` is fed by the HTTP side (requests by endpoint and status) and by the jobs
on the engine thread (StepMetrics, results); :class:`StatsCollector` reads it at scrape time
(prometheus_client custom collector, one registry per server). Definitions are the engine's
(engine/metrics.py, colibri's PROF=1): hit rate = hits / (hits + misses) of demand lookups,
MB/token = bytes read / 1e6 per generated token, felt wait = seconds the compute thread waited
for expert reads.
"""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..events import StepMetrics


class ServerStats:
    """Thread-safe counters of one server. Units: tokens, bytes, seconds."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()   # (endpoint, status) -> n
        self.results: collections.Counter = collections.Counter()    # finish_reason -> n
        self.rejected = 0                  # 503: queue full
        self.prompt_tokens = 0
        self.prefill_tokens = 0            # prompt tokens computed (not reused from the KV prefix)
        self.completion_tokens = 0
        self.hits = self.misses = 0
        self.read_bytes = 0
        self.felt_wait_s = 0.0
        self.last: StepMetrics | None = None
        self.last_prefill_tokens = 0
        self.last_prompt_tokens = 0
        self.last_ttft_s = 0.0
        self.last_decode_tok_per_s = 0.0
        self.last_cancel_overrun = 0       # tokens generated after a disconnect set cancel (last one)
        self.max_cancel_overrun = 0

    def on_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1
            if status == 503:
                self.rejected += 1

    def on_step(self, m: StepMetrics) -> None:
        with self._lock:
            self.last = m
            self.hits += m.hits
            self.misses += m.misses
            self.read_bytes += m.demand_bytes + m.speculative_bytes
            self.felt_wait_s += m.felt_wait_s

    def on_result(self, job, result) -> None:
        with self._lock:
            self.results[result.finish_reason] += 1
            self.prompt_tokens += result.prompt_tokens if result.finished is not None else 0
            self.prefill_tokens += result.prefill_tokens
            self.completion_tokens += result.completion_tokens
            if result.finished is not None:
                self.last_prefill_tokens = result.prefill_tokens
                self.last_prompt_tokens = result.prompt_tokens
                self.last_ttft_s = result.finished.ttft_s
                self.last_decode_tok_per_s = result.finished.decode_tok_per_s
            if job.tokens_at_cancel is not None:
                self.last_cancel_overrun = max(0, job.tokens - job.tokens_at_cancel)
                self.max_cancel_overrun = max(self.max_cancel_overrun, self.last_cancel_overrun)

    def snapshot(self) -> tuple[dict, dict, StepMetrics | None, dict]:
        """(requests by (endpoint, status), generations by reason, last StepMetrics, totals),
        read consistently."""
        with self._lock:
            vals = dict(prompt=self.prompt_tokens, prefill=self.prefill_tokens,
                        completion=self.completion_tokens, hits=self.hits, misses=self.misses,
                        read=self.read_bytes, felt=self.felt_wait_s, rejected=self.rejected,
                        last_prefill=self.last_prefill_tokens, last_prompt=self.last_prompt_tokens,
                        ttft=self.last_ttft_s, tps=self.last_decode_tok_per_s,
                        overrun=self.last_cancel_overrun, max_overrun=self.max_cancel_overrun)
            return dict(self.requests), dict(self.results), self.last, vals

    def request_count(self, endpoint_prefix: str = "/v1/") -> int:
        """Requests answered on endpoints starting with ``endpoint_prefix`` (any status)."""
        with self._lock:
            return sum(n for (ep, _s), n in self.requests.items() if ep.startswith(endpoint_prefix))


class StatsCollector:
    """prometheus_client collector over a ServerStats and the job queue."""

    def __init__(self, stats: ServerStats, queue, model_name):
        self.stats, self.queue, self.model_name = stats, queue, model_name

    def collect(self):
        s, q = self.stats, self.queue
        requests, results, last, vals = s.snapshot()
        c = CounterMetricFamily("colibri_requests", "HTTP requests answered", labels=["endpoint", "status"])
        for (ep, st), n in sorted(requests.items()):
            c.add_metric([ep, str(st)], n)
        yield c
        c = CounterMetricFamily("colibri_generations", "generations ended, by finish reason", labels=["reason"])
        for r, n in sorted(results.items()):
            c.add_metric([r], n)
        yield c

        def counter(name, doc, v):
            return CounterMetricFamily(name, doc, value=v)

        def gauge(name, doc, v):
            return GaugeMetricFamily(name, doc, value=v)

        yield gauge("colibri_queue_depth", "requests waiting for the engine", q.depth)
        yield gauge("colibri_queue_capacity", "requests that may wait before 503", q.max_waiting)
        yield gauge("colibri_requests_running", "requests on the engine now (0 or 1)", 1 if q.busy else 0)
        yield counter("colibri_queue_rejected", "requests refused with 503 (queue full)", vals["rejected"])
        yield counter("colibri_prompt_tokens", "prompt tokens of finished generations", vals["prompt"])
        yield counter("colibri_prefill_tokens", "prompt tokens computed (not reused from the KV prefix)",
                      vals["prefill"])
        yield counter("colibri_completion_tokens", "generated tokens", vals["completion"])
        yield counter("colibri_expert_hits", "expert cache hits (demand lookups)", vals["hits"])
        yield counter("colibri_expert_misses", "expert cache misses (demand lookups)", vals["misses"])
        yield counter("colibri_expert_read_bytes", "bytes of experts read from the SSD while answering requests "
                      "(reads between requests, such as the idle fill, are not counted)", vals["read"])
        yield counter("colibri_felt_wait_seconds", "seconds the compute thread waited for expert reads",
                      vals["felt"])
        look = vals["hits"] + vals["misses"]
        yield gauge("colibri_expert_hit_rate", "hits / (hits + misses) since the server started",
                    vals["hits"] / look if look else 1.0)
        yield gauge("colibri_mb_per_token", "MB read from the SSD per generated token since the server started",
                    vals["read"] / 1e6 / vals["completion"] if vals["completion"] else 0.0)
        yield gauge("colibri_rss_bytes", "resident set size of the process at the last token",
                    last.rss_bytes if last else 0)
        yield gauge("colibri_ram_budget_bytes", "the engine's RAM budget", last.budget_bytes if last else 0)
        yield gauge("colibri_expert_cache_bytes", "bytes held by the expert cache at the last token",
                    last.cache_bytes if last else 0)
        yield gauge("colibri_decode_tokens_per_second", "decode speed of the last generation",
                    vals["tps"])
        yield gauge("colibri_ttft_seconds", "time to first token of the last generation", vals["ttft"])
        yield gauge("colibri_last_prompt_tokens", "prompt tokens of the last generation", vals["last_prompt"])
        yield gauge("colibri_last_prefill_tokens", "prompt tokens the last generation computed (the rest "
                    "came from the KV prefix of the previous one)", vals["last_prefill"])
        yield gauge("colibri_cancel_overrun_tokens", "tokens generated after the last client disconnect set "
                    "the cancel flag", vals["overrun"])
        yield gauge("colibri_cancel_overrun_tokens_max", "largest cancel overrun since the server started",
                    vals["max_overrun"])
        info = GaugeMetricFamily("colibri_model_info", "the model being served", labels=["model"])
        info.add_metric([self.model_name() or ""], 1)
        yield info


def exposition(stats: ServerStats, queue, model_name) -> bytes:
    """The Prometheus text format of the server's metrics (one registry per call)."""
    reg = CollectorRegistry()
    reg.register(StatsCollector(stats, queue, model_name))
    return generate_latest(reg)
