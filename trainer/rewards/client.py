"""The trainer's HTTP reward client: batches scored on a pool of reward server replicas.

:class:`HttpRewardClient` implements :class:`shared.rewards.RewardClient`. It runs on a private event loop in a
background thread, so that the (synchronous) training loop can ``submit`` batch k and keep sampling batch k+1
while it is scored. Failed items are NaN (see :mod:`shared.rewards`); a chunk no replica could score raises
:class:`RewardUnavailableError`. No torch here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np

from shared.protocol import InfoResponse
from shared.rewards import Combination, RewardResult, check_batch
from shared.wire import supported_encodings
from trainer.rewards.attempts import Attempts
from trainer.rewards.errors import AttemptFailed, RewardUnavailableError
from trainer.rewards.pool import ReplicaPool
from trainer.rewards.wire import DEFAULT_WIRE_FORMAT, WIRE_FORMATS, check_metadata_arrays, encode_body, store_scores

logger = logging.getLogger("rewardflow.rewards")


def _check_arguments(
    urls: list[str], wire_format: str, batch_size: int, max_concurrency: int, max_retries: int, breaker_failures: int
) -> None:
    """Refuse replicas, a wire format and counts the client cannot work with (``ValueError`` naming them)."""
    if not urls:
        raise ValueError("urls must name at least one reward server")
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
    encoding = wire_format.partition("+")[2] or None
    if encoding is not None and encoding not in supported_encodings():
        raise ValueError(f"wire_format {wire_format!r} needs the {encoding} package, which is not installed")
    if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or breaker_failures < 1:
        raise ValueError("batch_size, max_concurrency, breaker_failures must be >= 1, max_retries >= 0")


def _check_durations(timeout_s: float, connect_timeout_s: float, step_timeout_s: float | None, outage_s: float) -> None:
    """Refuse a timeout that is not positive and an outage wait that is negative (or NaN)."""
    if timeout_s <= 0 or connect_timeout_s <= 0 or (step_timeout_s is not None and step_timeout_s <= 0):
        raise ValueError("timeouts must be > 0")
    if not outage_s >= 0:
        raise ValueError(f"outage_s must be >= 0, got {outage_s}")


class HttpRewardClient:
    """Scores batches on a pool of reward server replicas.

    Batches are split into chunks of ``batch_size`` items, sent concurrently (at most ``max_concurrency``
    requests in flight over all replicas) to the available replica with the fewest outstanding requests
    (ties in round-robin order). A chunk whose attempt meets a connection error, a timeout, 408, 429 or
    5xx is retried, at most ``max_retries`` times, each time on a replica it has not tried yet (while
    there is one), after a jittered exponential backoff that honours Retry-After; with ``outage_s``, a chunk
    whose attempts are spent while every replica is out of rotation waits for one to come back and tries
    again. A 401, 403, 404 or 413 takes the replica out of rotation and goes to another while one is in rotation;
    other 4xx answers, and those with no replica left, raise :class:`RewardRequestError` at once.

    Replicas that keep failing are taken out of rotation and probed back in, and on first use every
    replica's ``/info`` is checked (see :class:`~trainer.rewards.pool.ReplicaPool`). If every replica is out,
    attempts go to them anyway, so that a dead pool ends in :class:`RewardUnavailableError`, not a hang.

    Args:
        urls: base URLs of the replicas, e.g. ``["http://127.0.0.1:8000"]``.
        weights: scorer name -> weight; these scorers are requested from every replica.
        token: bearer token of the servers, if they require one.
        timeout_s: per-attempt timeout (whole request). The server is asked to finish within 80% of it
            (``deadline_ms``), so that a slow item comes back as a NaN rather than the chunk timing out.
        max_concurrency: requests in flight at once, over all replicas (hedges included).
        batch_size: items per request.
        max_retries: further attempts per chunk after the first.
        wire_format: one of :data:`WIRE_FORMATS`; default ``msgpack`` (raw pixels, lossless, cheapest
            on the CPU). ``msgpack+zstd`` / ``msgpack+lz4`` compress the body (lossless) for replicas
            that accept the encoding and send it uncompressed to others. ``png`` and ``raw`` send JSON.
        connect_timeout_s: for establishing a connection.
        step_timeout_s: budget of one ``score`` call; past it :class:`RewardUnavailableError` is raised.
            None: bounded only by ``(max_retries + 1)`` attempts of ``timeout_s`` plus backoffs (and ``outage_s``).
        backoff_s: base of the exponential backoff between attempts.
        outage_s: when a chunk's attempts are spent and every replica is out of rotation (stopped, restarting,
            loading), how long it waits for a probe to bring one back, for a fresh round of attempts; 0: no
            waiting. Counted from the first time the chunk finds them all out.
        max_backoff_s: cap of one backoff, Retry-After included.
        breaker_failures: consecutive failed attempts that take a replica out of rotation.
        probe_interval_s: how often an out-of-rotation replica's ``/readyz`` is probed.
        hedge: send a second copy of a request that is still running after the p95 of the observed
            request latencies to another replica, and take the first answer (after 20 observations).
        combine_mode: one of :data:`shared.rewards.COMBINE_MODES`.
        verify_replicas: check ``/info`` of every replica before the first request.
    """

    def __init__(
        self,
        urls: list[str],
        weights: dict[str, float],
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        max_concurrency: int = 8,
        batch_size: int = 32,
        max_retries: int = 3,
        wire_format: str = DEFAULT_WIRE_FORMAT,
        connect_timeout_s: float = 5.0,
        step_timeout_s: float | None = None,
        backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        breaker_failures: int = 3,
        probe_interval_s: float = 0.5,
        hedge: bool = False,
        combine_mode: str = "sum",
        verify_replicas: bool = True,
        outage_s: float = 0.0,
    ) -> None:
        _check_arguments(urls, wire_format, batch_size, max_concurrency, max_retries, breaker_failures)
        _check_durations(timeout_s, connect_timeout_s, step_timeout_s, outage_s)
        self.encoding = wire_format.partition("+")[2] or None
        self.urls = [url.rstrip("/") for url in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls must be distinct, got {self.urls}")
        self.combination = Combination(weights, combine_mode)
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.wire_format = wire_format
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.hedge, self.verify_replicas = hedge, verify_replicas
        self.outage_s = outage_s
        self.failed_attempts = 0
        self.give_up_waiting: Callable[[], bool] = lambda: False
        """Polled while a request waits out an outage: true ends the wait (the trainer's stop signal, which
        must not wait for reward.outage_s before its checkpoint)."""
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self._connect(breaker_failures, probe_interval_s)
        self._start_loop()

    def _connect(self, breaker_failures: int, probe_interval_s: float) -> None:
        """The replica pool and the attempts at it, both reaching the HTTP client through ``_client``."""
        self.pool = ReplicaPool(
            self.urls,
            list(self.weights),
            http=self._client,
            auth=self._auth,
            breaker_failures=breaker_failures,
            probe_interval_s=probe_interval_s,
        )
        self.attempts = Attempts(
            self.pool,
            self._client,
            wire_format=self.wire_format,
            auth=self._auth,
            timeout_s=self.timeout_s,
            max_concurrency=self.max_concurrency,
            hedge=self.hedge,
        )

    def _start_loop(self) -> None:
        """The private event loop in its background thread; the HTTP client is made on it at first use."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self._verify_lock: asyncio.Lock | None = None
        self._verified = False
        self._closed = False

    # Public API -------------------------------------------------------------------------------------

    async def score_async(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        """Score ``images`` (uint8 ``[B, H, W, C]``) from any event loop."""
        return await asyncio.wrap_future(self.submit(images, prompts, metadata))

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> concurrent.futures.Future[RewardResult]:
        """Start scoring in the background and return at once; inputs are validated and copied here.

        Raises:
            ValueError: for malformed inputs (shape, dtype, lengths).
        """
        if self._closed:
            raise RuntimeError("the reward client is closed")
        batch = check_batch(images, prompts, metadata)
        check_metadata_arrays(batch[2])
        return asyncio.run_coroutine_threadsafe(self._score(*batch), self._loop)

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        """Blocking ``submit(...).result()``."""
        return self.submit(images, prompts, metadata).result()

    def merge(self, parts: Sequence[RewardResult]) -> RewardResult:
        """One result for consecutive chunks of a batch, combined over the whole batch."""
        return self.combination.cat(parts)

    @property
    def weights(self) -> dict[str, float]:
        """Scorer name -> weight; these scorers are requested from every replica."""
        return self.combination.weights

    def check_replicas(self) -> dict[str, InfoResponse]:
        """Fetch ``/info`` of every replica and check they serve the weighted scorers with equal versions.

        Raises:
            RewardClientError: a replica is unreachable, lacks a scorer, or runs a different model version.
        """
        return asyncio.run_coroutine_threadsafe(self.pool.check(strict=True), self._loop).result()

    def replica_states(self) -> dict[str, dict[str, Any]]:
        """url -> ``{"available", "outstanding", "consecutive_failures"}``, for logs and tests."""

        async def snapshot() -> dict[str, dict[str, Any]]:
            return self.pool.states()

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result()

    def close(self) -> None:
        """Close connections and stop the background loop; pending work is cancelled."""
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> HttpRewardClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # On the private loop ----------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            connections = 2 * self.max_concurrency + len(self.urls)  # hedges and probes come on top
            limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=limits, trust_env=False)
            self._verify_lock = asyncio.Lock()
        return self._http

    async def _aclose(self) -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        if self._http is not None:
            await self._http.aclose()

    async def _score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardResult:
        self._client()
        assert self._verify_lock is not None
        if self.verify_replicas and not self._verified:
            async with self._verify_lock:
                if not self._verified:
                    await self.pool.check(strict=False)
                    self._verified = True
        components, errors = self.combination.empty(len(images))
        tasks = [
            asyncio.ensure_future(self._score_chunk(start, images, prompts, metadata, components, errors))
            for start in range(0, len(images), self.batch_size)
        ]
        try:
            instances = await asyncio.wait_for(asyncio.gather(*tasks), timeout=self.step_timeout_s)
        except asyncio.TimeoutError:
            raise RewardUnavailableError(
                f"scoring {len(images)} items took longer than the step budget of {self.step_timeout_s} s"
            ) from None
        finally:
            for task in tasks:
                task.cancel()
        return self.combination.result(components, errors, list(instances))

    async def _score_chunk(
        self,
        start: int,
        images: np.ndarray,
        prompts: list[str],
        metadata: list[dict[str, Any]],
        components: dict[str, np.ndarray],
        errors: dict[str, dict[int, str]],
    ) -> str:
        """Score items ``start : start + batch_size`` into ``components``/``errors``; return the instance."""
        stop = min(start + self.batch_size, len(images))
        body = await asyncio.to_thread(
            self.encode_body, images[start:stop], prompts[start:stop], metadata[start:stop], start
        )
        bodies: dict[str | None, bytes] = {None: body}
        tried: set[str] = set()
        failures: list[str] = []
        attempt, attempts, outage_since = 0, 0, None
        while True:
            replica = self.pool.pick(tried)
            tried.add(replica.url)
            try:
                response = await self.attempts.hedged(replica, bodies, tried)
            except AttemptFailed as exc:
                failures.append(str(exc))
                self.failed_attempts += 1
                attempt, attempts = attempt + 1, attempts + 1
                if attempt <= self.max_retries:
                    delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s) * random.uniform(0.5, 1.5)
                    await asyncio.sleep(min(max(delay, exc.retry_after_s or 0.0), self.max_backoff_s))
                    continue
                if self.outage_s and self.pool.all_out():  # a pool restarting: wait for its probes
                    now = time.monotonic()
                    outage_since = now if outage_since is None else outage_since
                    left = outage_since + self.outage_s - now
                    if await self.pool.wait_for_a_replica(left, self.outage_s, self.give_up_waiting):
                        attempt, failures = 0, failures[-1:]  # a fresh round of attempts
                        tried.clear()
                        continue
                    failures.append(
                        "the run was asked to stop while it waited for a replica"
                        if self.give_up_waiting()
                        else f"no replica back in rotation within reward.outage_s = {self.outage_s:g} s"
                    )
                break
            store_scores(response, start, stop, components, errors)
            return response.instance
        raise RewardUnavailableError(
            f"items {start}-{stop - 1}: no reward replica answered after {attempts} attempts: "
            + "; ".join(failures[-(self.max_retries + 2) :])
        )

    def encode_body(
        self,
        images: np.ndarray,
        prompts: Sequence[str],
        metadata: Sequence[dict[str, Any]],
        start: int = 0,
    ) -> bytes:
        """The uncompressed ``POST /score`` body for these items in this client's wire format.

        Item ids are ``str(start + i)``. Public for benchmarks and tools; ``score`` calls it per chunk.
        """
        return encode_body(
            images,
            prompts,
            metadata,
            start,
            wire_format=self.wire_format,
            scorers=list(self.weights),
            timeout_s=self.timeout_s,
        )
