"""The reward server: ``create_app(scorers, settings)`` returns the FastAPI application.

Endpoints: ``POST /score``, ``GET /livez``, ``GET /readyz``, ``GET /info``, ``GET /metrics`` and a
self-contained debug page at ``GET /``.

``POST /score`` takes JSON (``application/json``, images as base64) or msgpack (``application/msgpack``,
images as raw bytes; see :mod:`shared.protocol`), optionally compressed with a ``Content-Encoding``
listed in ``/info``. Responses are JSON.

HTTP status policy (the client's retry logic depends on it):
    200  scored, possibly with per-item failures (``ok: false`` plus an error code, never a fake score)
    401  missing or wrong bearer token
    413  body (as sent or decompressed) larger than ``max_body_bytes``, more than ``max_items`` items
         (refused before the items are validated), or images, masks and metadata images adding up to
         more than ``max_pixels_per_request`` pixels (read from their headers, before decoding)
    415  unsupported Content-Encoding (the ``Accept-Encoding`` header lists the supported ones)
    422  malformed body (invalid JSON or msgpack, corrupt compression, schema violation, unknown scorer,
         image side over the limit)
    429  the queue of a scorer the request names is full (Retry-After)
    503  loading, load failed, or draining after SIGTERM (Retry-After)
A corrupt image is a per-item DECODE error, so the other items of the request are still scored.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reward_server.batching import JobResult, QueueFullError, ScorerWorker
from reward_server.scorers import ScoreOutcome, Scorer
from reward_server.settings import ServerSettings
from shared.imagecodec import DecodeError, ImageTooLargeError, OpenedImage, open_image
from shared.protocol import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPES,
    BinaryScoreItem,
    BinaryScoreRequest,
    BodyError,
    BodyTooLargeError,
    ErrorCode,
    ErrorResponse,
    InfoResponse,
    ItemError,
    ItemResult,
    Limits,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
    ScorerInfo,
    ScorerResult,
    ScorerTiming,
    Timing,
    TooManyItemsError,
    decompress_body,
    supported_encodings,
    unpack_msgpack,
)

logger = logging.getLogger("reward_server")

RETRY_AFTER_S = "1"
DEBUG_PAGE = Path(__file__).with_name("static") / "debug.html"
_ROUTES = frozenset({"/", "/score", "/livez", "/readyz", "/info", "/metrics"})
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 413, 415, 422, 429, 503)
}
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
        self.queue_depth = Gauge(
            "rewardflow_queue_depth", "Items queued or in progress", ["scorer"], registry=registry
        )
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


class _RequestMetricsMiddleware:
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
            path = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.request_seconds.labels(path).observe(time.monotonic() - started)


class RewardService:
    """State of one server process: scorers, their workers, readiness, drain and metrics."""

    def __init__(self, scorers: dict[str, Scorer], settings: ServerSettings) -> None:
        if not scorers:
            raise ValueError("a reward server needs at least one scorer")
        self.scorers = scorers
        self.settings = settings
        self.workers: dict[str, ScorerWorker] = {}
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.metrics = ServerMetrics(scorers)
        self.metrics.ready.set_function(lambda: float(self.not_ready_reason() is None))
        for name in scorers:
            self.metrics.queue_depth.labels(name).set_function(
                lambda name=name: float(self.workers[name].queued_items if name in self.workers else 0)
            )

    def load(self) -> None:
        """Load and warm every scorer, then start its worker (blocking: run it off the event loop)."""
        for name, scorer in self.scorers.items():
            started = time.monotonic()
            scorer.load()
            logger.info("loaded scorer %s (%s) in %.1f s", name, scorer.version, time.monotonic() - started)
            worker = ScorerWorker(
                scorer,
                max_batch_size=self.settings.max_batch_size,
                batch_wait_s=self.settings.batch_wait_ms / 1000.0,
                max_queue_items=self.settings.max_queue_items,
                on_batch=self.metrics.on_batch(name),
            )
            worker.start()
            self.workers[name] = worker
        self.ready = True

    def begin_drain(self) -> None:
        """Stop taking new work: ``/readyz`` and ``/score`` answer 503 from now on."""
        self.draining = True
        logger.info("draining: /readyz now answers 503")

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def not_ready_reason(self, queues: bool = True) -> str | None:
        """Why the server takes no work now, or None; ``queues``: a full scorer queue counts (``/readyz``);
        ``/score`` leaves that to the scorers a request names."""
        if self.draining:
            return "draining"
        if self.load_error is not None:
            return f"loading failed: {self.load_error}"
        if not self.ready:
            return "loading"
        stopped = [name for name, w in self.workers.items() if not w.alive]
        if stopped:
            return f"scorer worker stopped: {stopped} (see the server log)"
        if not queues:
            return None
        full = [name for name, w in self.workers.items() if w.queued_items >= self.settings.max_queue_items]
        return f"queue full: {full}" if full else None


def create_app(
    scorers: dict[str, Scorer],
    settings: ServerSettings,
    *,
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """Build the reward server application.

    Scorers are loaded in a worker thread after start-up, so ``/livez`` answers at once and ``/readyz``
    answers 503 until every scorer is loaded and warm.

    Args:
        scorers: name -> scorer, not yet loaded.
        settings: limits, batching and auth.
        on_load_failure: called (from the event loop) if a scorer fails to load; the process entry point
            uses it to exit instead of staying up unready.
    """
    service = RewardService(scorers, settings)
    encodings = supported_encodings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await _in_daemon_thread(service.load)
            except Exception as exc:
                service.load_error = f"{type(exc).__name__}: {exc}"
                logger.exception("loading scorers failed")
                if on_load_failure is not None:
                    on_load_failure(exc)

        task = asyncio.create_task(load())
        yield
        task.cancel()
        await asyncio.to_thread(service.stop)

    app = FastAPI(title="rewardflow reward server", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(_RequestMetricsMiddleware, metrics=service.metrics)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    def check_token(request: Request) -> None:
        if settings.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.encode(), settings.token.encode()
        ):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/", include_in_schema=False)
    async def debug_page() -> HTMLResponse:
        return HTMLResponse(DEBUG_PAGE.read_text(encoding="utf-8"))

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive", "instance": settings.instance_id}

    @app.get("/readyz", responses={503: {"model": ErrorResponse}})
    async def readyz() -> JSONResponse:
        reason = service.not_ready_reason()
        if reason is not None:
            return JSONResponse({"detail": reason}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        return JSONResponse({"status": "ready", "instance": settings.instance_id})

    @app.get("/info", dependencies=[Depends(check_token)], responses=_ERROR_RESPONSES)
    async def info() -> InfoResponse:
        return InfoResponse(
            instance=settings.instance_id,
            ready=service.not_ready_reason() is None,
            scorers=[
                ScorerInfo(
                    name=name,
                    version=scorer.version,
                    score_min=scorer.score_range[0],
                    score_max=scorer.score_range[1],
                    description=scorer.description,
                )
                for name, scorer in scorers.items()
            ],
            limits=Limits(
                max_items=settings.max_items,
                max_image_side=settings.max_image_side,
                max_body_bytes=settings.max_body_bytes,
                max_pixels_per_request=settings.max_pixels_per_request,
            ),
            media_types=[JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE],
            encodings=encodings,
        )

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/score",
        dependencies=[Depends(check_token)],
        response_model=ScoreResponse,
        responses=_ERROR_RESPONSES,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    JSON_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/ScoreRequest"}},
                    MSGPACK_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/BinaryScoreRequest"}},
                },
            }
        },
    )
    async def score(request: Request) -> JSONResponse:
        received = time.monotonic()
        reason = service.not_ready_reason(queues=False)  # a full queue: 429 from the scorers this request names
        if reason is not None:
            raise HTTPException(503, f"not ready: {reason}", headers={"Retry-After": RETRY_AFTER_S})
        score_request = await _parse_score_request(request, settings, encodings, service)
        names = score_request.scorers or list(scorers)
        unknown = [name for name in names if name not in scorers]
        if unknown:
            raise HTTPException(422, f"unknown scorer(s) {unknown}; this server has {list(scorers)}")
        deadline = (
            None if score_request.deadline_ms is None else received + score_request.deadline_ms / 1000.0
        )

        decoded = await asyncio.to_thread(_decode_items, score_request.items, settings)
        decode_ms = (time.monotonic() - received) * 1000.0
        ok_rows: list[int] = []
        images: list[np.ndarray] = []
        metadata: list[dict[str, Any]] = []
        for row, entry in enumerate(decoded):
            if not isinstance(entry, ScoreOutcome):
                ok_rows.append(row)
                images.append(entry[0])
                metadata.append(entry[1])
        prompts = [score_request.items[row].prompt for row in ok_rows]

        async def run(name: str) -> JobResult:
            if not ok_rows:
                return JobResult([], 0.0, 0.0, 0)
            result = await service.workers[name].submit(images, prompts, metadata, deadline)
            service.metrics.queue_seconds.labels(name).observe(result.queue_ms / 1000.0)
            return result

        tasks = [asyncio.ensure_future(run(name)) for name in names]
        try:
            job_results = await asyncio.gather(*tasks)
        except QueueFullError as exc:
            for task in tasks:  # the other scorers' jobs are abandoned, not computed
                task.cancel()
            raise HTTPException(429, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from None

        per_item: list[dict[str, ScorerResult]] = [{} for _ in score_request.items]
        for name, job_result in zip(names, job_results, strict=True):
            scored = dict(zip(ok_rows, job_result.outcomes, strict=True))
            outcomes = [
                item if isinstance(item, ScoreOutcome) else scored[row] for row, item in enumerate(decoded)
            ]
            service.metrics.record_outcomes(name, outcomes)
            for row, outcome in enumerate(outcomes):
                per_item[row][name] = _to_result(outcome)
        response = ScoreResponse(
            request_id=score_request.request_id,
            instance=settings.instance_id,
            models={name: scorers[name].version for name in names},
            results=[
                ItemResult(id=item.id, scores=s)
                for item, s in zip(score_request.items, per_item, strict=True)
            ],
            timing=Timing(
                total_ms=(time.monotonic() - received) * 1000.0,
                decode_ms=decode_ms,
                scorers={
                    name: ScorerTiming(
                        queue_ms=r.queue_ms, inference_ms=r.inference_ms, batch_size=r.batch_size
                    )
                    for name, r in zip(names, job_results, strict=True)
                },
            ),
        )
        return JSONResponse(response.model_dump(mode="json"))

    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request body models, which ``/score`` parses itself (JSON or msgpack)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = models_json_schema(
            [(ScoreRequest, "validation"), (BinaryScoreRequest, "validation")],
            ref_template="#/components/schemas/{model}",
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
    return app.openapi_schema


async def _in_daemon_thread(function: Callable[[], None]) -> None:
    """Run ``function`` on a daemon thread and wait for it.

    Unlike ``asyncio.to_thread``, whose executor the interpreter joins at exit, a daemon thread does not
    hold up the exit of a process told to stop (a second SIGTERM) while a long model load runs.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if done.done():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            function()
        except BaseException as exc:  # whatever it is, the waiting coroutine must hear of it
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the event loop has closed: nobody is waiting any more
            pass

    threading.Thread(target=run, name="load-scorers", daemon=True).start()
    await done


