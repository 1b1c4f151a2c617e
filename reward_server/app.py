"""The reward server: ``create_app(scorers, settings)`` returns the FastAPI application.

Endpoints: ``POST /score``, ``GET /livez``, ``GET /readyz``, ``GET /info``, ``GET /metrics``.

HTTP status policy (the client's retry logic depends on it):
    200  scored, possibly with per-item failures (``ok: false`` plus an error code, never a fake score)
    401  missing or wrong bearer token
    413  body larger than ``max_body_bytes`` or more than ``max_items`` items
    422  malformed body (invalid JSON, schema violation, unknown scorer, image side over the limit)
    429  a scorer queue is full (Retry-After)
    503  loading, load failed, or draining after SIGTERM (Retry-After)
A corrupt image is a per-item DECODE error, so the other items of the request are still scored.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from reward_server.batching import JobResult, QueueFullError, ScorerWorker
from reward_server.scorers import ScoreOutcome, Scorer
from reward_server.settings import ServerSettings
from shared.imagecodec import DecodeError, ImageTooLargeError, decode_image
from shared.protocol import (
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
)

logger = logging.getLogger("reward_server")

RETRY_AFTER_S = "1"
_ROUTES = ("/score", "/livez", "/readyz", "/info", "/metrics")
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 413, 422, 429, 503)
}


class RewardService:
    """State of one server process: scorers, their workers, readiness and drain."""

    def __init__(self, scorers: dict[str, Scorer], settings: ServerSettings) -> None:
        if not scorers:
            raise ValueError("a reward server needs at least one scorer")
        self.scorers = scorers
        self.settings = settings
        self.workers: dict[str, ScorerWorker] = {}
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.counters: Counter[tuple[str, ...]] = Counter()

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

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if self.load_error is not None:
            return f"loading failed: {self.load_error}"
        if not self.ready:
            return "loading"
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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await asyncio.to_thread(service.load)
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

    @app.middleware("http")
    async def count_requests(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        path = request.url.path if request.url.path in _ROUTES else "other"
        service.counters["requests_total", "path", path, "status", str(response.status_code)] += 1
        return response

    def check_token(request: Request) -> None:
        if settings.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, credentials = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            credentials.encode(), settings.token.encode()
        ):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

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
            ),
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = []
        for key, value in sorted(service.counters.items()):
            metric, *labels = key
            label_text = ",".join(f'{k}="{v}"' for k, v in zip(labels[::2], labels[1::2], strict=True))
            lines.append(f"rewardflow_{metric}{{{label_text}}} {value}")
        for name, worker in service.workers.items():
            lines.append(f'rewardflow_queued_items{{scorer="{name}"}} {worker.queued_items}')
        lines.append(f"rewardflow_ready {int(service.not_ready_reason() is None)}")
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post(
        "/score",
        dependencies=[Depends(check_token)],
        response_model=ScoreResponse,
        responses=_ERROR_RESPONSES,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ScoreRequest.model_json_schema()}},
            }
        },
    )
    async def score(request: Request) -> JSONResponse:
        received = time.monotonic()
        reason = service.not_ready_reason()
        if reason is not None:
            status = 429 if reason.startswith("queue full") else 503
            raise HTTPException(status, f"not ready: {reason}", headers={"Retry-After": RETRY_AFTER_S})
        body = await _read_body(request, settings.max_body_bytes)
        try:  # off the event loop: bodies of many megabytes take a while to parse
            score_request = await asyncio.to_thread(ScoreRequest.model_validate_json, body)
        except ValidationError as exc:
            raise HTTPException(422, _describe_validation_error(exc)) from None
        if len(score_request.items) > settings.max_items:
            raise HTTPException(
                413, f"{len(score_request.items)} items exceed the limit of {settings.max_items}"
            )
        names = score_request.scorers or list(scorers)
        unknown = [name for name in names if name not in scorers]
        if unknown:
            raise HTTPException(422, f"unknown scorer(s) {unknown}; this server has {list(scorers)}")
        deadline = (
            None if score_request.deadline_ms is None else received + score_request.deadline_ms / 1000.0
        )

        decoded = await asyncio.to_thread(_decode_items, score_request.items, settings.max_image_side)
        if isinstance(decoded, str):
            raise HTTPException(422, decoded)
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
            job = service.workers[name].submit(images, prompts, metadata, deadline)
            if deadline is None:
                return await job
            try:
                return await asyncio.wait_for(job, timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                failure = ScoreOutcome.failure(ErrorCode.TIMEOUT, "deadline passed before scoring finished")
                return JobResult([failure] * len(ok_rows), (time.monotonic() - received) * 1000.0, 0.0, 0)

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
            for row, item in enumerate(decoded):
                outcome = item if isinstance(item, ScoreOutcome) else scored[row]
                per_item[row][name] = _to_result(outcome)
                code = "OK" if outcome.error is None else outcome.error.value
                service.counters["items_total", "scorer", name, "outcome", code] += 1
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
    for error in exc.errors()[:10]:
        location = ".".join(str(part) for part in error["loc"]) or "body"
        problems.append(f"{location}: {error['msg']}")
    more = f" (and {exc.error_count() - 10} more)" if exc.error_count() > 10 else ""
    return "invalid request: " + "; ".join(problems) + more


def _decode_items(
    items: list[ScoreItem], max_side: int
) -> list[tuple[np.ndarray, dict[str, Any]] | ScoreOutcome] | str:
    """Decode each item's image (and mask) into ``(image, metadata)``.

    An undecodable item becomes a DECODE outcome; an oversized image makes the whole request invalid
    and is returned as the 422 message.
    """
    decoded: list[tuple[np.ndarray, dict[str, Any]] | ScoreOutcome] = []
    for index, item in enumerate(items):
        try:
            image = decode_image(item.image.format, item.image.data, item.image.shape, max_side=max_side)
            metadata = item.metadata
            if item.mask is not None:
                mask = decode_image(item.mask.format, item.mask.data, item.mask.shape, max_side=max_side)
                metadata = {**metadata, "mask": mask}
            decoded.append((image, metadata))
        except ImageTooLargeError as exc:
            return f"items.{index} (id {item.id!r}): {exc}"
        except DecodeError as exc:
            decoded.append(ScoreOutcome.failure(ErrorCode.DECODE, str(exc)))
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
