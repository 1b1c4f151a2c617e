"""The reward server: ``create_app(scorers, settings)`` returns the FastAPI application.

Endpoints: ``POST /score``, ``GET /livez``, ``GET /readyz``, ``GET /info``, ``GET /metrics`` and a
self-contained debug page at ``GET /``.

``POST /score`` takes JSON (``application/json``, images as base64) or msgpack (``application/msgpack``,
images as raw bytes; see :mod:`shared.wire`), optionally compressed with a ``Content-Encoding``
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

Modules: :mod:`~reward_server.routes` (endpoints), :mod:`~reward_server.decode` (bodies and images),
:mod:`~reward_server.service` (scorers, workers, readiness, drain), :mod:`~reward_server.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from reward_server.metrics import RequestMetricsMiddleware
from reward_server.routes import openapi_schema, router
from reward_server.scorers import Scorer
from reward_server.service import RewardService, in_daemon_thread
from reward_server.settings import ServerSettings

logger = logging.getLogger("reward_server")

__all__ = ["RewardService", "create_app"]


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
                await in_daemon_thread(service.load)
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
    app.add_middleware(RequestMetricsMiddleware, metrics=service.metrics)
    app.include_router(router)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    return app
