"""One worker thread per scorer, fed by a bounded queue, with dynamic micro-batching.

The event loop only enqueues jobs and awaits futures: model work never runs on it. The worker takes a
job, waits up to ``batch_wait_s`` for more jobs until ``max_batch_size`` items are gathered, and calls
the scorer in chunks of at most ``max_batch_size`` items. Jobs whose deadline has passed, or whose
request gave up waiting, are dropped before they are computed (TIMEOUT per item).

The queue is bounded in items, not jobs: :meth:`ScorerWorker.submit` raises :class:`QueueFullError`
(the server answers 429) when the items queued and in progress would exceed ``max_queue_items``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reward_server.scorers import ScoreOutcome, Scorer, run_scorer
from reward_server.scorers.frames import FrameSampling
from shared.protocol import ErrorCode

logger = logging.getLogger("reward_server")


class QueueFullError(Exception):
    """The scorer's queue cannot take the job now; the client should retry later or elsewhere."""


@dataclass(frozen=True)
class JobResult:
    outcomes: list[ScoreOutcome]
    queue_ms: float
    inference_ms: float
    batch_size: int


@dataclass
class _Job:
    images: list[np.ndarray]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    deadline: float | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[JobResult]
    submitted: float = field(default_factory=time.monotonic)
    outcomes: list[ScoreOutcome | None] = field(init=False)
    abandoned: bool = False
    started: float | None = None
    inference_s: float = 0.0
    batch_size: int = 0

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.images)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def partial_result(self) -> JobResult:
        """The job as far as the worker got at its deadline: finished items keep their outcomes, the rest
        (queued, or in a batch still running) are TIMEOUT."""
        timeout = ScoreOutcome.failure(ErrorCode.TIMEOUT, "deadline passed before scoring finished")
        now = time.monotonic()
        return JobResult(
            outcomes=[timeout if outcome is None else outcome for outcome in list(self.outcomes)],
            queue_ms=((self.started if self.started is not None else now) - self.submitted) * 1000.0,
            inference_ms=self.inference_s * 1000.0,
            batch_size=self.batch_size,
        )


BatchObserver = Callable[[int, float, list[ScoreOutcome]], None]


class ScorerWorker:
    """Serialises calls to one scorer on a dedicated thread, merging concurrent requests into batches.

    Args:
        scorer: a loaded scorer.
        max_batch_size: items per call to ``scorer.score``.
        batch_wait_s: how long to wait for more jobs once one has arrived.
        max_queue_items: items queued or in progress at most.
        on_batch: called on the worker thread after each scorer call with the batch size, the seconds
            it took and its outcomes (for metrics).
        sampling: how an image scorer scores video items (default: :class:`FrameSampling`'s).
    """

    def __init__(
        self,
        scorer: Scorer,
        *,
        max_batch_size: int,
        batch_wait_s: float,
        max_queue_items: int,
        on_batch: BatchObserver | None = None,
        sampling: FrameSampling | None = None,
    ) -> None:
        self.scorer = scorer
        self.sampling = sampling
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_queue_items = max_queue_items
        self.on_batch = on_batch
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued_items = 0
        self._thread = threading.Thread(target=self._run, name=f"scorer-{scorer.name}", daemon=True)

    @property
    def queued_items(self) -> int:
        """Items submitted and not yet finished."""
        return self._queued_items

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (False before ``start``, after ``stop``, or if it died)."""
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs, then end the thread (waiting at most ``timeout_s``)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    async def submit(
        self,
        images: list[np.ndarray],
        prompts: list[str],
        metadata: list[dict[str, Any]],
        deadline: float | None = None,
    ) -> JobResult:
        """Score the items on the worker thread; ``deadline`` is a ``time.monotonic()`` value. At the
        deadline the job is answered with what is done: items scored by then keep their scores, the others
        are TIMEOUT (and those not started are never computed).

        Raises:
            QueueFullError: the queue holds too many items to take these now.
        """
        loop = asyncio.get_running_loop()
        job = _Job(images, prompts, metadata, deadline, loop, loop.create_future())
        with self._lock:
            if self._queued_items + len(images) > self.max_queue_items:
                raise QueueFullError(
                    f"scorer {self.scorer.name!r} has {self._queued_items} items queued (limit {self.max_queue_items})"
                )
            self._queued_items += len(images)
        self._queue.put(job)
        try:
            if deadline is None:
                return await job.future
            return await asyncio.wait_for(asyncio.shield(job.future), timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            job.abandoned = True  # its items not yet started are dropped; those finished are kept
            return job.partial_result()
        except asyncio.CancelledError:
            job.abandoned = True
            raise

    def _run(self) -> None:
        stopping = False
        while not stopping:
            job = self._queue.get()
            if job is None:
                break
            jobs = [job]
            num_items = len(job.images)
            gather_until = time.monotonic() + self.batch_wait_s
            while num_items < self.max_batch_size:
                try:
                    more = self._queue.get(timeout=max(0.0, gather_until - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                jobs.append(more)
                num_items += len(more.images)
            try:
                self._process(jobs)
            except Exception:
                logger.exception("scorer %s: a batch failed outside the scorer", self.scorer.name)
            finally:
                self._finish(jobs)

    def _process(self, jobs: list[_Job]) -> None:
        pending = [(job, i) for job in jobs for i in range(len(job.images))]
        for start in range(0, len(pending), self.max_batch_size):
            now = time.monotonic()
            chunk = []
            for job, i in pending[start : start + self.max_batch_size]:
                if job.abandoned or job.expired(now):
                    job.outcomes[i] = ScoreOutcome.failure(ErrorCode.TIMEOUT, "deadline passed before scoring")
                else:
                    chunk.append((job, i))
            if not chunk:
                continue
            for job, _ in chunk:
                if job.started is None:
                    job.started = now
            outcomes = run_scorer(
                self.scorer,
                [job.images[i] for job, i in chunk],
                [job.prompts[i] for job, i in chunk],
                [job.metadata[i] for job, i in chunk],
                self.sampling,
            )
            elapsed = time.monotonic() - now
            if self.on_batch is not None:
                self.on_batch(len(chunk), elapsed, outcomes)
            for job in {id(job): job for job, _ in chunk}.values():
                job.inference_s += elapsed
                job.batch_size = max(job.batch_size, len(chunk))
            for (job, i), outcome in zip(chunk, outcomes, strict=True):
                job.outcomes[i] = outcome

    def _finish(self, jobs: list[_Job]) -> None:
        """Resolve every job; items that :meth:`_process` left without an outcome (it failed) are INTERNAL."""
        failure = ScoreOutcome.failure(ErrorCode.INTERNAL, "the scorer worker failed on this batch")
        for job in jobs:
            with self._lock:
                self._queued_items -= len(job.images)
            started = job.started if job.started is not None else time.monotonic()
            result = JobResult(
                outcomes=[failure if outcome is None else outcome for outcome in job.outcomes],
                queue_ms=(started - job.submitted) * 1000.0,
                inference_ms=job.inference_s * 1000.0,
                batch_size=job.batch_size,
            )
            try:
                job.loop.call_soon_threadsafe(_resolve, job.future, result)
            except RuntimeError:  # the event loop has closed: nobody is waiting any more
                pass


def _resolve(future: asyncio.Future[JobResult], result: JobResult) -> None:
    if not future.done():
        future.set_result(result)
