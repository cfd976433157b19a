"""Prometheus metrics of a serving engine (``GET /metrics``), named as vLLM names them with a ``deepinfer:`` prefix.

Request-level metrics (latencies, token counters, finished requests by reason) are observed from the engine
thread as outputs arrive; engine-level values (KV cache and state-slot usage, speculative decoding counters,
steps) are read from the engine's stats snapshot at scrape time. Each server has its own registry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deepinfer_npu.engine.outputs import RequestOutput

#: Latency buckets in seconds (TTFT / e2e: 1 ms to 10 min; inter-token: 1 ms to 10 s).
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Owns the registry. ``observe`` is the :class:`AsyncLLM` observer; ``bind`` attaches the engine whose
    snapshot the gauges read; ``render`` is the ``/metrics`` body."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no ``*_created`` series, as vLLM
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        reg = self.registry
        self.ttft = Histogram("deepinfer:time_to_first_token_seconds", "Time to first token.",
                              list(labels), buckets=REQUEST_BUCKETS, registry=reg).labels(**labels)
        self.itl = Histogram("deepinfer:inter_token_latency_seconds",
                             "Time between consecutive outputs of a request, per generated token.",
                             list(labels), buckets=TOKEN_BUCKETS, registry=reg).labels(**labels)
        self.e2e = Histogram("deepinfer:e2e_request_latency_seconds", "Arrival to finish.",
                             list(labels), buckets=REQUEST_BUCKETS, registry=reg).labels(**labels)
        self.prompt_tokens = Counter("deepinfer:prompt_tokens", "Prompt tokens of admitted requests.",
                                     list(labels), registry=reg).labels(**labels)
        self.generation_tokens = Counter("deepinfer:generation_tokens", "Generated tokens.",
                                         list(labels), registry=reg).labels(**labels)
        self.finished = Counter("deepinfer:request_success", "Finished requests by finish reason.",
                                [*labels, "finished_reason"], registry=reg)
        self._tokens_seen: dict[str, int] = {}
        self._llm = None
        reg.register(_EngineCollector(self))

    def bind(self, llm) -> None:
        self._llm = llm

    def observe(self, event: str, request_id: str, out: RequestOutput | None, times) -> None:
        if event == "added":
            self._tokens_seen[request_id] = 0
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - self._tokens_seen.get(request_id, 0)
        self._tokens_seen[request_id] = tokens
        if new > 0:
            self.generation_tokens.inc(new)
        if event == "first_token":
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.ttft.observe(times.first_token - times.arrival)
        elif new > 0 and times.last_output is not None:  # last_output: the previous output's time
            per_token = (time.monotonic() - times.last_output) / new
            for _ in range(new):
                self.itl.observe(per_token)
        if event == "finished":
            self._tokens_seen.pop(request_id, None)
            if times.first_token is None:  # finished before any output (aborted or ignored)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.e2e.observe(time.monotonic() - times.arrival)
            for c in out.outputs:
                self.finished.labels(**self.labels, finished_reason=c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        llm = self.metrics._llm
        if llm is None:
            return
        labels = list(self.metrics.labels)
        values = list(self.metrics.labels.values())
        stats = llm.stats

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            return c

        yield gauge("deepinfer:num_requests_running", "Requests that produced tokens and are not finished.",
                    llm.num_running)
        yield gauge("deepinfer:num_requests_waiting", "Requests waiting for their first token.", llm.num_waiting)
        yield gauge("deepinfer:kv_cache_usage_perc", "KV cache usage (1 = full).", stats.get("kv_usage", 0.0))
        yield gauge("deepinfer:state_slot_usage_perc", "Per-sequence state slot usage (1 = full).",
                    stats.get("state_slot_usage", 0.0))
        yield counter("deepinfer:num_preemptions", "Requests preempted for lack of KV blocks.",
                      stats.get("preemptions", 0))
        yield counter("deepinfer:engine_steps", "Engine steps run (prefill and decode).", stats.get("num_steps", 0))
        if "speculative_method" in stats:
            yield counter("deepinfer:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          stats.get("spec_draft_tokens", 0))
            yield counter("deepinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          stats.get("spec_accepted_tokens", 0))
            yield gauge("deepinfer:spec_decode_draft_acceptance_rate", "Accepted / verified draft tokens.",
                        stats.get("draft_acceptance_rate", 0.0))
            yield gauge("deepinfer:spec_decode_mean_accepted_length", "Tokens emitted per verified row.",
                        stats.get("mean_accepted_length", 0.0))