async def _parse_score_request(
    request: Request, settings: ServerSettings, encodings: list[str], service: RewardService
) -> ScoreRequest:
    """Read, decompress and validate a ``POST /score`` body (JSON or msgpack); raise the HTTP error."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
    if encoding != "identity" and encoding not in encodings:
        raise HTTPException(
            415,
            f"unsupported Content-Encoding {encoding!r}; supported: identity, {', '.join(encodings)}",
            headers={"Accept-Encoding": ", ".join(["identity", *encodings])},
        )
    media_type = request.headers.get("content-type", JSON_MEDIA_TYPE).split(";")[0].strip().lower()
    binary = media_type in MSGPACK_MEDIA_TYPES
    max_body_bytes = settings.max_body_bytes
    body = await _read_body(request, max_body_bytes)
    service.metrics.body_bytes.labels(MSGPACK_MEDIA_TYPE if binary else JSON_MEDIA_TYPE).observe(len(body))

    def parse() -> ScoreRequest:
        data = body if encoding == "identity" else decompress_body(body, encoding, max_body_bytes)
        context = {"max_items": settings.max_items}
        if binary:
            return BinaryScoreRequest.model_validate(unpack_msgpack(data), context=context)
        return ScoreRequest.model_validate_json(data, context=context)

    try:  # off the event loop: bodies of many megabytes take a while to decompress and parse
        return await asyncio.to_thread(parse)
    except (BodyTooLargeError, TooManyItemsError) as exc:
        raise HTTPException(413, str(exc)) from None
    except BodyError as exc:
        raise HTTPException(422, str(exc)) from None
    except ValidationError as exc:
        raise HTTPException(422, _describe_validation_error(exc)) from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """Read the body, refusing with 413 as soon as it exceeds ``max_bytes`` (declared or actual)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HTTPException(413, f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_input=False)[:10]:
        location = ".".join(str(part) for part in error["loc"]) or "body"
        problems.append(f"{location}: {error['msg']}")
    more = f" (and {exc.error_count() - 10} more)" if exc.error_count() > 10 else ""
    return "invalid request: " + "; ".join(problems) + more


