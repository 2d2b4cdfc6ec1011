"""`edge serve`'s Prometheus metrics (GET /metrics), at the three layers operators watch.

Engine: tokens (prompt, generated, from the prefix cache) and the prefix-cache hit ratio, KV
blocks and KV pool bytes in use, speculative drafts, process RSS. Queue: requests running and
waiting, queue-wait histogram. Request: TTFT, TPOT and end-to-end latency histograms, requests
by outcome (finished, client_error (4xx), rejected (503), cancelled (the client went away),
timed_out (408), error (5xx)). Per model (label ``model``) where a model is concerned.
"""
from __future__ import annotations

import resource
import sys

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OUTCOMES = ("finished", "client_error", "rejected", "cancelled", "timed_out", "error")


def outcome(status: int) -> str:
    """A response status as a request outcome (OUTCOMES)."""
    if status < 400:
        return "finished"
    if status == 408:
        return "timed_out"
    if status == 499:
        return "cancelled"
    if status == 503:
        return "rejected"
    return "client_error" if status < 500 or status == 501 else "error"   # 501: asked for what edge does not do


def rss_bytes() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes) of this process."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        now = peak
    return now, peak


class Metrics:
    """Prometheus metrics: histograms observed by the scheduler threads, requests counted by
    the app, the rest read from each loaded model's scheduler when scraped (``state``: the
    app.ServerState)."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("edge_time_to_first_token_seconds", "Time from request to first token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("edge_time_per_output_token_seconds", "Time between generated tokens", ["model"],
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                              registry=self.registry)
        self.queue = Histogram("edge_queue_wait_seconds", "Time a request waited for a sequence slot", ["model"],
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("edge_request_duration_seconds", "Time from a request's submission to its last token",
                             ["model"], buckets=LATENCY_BUCKETS + (120, 300), registry=self.registry)
        self.requests = Counter("edge_requests", "HTTP requests to the generation routes by outcome",
                                ["model", "outcome"], registry=self.registry)
        self._state = state
        self.registry.register(self)

    def collect(self):
        state = self._state
        slots = [s for s in state.pool.loaded() if s.scheduler is not None]
        fams = {name: CounterMetricFamily(name, doc, labels=["model"]) for name, doc in (
            ("edge_prompt_tokens", "Prompt tokens received"),
            ("edge_generation_tokens", "Tokens generated"),
            ("edge_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
            ("edge_requests_finished", "Requests finished"),
            ("edge_draft_tokens", "Speculative decoding: drafted tokens verified"),
            ("edge_draft_accepted_tokens", "Speculative decoding: drafted tokens accepted"))}
        gauges = {name: GaugeMetricFamily(name, doc, labels=["model"]) for name, doc in (
            ("edge_draft_acceptance_rate", "Speculative decoding: accepted / drafted tokens since start"),
            ("edge_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache / prompt tokens"),
            ("edge_requests_running", "Requests being generated"),
            ("edge_requests_waiting", "Requests waiting for a slot"),
            ("edge_kv_blocks_used", "KV cache blocks held by running sequences"),
            ("edge_kv_blocks_free", "KV cache blocks free (empty or holding a cached prefix)"),
            ("edge_kv_used_bytes", "KV cache bytes held by running sequences"),
            ("edge_kv_pool_bytes", "KV cache pool size in bytes"))}
        for slot in slots:
            sched, m = slot.scheduler, [slot.name]
            s = sched.stats
            for name, value in (("edge_prompt_tokens", s.prompt_tokens), ("edge_generation_tokens", s.generated_tokens),
                                ("edge_prefix_cache_hit_tokens", s.cached_tokens),
                                ("edge_requests_finished", s.requests_finished),
                                ("edge_draft_tokens", s.draft_tokens),
                                ("edge_draft_accepted_tokens", s.draft_accepted_tokens)):
                fams[name].add_metric(m, value)
            running, waiting = sched.counts()
            groups = sched.kv.manager.stats().groups
            used = sum(g.used for g in groups)
            total = sum(g.used + g.free for g in groups)
            pool = int(getattr(sched.kv, "nbytes", 0) or 0)
            for name, value in (
                    ("edge_draft_acceptance_rate", s.draft_accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0),
                    ("edge_prefix_cache_hit_ratio", s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0),
                    ("edge_requests_running", running), ("edge_requests_waiting", waiting),
                    ("edge_kv_blocks_used", used), ("edge_kv_blocks_free", sum(g.free for g in groups)),
                    ("edge_kv_used_bytes", pool * used // total if total else 0), ("edge_kv_pool_bytes", pool)):
                gauges[name].add_metric(m, value)
        yield from fams.values()
        yield from gauges.values()
        loaded = GaugeMetricFamily("edge_model_loaded", "1 for each model in memory", labels=["model"])
        for slot in slots:
            loaded.add_metric([slot.name], 1)
        yield loaded
        yield CounterMetricFamily("edge_models_unloaded", "Models unloaded (keep-alive, room, /models/unload)",
                                  value=state.pool.unloaded)
        now, peak = rss_bytes()
        yield GaugeMetricFamily("edge_process_resident_bytes", "Resident memory of the server process", value=now)
        yield GaugeMetricFamily("edge_process_peak_resident_bytes", "Peak resident memory of the server process",
                                value=peak)

    def add_model(self, model: str) -> None:
        """Start the model's histograms at zero (a scrape shows them before its first request)."""
        for h in (self.ttft, self.tpot, self.queue, self.e2e):
            h.labels(model)

    def observe(self, model: str, ttft=None, tpot=None, queue=None, e2e=None):
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if tpot is not None:
            self.tpot.labels(model).observe(tpot)
        if queue is not None:
            self.queue.labels(model).observe(queue)
        if e2e is not None:
            self.e2e.labels(model).observe(e2e)

    def count(self, model: str, status: int) -> None:
        self.requests.labels(model or "", outcome(status)).inc()
