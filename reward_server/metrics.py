"""Prometheus metrics of a reward server: one registry per server, and the middleware counting requests."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reward_server.scorers import ScoreOutcome, Scorer

# Paths counted under their own label; any other path counts as "other" (bounded label values).
ROUTES = frozenset({"/", "/score", "/livez", "/readyz", "/info", "/metrics"})
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Scores of scorers unbounded on a side: a symmetric, roughly logarithmic scale.
_UNBOUNDED_SCORE_BUCKETS = (-1000, -100, -30, -10, -3, -1, -0.3, -0.1, 0, 0.1, 0.3, 1, 3, 10, 30, 100, 1000)


class _ScoreHistograms(Collector):
    """``rewardflow_score{scorer}``: a histogram of each scorer's scores with buckets fit to its range.

    A bounded scorer ``[lo, hi]`` gets 10 equal-width buckets; others share a symmetric log-like scale.
    (A prometheus_client ``Histogram`` has one bucket layout for all labels, hence this collector.)
    """

    def __init__(self, scorers: dict[str, Scorer]) -> None:
        self._lock = threading.Lock()
        self._bounds: dict[str, tuple[float, ...]] = {}
        for name, scorer in scorers.items():
            low, high = scorer.score_range
            if low is not None and high is not None and high > low:
                self._bounds[name] = tuple(low + (high - low) * k / 10 for k in range(1, 11))
            else:
                self._bounds[name] = tuple(float(b) for b in _UNBOUNDED_SCORE_BUCKETS)
        self._counts = {name: [0] * (len(bounds) + 1) for name, bounds in self._bounds.items()}
        self._sums = dict.fromkeys(self._bounds, 0.0)

    def observe(self, scorer: str, score: float) -> None:
        bounds = self._bounds[scorer]
        index = next((i for i, bound in enumerate(bounds) if score <= bound), len(bounds))
        with self._lock:
            self._counts[scorer][index] += 1
            self._sums[scorer] += score

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "rewardflow_score", "Scores returned (ok items only), per scorer", labels=["scorer"]
        )
        with self._lock:
            for name, bounds in self._bounds.items():
                cumulative, buckets = 0, []
                for bound, count in zip((*bounds, math.inf), self._counts[name], strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), cumulative))
                family.add_metric([name], buckets, self._sums[name])
        yield family


class ServerMetrics:
    """Prometheus metrics of one server, in a registry of its own (several apps may share a process).

    Families: ``rewardflow_requests_total{path,status}``, ``rewardflow_request_duration_seconds{path}``,
    ``rewardflow_request_body_bytes{media_type}``, ``rewardflow_queue_seconds{scorer}`` (submission to
    the first micro-batch holding a request's items), ``rewardflow_inference_seconds{scorer}`` (one
    scorer call), ``rewardflow_batch_size{scorer}``, ``rewardflow_queue_depth{scorer}`` (items queued
    or in progress), ``rewardflow_items_total{scorer,outcome}`` (outcome ``OK`` or an error code: the
    per-scorer error counts), ``rewardflow_score{scorer}`` and ``rewardflow_ready``.
    """

    def __init__(self, scorers: dict[str, Scorer]) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "rewardflow_requests", "HTTP requests by path and status", ["path", "status"], registry=registry
        )
        self.request_seconds = Histogram(
            "rewardflow_request_duration_seconds",
            "Time from the request's arrival to the end of its response",
            ["path"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.body_bytes = Histogram(
            "rewardflow_request_body_bytes",
            "Size of POST /score bodies as sent",
            ["media_type"],
            buckets=tuple(4**k for k in range(5, 15)),
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "rewardflow_queue_seconds",
            "Time from submission to the start of the first micro-batch holding a request's items",
            ["scorer"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.inference_seconds = Histogram(
            "rewardflow_inference_seconds",
            "Duration of one scorer call (one micro-batch)",
            ["scorer"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.batch_size = Histogram(
            "rewardflow_batch_size",
            "Items per scorer call",
            ["scorer"],
            buckets=_BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.items = Counter(
            "rewardflow_items",
            "Items by scorer and outcome (OK or an error code)",
            ["scorer", "outcome"],
            registry=registry,
        )
        self.queue_depth = Gauge("rewardflow_queue_depth", "Items queued or in progress", ["scorer"], registry=registry)
        self.ready = Gauge("rewardflow_ready", "1 if /readyz answers 200", registry=registry)
        self.scores = _ScoreHistograms(scorers)
        registry.register(self.scores)

    def on_batch(self, scorer: str) -> Callable[[int, float, list[ScoreOutcome]], None]:
        """The worker callback recording one scorer call."""
        inference = self.inference_seconds.labels(scorer)
        batch_size = self.batch_size.labels(scorer)

        def observe(size: int, seconds: float, outcomes: list[ScoreOutcome]) -> None:
            inference.observe(seconds)
            batch_size.observe(size)

        return observe

    def record_outcomes(self, scorer: str, outcomes: Sequence[ScoreOutcome]) -> None:
        for outcome in outcomes:
            self.items.labels(scorer, "OK" if outcome.error is None else outcome.error.value).inc()
            if outcome.error is None and outcome.score is not None:
                self.scores.observe(scorer, outcome.score)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Counts every HTTP request by path and status and times it (a plain ASGI middleware: no body copies)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.labels(path).observe(time.monotonic() - started)