def _decode_items(
    items: Sequence[ScoreItem | BinaryScoreItem], settings: ServerSettings
) -> list[tuple[np.ndarray, dict[str, Any]] | ScoreOutcome]:
    """Decode each item's image, mask and metadata images into ``(image, metadata)``.

    Every header is read before any pixel is decoded, so that an oversized image (422) or a request
    over ``max_pixels_per_request`` (413) costs no memory. An undecodable item becomes a DECODE outcome.
    """
    opened: list[dict[str | None, OpenedImage] | ScoreOutcome] = []
    pixels = 0
    for index, item in enumerate(items):
        wire = {None: item.image, "mask": item.mask, **item.metadata_images}  # None: the scored image
        try:
            images = {
                key: open_image(image.format, image.data, image.shape, max_side=settings.max_image_side)
                for key, image in wire.items()
                if image is not None
            }
        except ImageTooLargeError as exc:
            raise HTTPException(422, f"items.{index} (id {item.id!r}): {exc}") from None
        except DecodeError as exc:
            opened.append(ScoreOutcome.failure(ErrorCode.DECODE, str(exc)))
            continue
        pixels += sum(image.pixels for image in images.values())
        opened.append(images)
    if pixels > settings.max_pixels_per_request:
        raise HTTPException(
            413,
            f"the request's images, masks and metadata images hold {pixels} pixels (height x width), more "
            f"than the limit of {settings.max_pixels_per_request} (max_pixels_per_request); send fewer or "
            "smaller images per request, or raise the server's --max-pixels-per-request",
        )
    decoded: list[tuple[np.ndarray, dict[str, Any]] | ScoreOutcome] = []
    for item, entry in zip(items, opened, strict=True):
        if isinstance(entry, ScoreOutcome):
            decoded.append(entry)
            continue
        try:
            arrays = {key: image.decode() for key, image in entry.items()}
        except DecodeError as exc:
            decoded.append(ScoreOutcome.failure(ErrorCode.DECODE, str(exc)))
            continue
        image = arrays.pop(None)
        decoded.append((image, {**item.metadata, **arrays} if arrays else item.metadata))
    return decoded


def _to_result(outcome: ScoreOutcome) -> ScorerResult:
    if outcome.error is None:
        return ScorerResult(ok=True, score=outcome.score, details=outcome.details)
    return ScorerResult(
        ok=False,
        score=None,
        details=outcome.details,
        error=ItemError(code=outcome.error, message=outcome.message),
    )
