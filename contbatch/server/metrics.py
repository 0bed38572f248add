"""Prometheus metrics, named after vLLM's (`vllm:` -> `contbatch:`) so dashboards carry over.

Each app has its own `CollectorRegistry`, so tests can build several servers in one process.
Request latencies are observed from the engine's result handler as outputs arrive; engine
state (running, waiting, KV usage, prefix cache, preemptions) is read from `manager.stats()`
at scrape time by a custom collector, so it is never stale and costs nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, so histograms are comparable across the two servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class EngineCollector(Collector):
    """Engine gauges and counters, read from `stats()` when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], num_blocks: int, model_name: str) -> None:
        self._stats = stats
        self._num_blocks = num_blocks
        self._labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(self._labels, value)
        return c

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        used = max(0, self._num_blocks - s["free_blocks"])
        yield self._gauge("contbatch:num_requests_running", "Requests (samples) in the engine's running set.",
                          s["running"])
        yield self._gauge("contbatch:num_requests_waiting", "Requests (samples) waiting to be scheduled.",
                          s["waiting"])
        yield self._gauge("contbatch:kv_cache_usage_perc",
                          "Share of KV blocks held by requests (1 = full); cached prefix blocks count as free.",
                          used / self._num_blocks if self._num_blocks else 0.0)
        yield self._gauge("contbatch:kv_cache_free_blocks", "KV blocks free or holding evictable prefix cache.",
                          s["free_blocks"])
        yield self._gauge("contbatch:kv_cache_cached_blocks", "Free KV blocks still holding a reusable prefix.",
                          s["cached_blocks"])
        yield self._counter("contbatch:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s["prefix_cache_queries"])
        yield self._counter("contbatch:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            s["prefix_cache_hits"])
        yield self._counter("contbatch:num_preemptions", "Requests preempted under KV pressure (soft resets + offloads).",
                            s["soft_resets"] + s["offloads"])
        yield self._counter("contbatch:num_soft_resets", "Preemptions that freed a request's KV to recompute it later.",
                            s["soft_resets"])
        yield self._counter("contbatch:num_offloads", "Preemptions that copied a request's KV to the CPU offload tier.",
                            s["offloads"])
        yield self._counter("contbatch:num_restores", "Offloaded requests whose KV was copied back.", s["restores"])
        yield self._counter("contbatch:engine_steps", "Engine steps (one forward pass each).", s["steps"])
        if "spec_decode_num_drafts" in s:  # speculative decoding is on (vLLM's names)
            yield self._counter("contbatch:spec_decode_num_drafts", "Verification runs with proposed tokens.",
                                s["spec_decode_num_drafts"])
            yield self._counter("contbatch:spec_decode_num_draft_tokens", "Proposed (draft) tokens verified.",
                                s["spec_decode_num_draft_tokens"])
            yield self._counter("contbatch:spec_decode_num_accepted_tokens", "Proposed tokens the target accepted.",
                                s["spec_decode_num_accepted_tokens"])
            yield self._gauge("contbatch:spec_decode_acceptance_rate", "Accepted / proposed tokens since start.",
                              s["spec_decode_acceptance_rate"])


class ServerMetrics:
    """Every metric of one app, in its own registry."""

    def __init__(self, stats: Callable[[], dict], num_blocks: int, model_name: str,
                 inflight: Callable[[], int]) -> None:
        disable_created_metrics()  # `_created` series double the output and no dashboard reads them
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("contbatch:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                         TTFT_BUCKETS)
        self.itl = hist("contbatch:inter_token_latency_seconds", "Time between consecutive generated tokens.",
                        ITL_BUCKETS)
        self.e2e = hist("contbatch:e2e_request_latency_seconds", "Time from arrival to the last sample's end.",
                        REQUEST_BUCKETS)
        self.queue = hist("contbatch:request_queue_time_seconds", "Time from arrival to first being scheduled.",
                          REQUEST_BUCKETS)
        self.prefill = hist("contbatch:request_prefill_time_seconds",
                            "Time from first being scheduled to the first token.", REQUEST_BUCKETS)
        self.decode = hist("contbatch:request_decode_time_seconds", "Time from the first token to the last.",
                           REQUEST_BUCKETS)
        self.req_prompt = hist("contbatch:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.req_gen = hist("contbatch:request_generation_tokens", "Generated tokens per request (all samples).",
                            TOKEN_BUCKETS)
        self.prompt_tokens = Counter("contbatch:prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("contbatch:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        self.cached_tokens = Counter("contbatch:prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                                     labels, registry=r).labels(model_name)
        self._success = Counter("contbatch:request_success", "Requests ended, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS.values():  # present from the start, at 0
            self._success.labels(model_name, reason)
        self.tool_calls = Counter("contbatch:tool_calls", "Tool calls returned (chat completions and Responses).",
                                  labels, registry=r).labels(model_name)
        self.tool_call_failures = Counter(
            "contbatch:tool_call_parse_failures",
            "Tool calls that did not parse (returned as content) or were cut off by the token limit.",
            labels, registry=r).labels(model_name)
        self._responses = Counter("contbatch:responses_requests", "POST /v1/responses requests accepted, by stream.",
                                  labels + ["stream"], registry=r)
        for stream in ("true", "false"):
            self._responses.labels(model_name, stream)
        self._stored = Gauge("contbatch:responses_stored", "Responses held by the in-memory response store.",
                             labels, registry=r).labels(model_name)
        inflight_gauge = Gauge("contbatch:num_http_requests_in_flight",
                               "HTTP requests being served (what a graceful shutdown waits for).", labels, registry=r)
        inflight_gauge.labels(model_name).set_function(lambda: float(inflight()))
        r.register(EngineCollector(stats, num_blocks, model_name))

    def request_ended(self, reason: str | None, e2e: float, prompt_tokens: int, generated: int) -> None:
        self._success.labels(self.model_name, FINISH_REASONS.get(reason or "error", "error")).inc()
        self.e2e.observe(max(0.0, e2e))
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(generated)

    def tool_calls_returned(self, calls: int, failures: int) -> None:
        self.tool_calls.inc(calls)
        self.tool_call_failures.inc(failures)

    def response_accepted(self, stream: bool) -> None:
        self._responses.labels(self.model_name, "true" if stream else "false").inc()

    def count_stored(self, count: Callable[[], int]) -> None:
        """`count()` is read at scrape time as `contbatch:responses_stored`."""
        self._stored.set_function(lambda: float(count()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
