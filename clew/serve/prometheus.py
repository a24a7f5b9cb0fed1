"""The server's Prometheus metrics, in a registry of its own (``GET /metrics``).

A registry per app rather than prometheus_client's global one: two servers in one process
(tests, a Ray replica beside other code) then never share or clash over counters. The
``model`` label is ``base`` or the adapter's name, and only names that resolved to a
served model get one (an unknown name counts under ``unknown``), so clients cannot grow
the label set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "clew_serve_requests",
            "Chat completion requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "clew_serve_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "clew_serve_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "clew_serve_prompt_tokens", "Prompt tokens of answered requests.", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "clew_serve_completion_tokens", "Tokens generated.", ["model"], registry=r
        )
        self.queue_depth = Gauge(
            "clew_serve_queue_depth", "Requests waiting to join a batch.", registry=r
        )
        self.running = Gauge(
            "clew_serve_running_sequences", "Sequences being generated now.", registry=r
        )
        self.batches = Counter("clew_serve_batches", "Engine batches opened.", registry=r)
        self.batch_rows = Histogram(
            "clew_serve_batch_rows",
            "Sequences in an engine batch when it opens.",
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.adapter_loads = Counter(
            "clew_serve_adapter_loads", "Adapters loaded into the model.", ["adapter"], registry=r
        )
        self.adapter_load_seconds = Histogram(
            "clew_serve_adapter_load_seconds",
            "Time to put a fetched adapter into the model.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_load_failures = Counter(
            "clew_serve_adapter_load_failures",
            "Adapters that could not be fetched or loaded.",
            registry=r,
        )
        self.adapter_evictions = Counter(
            "clew_serve_adapter_evictions",
            "Adapters evicted from the model (least recently used first).",
            ["adapter"],
            registry=r,
        )
        self.adapters_loaded = Gauge(
            "clew_serve_adapters_loaded", "Adapters held in the model now.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
