"""The state of one reward server process: its scorers and their workers, readiness, drain and metrics."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from reward_server.batching import ScorerWorker
from reward_server.decode import BodyBytes
from reward_server.metrics import ServerMetrics
from reward_server.scorers import Scorer
from reward_server.settings import ServerSettings

logger = logging.getLogger("reward_server")


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
        assert settings.max_pixels_in_flight is not None  # ServerSettings sets it
        self.pixels = PixelBudget(settings.max_pixels_in_flight)
        assert settings.max_body_bytes_in_flight is not None
        self.bodies = BodyBytes(settings.max_body_bytes_in_flight)
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
                sampling=self.settings.frame_sampling,
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


class PixelBudget:
    """The decoded pixels that requests in flight hold, at most ``limit`` in all (one request alone may hold
    more). A request that does not fit waits until earlier ones let go, in arrival order: a large request is not
    overtaken for ever by small ones."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @contextlib.asynccontextmanager
    async def hold(self, pixels: int) -> AsyncIterator[None]:
        await self._acquire(pixels)
        try:
            yield
        finally:
            self.held -= pixels
            self._grant()

    def _fits(self, pixels: int) -> bool:
        return self.held == 0 or self.held + pixels <= self.limit

    async def _acquire(self, pixels: int) -> None:
        if not self._waiting and self._fits(pixels):
            self.held += pixels
            return
        entry = (pixels, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted as it was cancelled: give it back
                self.held -= pixels
            elif entry in self._waiting:
                self._waiting.remove(entry)
            self._grant()
            raise

    def _grant(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            pixels, future = self._waiting.popleft()
            if not future.done():
                self.held += pixels
                future.set_result(None)


async def in_daemon_thread(function: Callable[[], None]) -> None:
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
