"""Prometheus metrics, one view across the service's processes: each process (engine, front-ends) counts into
prometheus_client's multiprocess files in the run directory (`PROMETHEUS_MULTIPROC_DIR`, set by the supervisor),
and any front-end's /metrics adds them up. The front-ends count the requests, the engine the batches and tokens.
Without that directory (a process of its own, as in some tests) the metrics are the process's, in a registry of
their own."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
MODEL_LABELS = ("lm", "preset", "vocab_size", "state_numel_per_position", "ngram", "device", "torch_threads")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("smallstate_requests", "HTTP requests by route, method and status.",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("smallstate_request_duration_seconds", "HTTP request latency by route and status.",
                                 ["route", "status"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_progress = Gauge("smallstate_requests_in_progress", "HTTP requests being served, by route.",
                                 ["route"], registry=r, multiprocess_mode="livesum")
        self.queue_depth = Gauge("smallstate_queue_depth", "Requests waiting for the worker.", registry=r,
                                 multiprocess_mode="livesum")
        self.batch_requests = Histogram("smallstate_batch_requests", "Requests merged into one worker batch.",
                                        buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("smallstate_batch_tokens", "Token cost (unique prefixes + lattice arcs) of "
                                      "one worker batch.", buckets=TOKEN_BUCKETS, registry=r)
        self.batch_seconds = Histogram("smallstate_batch_compute_seconds", "Worker time per batch.",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("smallstate_tokens", "Neural LM tokens: kind=scored (words + </s>) or computed "
                              "(unique prefixes, lattice steps).", ["kind"], registry=r)
        self.tokens_per_second = Gauge("smallstate_tokens_per_second", "Tokens scored per second of worker time, "
                                       "last batch.", registry=r, multiprocess_mode="livemostrecent")
        self.ready = Gauge("smallstate_ready", "1 when the model is loaded and warmed up and the server is not "
                           "draining (every process of it).", registry=r, multiprocess_mode="livemin")
        self.model = Gauge("smallstate_model_info", "The loaded models and device (labels; the value is 1).",
                           MODEL_LABELS, registry=r, multiprocess_mode="max")
        self.cancelled = Counter("smallstate_requests_cancelled", "Requests given up before their answer was ready, "
                                 "by reason: deadline, disconnect (the client left) or shutdown.", ["reason"],
                                 registry=r)
        self.work_cancelled = Counter("smallstate_work_cancelled", "Jobs of given-up requests whose work the worker "
                                      "skipped (stage=queued) or stopped part-way (stage=running).", ["stage"],
                                      registry=r)
        self.header_timeouts = Counter("smallstate_header_timeouts", "Connections closed because a request's head "
                                       "did not arrive within header_timeout_s.", registry=r)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, str(status)).observe(seconds)

    def observe_batch(self, n_requests: int, cost: int, seconds: float) -> None:
        self.batch_requests.observe(n_requests)
        self.batch_tokens.observe(cost)
        self.batch_seconds.observe(seconds)

    def observe_tokens(self, scored: int, computed: int, seconds: float) -> None:
        self.tokens.labels("scored").inc(scored)
        self.tokens.labels("computed").inc(computed)
        if seconds > 0 and scored:
            self.tokens_per_second.set(scored / seconds)

    def describe_model(self, labels: dict[str, str]) -> None:
        self.model.labels(*(labels[k] for k in MODEL_LABELS)).set(1)

    def exposition(self) -> bytes:
        """Every process's metrics added up (its own alone outside a multiprocess run)."""
        if not os.environ.get(MULTIPROC_DIR):
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

