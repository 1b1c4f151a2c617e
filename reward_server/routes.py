"""The reward server's HTTP routes; each reads the process's :class:`RewardService` from ``app.state``."""

from __future__ import annotations

import asyncio
import hmac
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic.json_schema import models_json_schema

from reward_server.batching import JobResult, QueueFullError
from reward_server.decode import Decoded, decode_opened, open_items, parse_score_request
from reward_server.scorers.base import ScoreOutcome
from reward_server.service import RewardService
from shared.protocol import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    BinaryScoreRequest,
    ErrorResponse,
    InfoResponse,
    ItemError,
    ItemResult,
    Limits,
    ScoreRequest,
    ScoreResponse,
    ScorerInfo,
    ScorerResult,
    ScorerTiming,
    Timing,
    VideoScoring,
)
from shared.wire import supported_encodings

RETRY_AFTER_S = "1"
DEBUG_PAGE = Path(__file__).with_name("static") / "debug.html"
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (401, 413, 415, 422, 429, 503)
}


def _service(request: Request) -> RewardService:
    return request.app.state.service


def check_token(request: Request) -> None:
    """Refuse with 401 unless the request carries the server's bearer token (when it has one)."""
    token = _service(request).settings.token
    if token is None:
        return
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(credentials.encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


router = APIRouter()


@router.get("/", include_in_schema=False)
async def debug_page() -> HTMLResponse:
    return HTMLResponse(DEBUG_PAGE.read_text(encoding="utf-8"))


@router.get("/livez")
async def livez(request: Request) -> dict[str, str]:
    return {"status": "alive", "instance": _service(request).settings.instance_id}


@router.get("/readyz", responses={503: {"model": ErrorResponse}})
async def readyz(request: Request) -> JSONResponse:
    service = _service(request)
    reason = service.not_ready_reason()
    if reason is not None:
        return JSONResponse({"detail": reason}, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
    return JSONResponse({"status": "ready", "instance": service.settings.instance_id})


@router.get("/info", dependencies=[Depends(check_token)], responses=_ERROR_RESPONSES)
async def info(request: Request) -> InfoResponse:
    service = _service(request)
    settings = service.settings
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
            for name, scorer in service.scorers.items()
        ],
        limits=Limits(
            max_items=settings.max_items,
            max_image_side=settings.max_image_side,
            max_body_bytes=settings.max_body_bytes,
            max_pixels_per_request=settings.max_pixels_per_request,
            max_values=settings.max_values,
            max_frames=settings.max_frames,
        ),
        media_types=[JSON_MEDIA_TYPE, MSGPACK_MEDIA_TYPE],
        encodings=supported_encodings(),
        video=VideoScoring(frames=settings.video_frames, reduce=settings.video_reduce),
    )


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post(
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
    # Parse, decode, queue the decodable items on each named scorer, then answer in request order.
    # (A comment, not a docstring: FastAPI would publish a docstring as the endpoint's description.)
    received = time.monotonic()
    service = _service(request)
    reason = service.not_ready_reason(queues=False)  # a full queue: 429 from the scorers this request names
    if reason is not None:
        raise HTTPException(503, f"not ready: {reason}", headers={"Retry-After": RETRY_AFTER_S})
    score_request = await parse_score_request(request, service.settings, service.metrics, service.bodies)
    names = _scorer_names(score_request, service)
    deadline = None if score_request.deadline_ms is None else received + score_request.deadline_ms / 1000.0
    opened, pixels = await asyncio.to_thread(open_items, score_request.items, service.settings)
    async with service.pixels.hold(pixels):  # until the decoded images are scored
        decoded = await asyncio.to_thread(decode_opened, score_request.items, opened)
        decode_ms = (time.monotonic() - received) * 1000.0
        job_results = await _run_scorers(service, names, score_request, decoded, deadline)
        per_item = _item_results(service, names, decoded, job_results)
        del decoded
    response = ScoreResponse(
        request_id=score_request.request_id,
        instance=service.settings.instance_id,
        models={name: service.scorers[name].version for name in names},
        results=[ItemResult(id=item.id, scores=s) for item, s in zip(score_request.items, per_item, strict=True)],
        timing=Timing(
            total_ms=(time.monotonic() - received) * 1000.0,
            decode_ms=decode_ms,
            scorers={
                name: ScorerTiming(queue_ms=r.queue_ms, inference_ms=r.inference_ms, batch_size=r.batch_size)
                for name, r in zip(names, job_results, strict=True)
            },
        ),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _scorer_names(score_request: ScoreRequest, service: RewardService) -> list[str]:
    """The scorers a request names (default: all); 422 for a name this server does not have."""
    names = score_request.scorers or list(service.scorers)
    unknown = [name for name in names if name not in service.scorers]
    if unknown:
        raise HTTPException(422, f"unknown scorer(s) {unknown}; this server has {list(service.scorers)}")
    return names


async def _run_scorers(
    service: RewardService,
    names: list[str],
    score_request: ScoreRequest,
    decoded: list[Decoded],
    deadline: float | None,
) -> list[JobResult]:
    """Queue the decoded items on every named scorer at once; 429 (and nothing computed) on a full queue."""
    ok_rows = _ok_rows(decoded)
    pairs = [entry for entry in decoded if not isinstance(entry, ScoreOutcome)]
    images: list[np.ndarray] = [image for image, _ in pairs]
    metadata: list[dict[str, Any]] = [meta for _, meta in pairs]
    prompts = [score_request.items[row].prompt for row in ok_rows]

    async def run(name: str) -> JobResult:
        if not ok_rows:
            return JobResult([], 0.0, 0.0, 0)
        result = await service.workers[name].submit(images, prompts, metadata, deadline)
        service.metrics.queue_seconds.labels(name).observe(result.queue_ms / 1000.0)
        return result

    tasks = [asyncio.ensure_future(run(name)) for name in names]
    try:
        return await asyncio.gather(*tasks)
    except QueueFullError as exc:
        for task in tasks:  # the other scorers' jobs are abandoned, not computed
            task.cancel()
        raise HTTPException(429, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from None


def _item_results(
    service: RewardService, names: list[str], decoded: list[Decoded], job_results: list[JobResult]
) -> list[dict[str, ScorerResult]]:
    """Per item, each scorer's result (decode failures included), recorded in the metrics."""
    per_item: list[dict[str, ScorerResult]] = [{} for _ in decoded]
    for name, job_result in zip(names, job_results, strict=True):
        scored = dict(zip(_ok_rows(decoded), job_result.outcomes, strict=True))
        outcomes = [entry if isinstance(entry, ScoreOutcome) else scored[row] for row, entry in enumerate(decoded)]
        service.metrics.record_outcomes(name, outcomes)
        for row, outcome in enumerate(outcomes):
            per_item[row][name] = _to_result(outcome)
    return per_item


def _ok_rows(decoded: list[Decoded]) -> list[int]:
    return [row for row, entry in enumerate(decoded) if not isinstance(entry, ScoreOutcome)]


def _to_result(outcome: ScoreOutcome) -> ScorerResult:
    if outcome.error is None:
        return ScorerResult(ok=True, score=outcome.score, details=outcome.details)
    return ScorerResult(
        ok=False,
        score=None,
        details=outcome.details,
        error=ItemError(code=outcome.error, message=outcome.message),
    )


def openapi_schema(app: FastAPI) -> dict[str, Any]:
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
