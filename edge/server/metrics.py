"""`edge serve`'s Prometheus metrics (GET /metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Metrics:
    """Prometheus metrics: histograms observed by the scheduler thread, the rest read from
    the scheduler's counters when scraped (``state``: the app.ServerState, whose scheduler is
    None until the model is loaded)."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("edge_time_to_first_token_seconds", "Time from request to first token",
                              buckets=buckets, registry=self.registry)
        self.tpot = Histogram("edge_time_per_output_token_seconds", "Time between generated tokens",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56),
                              registry=self.registry)
        self._state = state
        self.registry.register(self)

    def collect(self):
        sched = self._state.scheduler
        if sched is None:
            return
        s = sched.stats
        for name, doc, value in (("edge_prompt_tokens", "Prompt tokens received", s.prompt_tokens),
                                 ("edge_generation_tokens", "Tokens generated", s.generated_tokens),
                                 ("edge_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  s.cached_tokens),
                                 ("edge_requests_finished", "Requests finished", s.requests_finished),
                                 ("edge_draft_tokens", "Speculative decoding: drafted tokens verified",
                                  s.draft_tokens),
                                 ("edge_draft_accepted_tokens", "Speculative decoding: drafted tokens accepted",
                                  s.draft_accepted_tokens)):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("edge_draft_acceptance_rate",
                                "Speculative decoding: accepted / drafted tokens since start",
                                value=s.draft_accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0)
        running, waiting = sched.counts()
        yield GaugeMetricFamily("edge_requests_running", "Requests being generated", value=running)
        yield GaugeMetricFamily("edge_requests_waiting", "Requests waiting for a slot", value=waiting)
        groups = sched.kv.manager.stats().groups
        yield GaugeMetricFamily("edge_kv_blocks_used", "KV cache blocks held by running sequences",
                                value=sum(g.used for g in groups))
        yield GaugeMetricFamily("edge_kv_blocks_free", "KV cache blocks free (empty or holding a cached prefix)",
                                value=sum(g.free for g in groups))

    def observe(self, ttft=None, tpot=None):
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
