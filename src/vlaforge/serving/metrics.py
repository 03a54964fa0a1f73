"""The server's Prometheus metrics (`prometheus_client`, a registry per server): requests, errors by kind,
predictions withheld for NaN / inf actions, latency and batch-size histograms, queue depth, open sessions and the
feature cache's hit rate."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vlaforge.inference.runtime import PolicyRuntime


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, runtime: PolicyRuntime):
        self.registry = r = CollectorRegistry()
        self._requests = Counter("vlaforge_requests", "predictions answered", ["transport"], registry=r)
        self._errors = Counter("vlaforge_errors", "requests answered with an error, by kind", ["kind"], registry=r)
        # apart from the errors: a policy that starts predicting NaN is what an operator alerts on
        self._nonfinite = Counter("vlaforge_nonfinite_actions", "predictions withheld because an action was NaN or "
                                  "inf", registry=r)
        self._latency = Histogram("vlaforge_request_seconds", "request to reply, in the server", registry=r,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self._batch = Histogram("vlaforge_batch_size", "predictions per forward", registry=r,
                                buckets=(1, 2, 4, 8, 16, 32, 64))
        self._infer = Histogram("vlaforge_infer_seconds", "one batched forward", registry=r,
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self._queue = Gauge("vlaforge_queue_depth", "requests waiting for a batch", registry=r)
        self._sessions = Gauge("vlaforge_sessions", "open sessions (connections)", registry=r)
        hits = Gauge("vlaforge_cache_hit_rate", "feature-cache hit rate over the open sessions", registry=r)
        hits.set_function(lambda: _hit_rate(runtime))

    def request(self, transport: str, seconds: float) -> None:
        self._requests.labels(transport).inc()
        self._latency.observe(seconds)

    def error(self, kind: str) -> None:
        self._errors.labels(kind).inc()

    def nonfinite(self) -> None:
        self._nonfinite.inc()

    def batch(self, size: int, infer_ms: float) -> None:
        self._batch.observe(size)
        self._infer.observe(infer_ms / 1000)

    def queue_depth(self, fn: Callable[[], float]) -> None:
        self._queue.set_function(fn)

    def sessions(self, fn: Callable[[], float]) -> None:
        self._sessions.set_function(fn)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def _hit_rate(runtime: PolicyRuntime) -> float:
    stats = [s.cache.stats for s in list(runtime.sessions.values())]
    frames = sum(s.frames for s in stats)
    return sum(s.exact_hits + s.similar_hits for s in stats) / frames if frames else 0.0
