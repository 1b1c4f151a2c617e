"""The trainer's only way to reach rewards: a pool client over HTTP replicas, and an in-process twin.

Both implement :class:`RewardClient`: ``score_async`` / ``submit`` / ``score`` return a
:class:`RewardResult` with one float64 array per scorer and their weighted combination. A reward that
could not be computed is NaN, never 0: the algorithm gives such samples no advantage and counts them.
If a whole chunk cannot be scored by any replica, :class:`RewardUnavailableError` is raised.

The HTTP client runs on a private event loop in a background thread, so the (synchronous) training loop
can ``submit`` batch k and keep sampling batch k+1 while it is scored. No torch here.

Combination (:func:`combine`), over the items of one ``score`` call, with weights ``w`` and components
``c_k`` (components with weight 0 are scored and logged but take no part):

* ``sum``: ``sum_k w_k * c_k``.
* ``sum-then-normalise``: ``standardise(sum_k w_k * c_k)``.
* ``normalise-then-sum``: ``sum_k w_k * standardise(c_k)``, so that components on different scales
  count by their weights rather than by their spreads.

``standardise(x) = (x - mean(x)) / (std(x) + 1e-8)`` with the mean and the population standard
deviation (ddof 0) taken over the finite entries of ``x`` in this call (the batch; under data
parallelism each rank's batch); NaN entries stay NaN and take no part in the statistics. An item with a
NaN in any weighted component is NaN in every mode.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import numpy as np
from pydantic import ValidationError

from shared.imagecodec import as_hwc_uint8, encode_image
from shared.protocol import (
    JSON_MEDIA_TYPE,
    MAX_DEADLINE_MS,
    MSGPACK_MEDIA_TYPE,
    InfoResponse,
    ScoreResponse,
)
from shared.wire import compress_body, pack_msgpack, supported_encodings

if TYPE_CHECKING:
    from reward_server.scorers import ScoreOutcome, Scorer

logger = logging.getLogger("rewardflow.rewards")

DEFAULT_WIRE_FORMAT = "msgpack"
# msgpack*: raw uint8 pixels in a msgpack body (lossless, cheapest), optionally compressed when the
# replica lists the encoding in /info; png / raw: JSON bodies with base64 PNG files / base64 pixels.
WIRE_FORMATS = ("msgpack", "msgpack+zstd", "msgpack+lz4", "png", "raw")
COMBINE_MODES = ("sum", "sum-then-normalise", "normalise-then-sum")
STANDARDISE_EPS = 1e-8
_LATENCY_WINDOW = 256


class RewardClientError(RuntimeError):
    """Base class of reward client failures."""


class RewardUnavailableError(RewardClientError):
    """No replica could score a chunk within the allowed retries or the step budget."""


class RewardRequestError(RewardClientError):
    """A replica rejected a request as invalid (a 4xx other than 408/429); retrying cannot help."""


@dataclass
class RewardResult:
    """Rewards of one batch.

    Attributes:
        components: scorer name -> float64 ``[B]``; NaN where that scorer failed for the item.
        combined: float64 ``[B]``, the weighted combination (see :func:`combine`); NaN if any weighted
            component is NaN.
        errors: scorer name -> {item index: "CODE: message"} for the NaN entries.
        instances: ids of the server instances that answered (one entry per chunk).
    """

    components: dict[str, np.ndarray]
    combined: np.ndarray
    errors: dict[str, dict[int, str]] = field(default_factory=dict)
    instances: list[str] = field(default_factory=list)

    @property
    def num_failed(self) -> int:
        """Items without a combined reward."""
        return int(np.isnan(self.combined).sum())

    @staticmethod
    def cat(parts: Sequence[RewardResult], weights: Mapping[str, float], mode: str = "sum") -> RewardResult:
        """Join the results of consecutive chunks of one batch. The combination is recomputed over the
        whole batch, so the normalising modes standardise over the batch, not over each chunk."""
        components = {name: np.concatenate([p.components[name] for p in parts]) for name in parts[0].components}
        errors: dict[str, dict[int, str]] = {}
        offset = 0
        for part in parts:
            for name, items in part.errors.items():
                errors.setdefault(name, {}).update({offset + i: msg for i, msg in items.items()})
            offset += len(part.combined)
        return RewardResult(components, combine(components, weights, mode), errors,
                            [i for p in parts for i in p.instances])


class RewardClient(Protocol):
    """What the trainer needs from a reward client (HTTP pool or in-process)."""

    weights: dict[str, float]
    """Scorer name -> weight of its component in the combined reward."""
    combine_mode: str
    """How components are combined (see :func:`combine`)."""
    batch_size: int
    """Items per request: the trainer cuts its rollout chunks at multiples of it, so that no chunk ends in a
    partial request (a server's batch costs about as much partly filled as full)."""

    async def score_async(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult: ...

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> concurrent.futures.Future[RewardResult]: ...

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult: ...

    def close(self) -> None: ...


def standardise(values: np.ndarray) -> np.ndarray:
    """``(x - mean) / (std + 1e-8)`` over the finite entries (population std); NaN entries stay NaN."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    if not finite.any():
        return np.full_like(values, np.nan)
    mean = values[finite].mean()
    std = values[finite].std()
    return np.where(finite, (values - mean) / (std + STANDARDISE_EPS), np.nan)


def combine(
    components: Mapping[str, np.ndarray], weights: Mapping[str, float], mode: str = "sum"
) -> np.ndarray:
    """Combine the components with their weights (modes: see the module docstring).

    A NaN in a component with a non-zero weight makes the item NaN; components with weight 0 never
    affect (or invalidate) the combination.
    """
    if not weights:
        raise ValueError("weights must name at least one scorer")
    if mode not in COMBINE_MODES:
        raise ValueError(f"mode must be one of {COMBINE_MODES}, got {mode!r}")
    length = len(next(iter(components.values())))
    combined = np.zeros(length, dtype=np.float64)
    for name, weight in weights.items():
        if weight != 0.0:
            component = np.asarray(components[name], dtype=np.float64)
            combined += float(weight) * (
                standardise(component) if mode == "normalise-then-sum" else component
            )
    return standardise(combined) if mode == "sum-then-normalise" else combined


def _check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    if not weights:
        raise ValueError("weights must name at least one scorer, e.g. {'digit': 1.0}")
    bad = {name: w for name, w in weights.items() if not np.isfinite(w)}
    if bad:
        raise ValueError(f"weights must be finite, got {bad}")
    if all(w == 0 for w in weights.values()):
        raise ValueError(
            f"reward.weights are all 0 ({dict(weights)}): the combined reward would be 0 for every item, "
            "scored or not; give at least one scorer a non-zero weight"
        )
    return {name: float(w) for name, w in weights.items()}


def _check_combine_mode(mode: str) -> str:
    if mode not in COMBINE_MODES:
        raise ValueError(f"combine_mode must be one of {COMBINE_MODES}, got {mode!r}")
    return mode


def _check_batch(
    images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None
) -> tuple[np.ndarray, list[str], list[dict[str, Any]]]:
    """Validate a batch and return a private copy (the caller may reuse its buffers at once)."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        raise ValueError(f"images must be a uint8 numpy array [B, H, W, C], got {type(images).__name__}")
    if images.ndim != 4 or images.shape[3] not in (1, 3):
        raise ValueError(f"images must be [B, H, W, C] with C = 1 or 3, got shape {list(images.shape)}")
    if len(prompts) != len(images):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
    if metadata is not None and len(metadata) != len(images):
        raise ValueError(f"got {len(images)} images but {len(metadata)} metadata entries")
    meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
    return np.array(images, copy=True, order="C"), [str(p) for p in prompts], meta


def _check_metadata_arrays(metadata: Sequence[dict[str, Any]]) -> None:
    """Arrays in metadata travel as images: refuse those that are not uint8 ``[H, W(, 1|3)]``."""
    for index, meta in enumerate(metadata):
        for key, value in meta.items():
            if isinstance(value, np.ndarray) and key != "mask":
                try:
                    as_hwc_uint8(value)
                except ValueError as exc:
                    raise ValueError(
                        f"metadata[{index}][{key!r}]: arrays in metadata are sent as images, and {exc}"
                    ) from None


def _is_retryable(status: int) -> bool:
    return status in (408, 429) or 500 <= status < 600


def _empty_result(
    batch_size: int, names: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, dict[int, str]]]:
    return {name: np.full(batch_size, np.nan) for name in names}, {name: {} for name in names}


@dataclass
class _Replica:
    """What the client knows about one replica.

    ``available`` is the circuit breaker: False once the replica failed ``breaker_failures`` times in a
    row (or refused a connection, or answered 503), True again when a background probe of ``/readyz``
    (and ``/info``, if fingerprints are known) passes.
    """

    url: str
    outstanding: int = 0
    consecutive_failures: int = 0
    available: bool = True
    encodings: frozenset[str] | None = None  # Content-Encodings from /info; None: not known yet
    probe: asyncio.Task[None] | None = None


class _AttemptFailed(Exception):
    """One attempt at one replica failed in a retryable way."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, down: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.down = down  # the replica is certainly not serving (refused connection, 503): open at once


class HttpRewardClient:
    """Scores batches on a pool of reward server replicas.

    Batches are split into chunks of ``batch_size`` items, sent concurrently (at most ``max_concurrency``
    requests in flight over all replicas) to the available replica with the fewest outstanding requests
    (ties in round-robin order). A chunk whose attempt meets a connection error, a timeout, 408, 429 or
    5xx is retried, at most ``max_retries`` times, each time on a replica it has not tried yet (while
    there is one), after a jittered exponential backoff that honours Retry-After. Other 4xx answers
    raise :class:`RewardRequestError` at once.

    Circuit breaker: a replica is taken out of rotation after ``breaker_failures`` consecutive failed
    attempts, or at once when it refuses a connection or answers 503 (loading, draining); a background
    task then probes its ``/readyz`` every ``probe_interval_s`` and re-admits it when it passes (and its
    ``/info`` fingerprints still match the pool's). If every replica is out, attempts go to them anyway,
    so that a dead pool ends in :class:`RewardUnavailableError` rather than a hang.

    On first use the client reads ``/info`` of every replica: the weighted scorers must be served by
    each ready replica with the same model fingerprints (:class:`RewardClientError` otherwise); replicas
    not reachable or not ready yet start out of rotation and join when their probe passes.

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
            None: bounded only by ``(max_retries + 1)`` attempts of ``timeout_s`` plus backoffs.
        backoff_s: base of the exponential backoff between attempts.
        max_backoff_s: cap of one backoff, Retry-After included.
        breaker_failures: consecutive failed attempts that take a replica out of rotation.
        probe_interval_s: how often an out-of-rotation replica's ``/readyz`` is probed.
        hedge: send a second copy of a request that is still running after the p95 of the observed
            request latencies to another replica, and take the first answer (after 20 observations).
        combine_mode: one of :data:`COMBINE_MODES` (see the module docstring).
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
    ) -> None:
        if not urls:
            raise ValueError("urls must name at least one reward server")
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
        self.encoding = wire_format.partition("+")[2] or None
        if self.encoding is not None and self.encoding not in supported_encodings():
            raise ValueError(
                f"wire_format {wire_format!r} needs the {self.encoding} package, which is not installed"
            )
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or breaker_failures < 1:
            raise ValueError("batch_size, max_concurrency, breaker_failures must be >= 1, max_retries >= 0")
        if timeout_s <= 0 or connect_timeout_s <= 0 or (step_timeout_s is not None and step_timeout_s <= 0):
            raise ValueError("timeouts must be > 0")
        self.urls = [url.rstrip("/") for url in urls]
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls must be distinct, got {self.urls}")
        self.weights = _check_weights(weights)
        self.combine_mode = _check_combine_mode(combine_mode)
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.wire_format = wire_format
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.breaker_failures = breaker_failures
        self.probe_interval_s = probe_interval_s
        self.hedge = hedge
        self.verify_replicas = verify_replicas
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self._replicas = {url: _Replica(url) for url in self.urls}
        self._round_robin = itertools.count()
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._fingerprints: dict[str, str] | None = None  # scorer -> version, from the first ready replica
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
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
        batch = _check_batch(images, prompts, metadata)
        _check_metadata_arrays(batch[2])
        return asyncio.run_coroutine_threadsafe(self._score(*batch), self._loop)

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        """Blocking ``submit(...).result()``."""
        return self.submit(images, prompts, metadata).result()

    def check_replicas(self) -> dict[str, InfoResponse]:
        """Fetch ``/info`` of every replica and check they serve the weighted scorers with equal versions.

        Raises:
            RewardClientError: a replica is unreachable, lacks a scorer, or runs a different model version.
        """
        return asyncio.run_coroutine_threadsafe(self._check_replicas(strict=True), self._loop).result()

    def replica_states(self) -> dict[str, dict[str, Any]]:
        """url -> ``{"available", "outstanding", "consecutive_failures"}``, for logs and tests."""

        async def snapshot() -> dict[str, dict[str, Any]]:
            return {
                url: {
                    "available": r.available,
                    "outstanding": r.outstanding,
                    "consecutive_failures": r.consecutive_failures,
                }
                for url, r in self._replicas.items()
            }

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
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
            self._verify_lock = asyncio.Lock()
        return self._http

    async def _aclose(self) -> None:
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()
        if self._http is not None:
            await self._http.aclose()

    async def _score(
        self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> RewardResult:
        self._client()
        assert self._verify_lock is not None
        if self.verify_replicas and not self._verified:
            async with self._verify_lock:
                if not self._verified:
                    await self._check_replicas(strict=False)
                    self._verified = True
        components, errors = _empty_result(len(images), list(self.weights))
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
        combined = combine(components, self.weights, self.combine_mode)
        return RewardResult(components, combined, errors, list(instances))

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
        for attempt in range(self.max_retries + 1):
            replica = self._pick(tried)
            tried.add(replica.url)
            try:
                response = await self._attempt_hedged(replica, bodies, tried)
            except _AttemptFailed as exc:
                failures.append(str(exc))
                if attempt < self.max_retries:
                    delay = min(self.backoff_s * 2**attempt, self.max_backoff_s) * random.uniform(0.5, 1.5)
                    await asyncio.sleep(min(max(delay, exc.retry_after_s or 0.0), self.max_backoff_s))
                continue
            self._store(response, start, stop, components, errors)
            return response.instance
        raise RewardUnavailableError(
            f"items {start}-{stop - 1}: no reward replica answered after {self.max_retries + 1} attempts: "
            + "; ".join(failures)
        )

    def _pick(self, tried: set[str]) -> _Replica:
        """The available replica not yet tried with the fewest outstanding requests (round-robin ties).

        Falls back to available replicas already tried, then to any replica not yet tried, then to any.
        """
        first = next(self._round_robin) % len(self.urls)
        rotated = [self._replicas[url] for url in self.urls[first:] + self.urls[:first]]
        available = [r for r in rotated if r.available]
        candidates = (
            [r for r in available if r.url not in tried]
            or available
            or [r for r in rotated if r.url not in tried]
            or rotated
        )
        return min(candidates, key=lambda r: (r.outstanding, r.consecutive_failures))

    async def _attempt_hedged(
        self, replica: _Replica, bodies: dict[str | None, bytes], tried: set[str]
    ) -> ScoreResponse:
        """One attempt; with ``hedge``, a copy goes to another replica if the first is slower than p95.

        Cancelling it cancels the attempts in flight, which give back their replica and concurrency slot.
        """
        primary = asyncio.ensure_future(self._attempt(replica, bodies))
        pending = {primary}
        try:
            hedge_after = self._hedge_delay_s()
            if hedge_after is None:
                return await primary
            done, _ = await asyncio.wait(pending, timeout=hedge_after)
            if done:
                return primary.result()
            others = [r for r in self._replicas.values() if r.available and r.url not in tried]
            if not others:
                return await primary
            backup = min(others, key=lambda r: r.outstanding)
            tried.add(backup.url)
            logger.debug("hedging a request to %s after %.3f s on %s", backup.url, hedge_after, replica.url)
            pending.add(asyncio.ensure_future(self._attempt(backup, bodies)))
            failure: _AttemptFailed | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    try:
                        return task.result()
                    except _AttemptFailed as exc:
                        failure = exc
            assert failure is not None
            raise failure
        finally:
            for task in pending:
                task.cancel()

    def _hedge_delay_s(self) -> float | None:
        if not self.hedge or len(self._latencies) < 20:
            return None
        return float(np.percentile(np.fromiter(self._latencies, float), 95))

    async def _attempt(self, replica: _Replica, bodies: dict[str | None, bytes]) -> ScoreResponse:
        """POST one chunk to one replica and parse the answer; update the replica's health.

        Raises:
            _AttemptFailed: retryable failure (connection error, timeout, 408/429/5xx, bad response).
            RewardRequestError: the replica rejected the request as invalid.
        """
        client = self._client()
        assert self._semaphore is not None
        encoding = self._encoding_for(replica)
        if encoding not in bodies:
            bodies[encoding] = await asyncio.to_thread(compress_body, bodies[None], encoding)
        headers = {"Content-Type": self._media_type, **self._auth}
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        async with self._semaphore:
            replica.outstanding += 1
            started = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    client.post(f"{replica.url}/score", content=bodies[encoding], headers=headers),
                    timeout=self.timeout_s,
                )
            except asyncio.TimeoutError:
                raise self._failed(replica, f"{replica.url}: no answer within {self.timeout_s} s") from None
            except httpx.TransportError as exc:
                down = isinstance(exc, httpx.ConnectError)
                raise self._failed(
                    replica, f"{replica.url}: {type(exc).__name__}: {exc}", down=down
                ) from None
            finally:
                replica.outstanding -= 1
        elapsed = time.monotonic() - started
        status = response.status_code
        if status == 200:
            try:
                parsed = ScoreResponse.model_validate_json(response.content)
            except ValidationError as exc:
                raise self._failed(replica, f"{replica.url}: malformed response: {exc}") from None
            changed = self._changed_models(parsed.models)
            if changed is not None:  # e.g. restarted with other weights: its scores would not be comparable
                raise self._failed(replica, f"{replica.url}: {changed}", down=True)
            replica.consecutive_failures = 0
            self._latencies.append(elapsed)
            return parsed
        if status == 415 and encoding is not None:  # the replica does not take this encoding after all
            replica.encodings = frozenset()
            raise _AttemptFailed(f"{replica.url}: HTTP 415: {_detail(response)}", retry_after_s=0.0)
        if status == 429:  # overloaded, not broken: no strike against the replica
            raise _AttemptFailed(
                f"{replica.url}: HTTP 429: {_detail(response)}", retry_after_s=_retry_after_s(response)
            )
        if _is_retryable(status):
            raise self._failed(
                replica,
                f"{replica.url}: HTTP {status}: {_detail(response)}",
                retry_after_s=_retry_after_s(response),
                down=status == 503,
            )
        raise RewardRequestError(
            f"{replica.url}/score rejected the request with HTTP {status}: {_detail(response)}"
        )

    def _failed(
        self, replica: _Replica, message: str, *, retry_after_s: float | None = None, down: bool = False
    ) -> _AttemptFailed:
        """Record a failed attempt (maybe opening the replica's circuit) and return the exception."""
        replica.consecutive_failures += 1
        if replica.available and (down or replica.consecutive_failures >= self.breaker_failures):
            logger.warning("reward replica %s out of rotation: %s", replica.url, message)
            self._take_out(replica)
        return _AttemptFailed(message, retry_after_s=retry_after_s, down=down)

    def _take_out(self, replica: _Replica) -> None:
        replica.available = False
        if replica.probe is None or replica.probe.done():
            replica.probe = asyncio.ensure_future(self._probe(replica))

    async def _probe(self, replica: _Replica) -> None:
        """Poll ``/readyz`` (then ``/info``) until the replica passes, then put it back in rotation."""
        client = self._client()
        probe_timeout = httpx.Timeout(max(1.0, self.probe_interval_s * 4), connect=1.0)
        while not replica.available:
            await asyncio.sleep(self.probe_interval_s)
            try:
                ready = await client.get(f"{replica.url}/readyz", timeout=probe_timeout)
                if ready.status_code != 200:
                    continue
                info = await client.get(f"{replica.url}/info", headers=self._auth, timeout=probe_timeout)
                info.raise_for_status()
                parsed = InfoResponse.model_validate_json(info.content)
            except (httpx.HTTPError, ValidationError):
                continue
            problem = self._fingerprint_problem(parsed)
            if problem is not None:
                logger.warning("reward replica %s stays out of rotation: %s", replica.url, problem)
                continue
            replica.encodings = frozenset(parsed.encodings)
            replica.consecutive_failures = 0
            replica.available = True
            logger.info("reward replica %s back in rotation (%s)", replica.url, parsed.instance)

    def _fingerprint_problem(self, info: InfoResponse) -> str | None:
        """Why a ready replica's ``/info`` does not fit the pool, or None (recording the first fit)."""
        versions = {scorer.name: scorer.version for scorer in info.scorers}
        missing = [name for name in self.weights if name not in versions]
        if missing:
            return f"it does not serve scorer(s) {missing}; it has {sorted(versions)}"
        if self._fingerprints is None:
            self._fingerprints = {name: versions[name] for name in self.weights}
            return None
        for name, expected in self._fingerprints.items():
            if versions[name] != expected:
                return f"it runs {name} {versions[name]}, other replicas run {expected}"
        return None

    def _changed_models(self, models: dict[str, str]) -> str | None:
        """Why a response's model fingerprints differ from the pool's, or None."""
        for name, expected in (self._fingerprints or {}).items():
            if models.get(name, expected) != expected:
                return f"it now runs {name} {models[name]}, the pool {expected}"
        return None

    @property
    def _media_type(self) -> str:
        return MSGPACK_MEDIA_TYPE if self.wire_format.startswith("msgpack") else JSON_MEDIA_TYPE

    def _encoding_for(self, replica: _Replica) -> str | None:
        if self.encoding is None or (
            replica.encodings is not None and self.encoding not in replica.encodings
        ):
            return None
        return self.encoding

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
        binary = self.wire_format.startswith("msgpack")
        image_format = "raw" if binary else self.wire_format
        body = {
            "request_id": uuid.uuid4().hex,
            "deadline_ms": min(max(1, int(self.timeout_s * 800)), MAX_DEADLINE_MS),
            "scorers": list(self.weights),
            "items": [
                _item(str(start + i), image, prompt, meta, image_format, binary)
                for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True))
            ],
        }
        if binary:
            return pack_msgpack(body)
        try:
            return json.dumps(body).encode()
        except TypeError as exc:
            raise ValueError(f"metadata must be JSON-serialisable: {exc}") from exc

    def _store(
        self,
        response: ScoreResponse,
        start: int,
        stop: int,
        components: dict[str, np.ndarray],
        errors: dict[str, dict[int, str]],
    ) -> None:
        """Copy one chunk's scores; a result missing from the response is a NaN with an error."""
        by_id = {result.id: result for result in response.results}
        for index in range(start, stop):
            item = by_id.get(str(index))
            for name in self.weights:
                result = item.scores.get(name) if item is not None else None
                if result is None:
                    errors[name][index] = f"MISSING: {response.instance} returned no {name} result"
                elif result.ok and result.score is not None:
                    components[name][index] = result.score
                else:
                    error = result.error
                    errors[name][index] = f"{error.code.value}: {error.message}" if error else "missing error"

    async def _check_replicas(self, *, strict: bool) -> dict[str, InfoResponse]:
        """Read every replica's ``/info`` and check the weighted scorers and their fingerprints.

        ``strict``: an unreachable or unready replica is an error; otherwise it is taken out of rotation
        (and probed), and only ready replicas' fingerprints are compared.
        """
        client = self._client()

        async def fetch(url: str) -> InfoResponse | None:
            try:
                response = await client.get(f"{url}/info", headers=self._auth)
            except httpx.TransportError as exc:
                if strict:
                    raise RewardClientError(f"cannot read {url}/info: {exc}") from exc
                return None
            if _is_retryable(response.status_code) and not strict:
                return None
            if response.status_code != 200:
                raise RewardRequestError(
                    f"{url}/info answered HTTP {response.status_code}: {_detail(response)}"
                )
            try:
                return InfoResponse.model_validate_json(response.content)
            except ValidationError as exc:
                raise RewardClientError(f"cannot read {url}/info: {exc}") from exc

        infos = dict(zip(self.urls, await asyncio.gather(*(fetch(url) for url in self.urls)), strict=True))
        for url, info in infos.items():
            replica = self._replicas[url]
            if info is None or not (info.ready or strict):
                if replica.available:
                    logger.warning("reward replica %s not ready at start-up; probing it", url)
                    self._take_out(replica)
                continue
            problem = self._fingerprint_problem(info)
            if problem is not None:
                raise RewardClientError(f"{url}: {problem}")
            replica.encodings = frozenset(info.encodings)
        return {url: info for url, info in infos.items() if info is not None}


def _detail(response: httpx.Response) -> str:
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _retry_after_s(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


class InProcessRewardClient:
    """The :class:`RewardClient` contract, calling loaded scorer objects directly (tests, no-server runs).

    Images take the same path as on a server (uint8 ``[H, W, C]``, C = 1 is grayscale) and per-item
    failures are NaN exactly as over HTTP. Scoring runs on one background thread.
    """

    def __init__(
        self,
        scorers: Mapping[str, Scorer],
        weights: dict[str, float],
        *,
        batch_size: int = 32,
        combine_mode: str = "sum",
    ) -> None:
        """Args: ``scorers`` are loaded scorer objects; ``weights`` must only name scorers among them."""
        self.weights = _check_weights(weights)
        self.combine_mode = _check_combine_mode(combine_mode)
        missing = [name for name in self.weights if name not in scorers]
        if missing:
            raise ValueError(f"weights name scorer(s) {missing} that are not given; have {sorted(scorers)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.scorers = dict(scorers)
        self.batch_size = batch_size
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="reward-inproc"
        )

    @classmethod
    def from_names(
        cls, weights: dict[str, float], *, batch_size: int = 32, combine_mode: str = "sum"
    ) -> InProcessRewardClient:
        """Build and load the weighted scorers from the reward server's registry."""
        from reward_server.scorers import build_scorers

        return cls(
            build_scorers(list(weights), load=True), weights, batch_size=batch_size, combine_mode=combine_mode
        )

    async def score_async(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        return await asyncio.wrap_future(self.submit(images, prompts, metadata))

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> concurrent.futures.Future[RewardResult]:
        batch = _check_batch(images, prompts, metadata)
        return self._executor.submit(self._score, *batch)

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        return self.submit(images, prompts, metadata).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> InProcessRewardClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardResult:
        from reward_server.scorers import run_scorer

        components, errors = _empty_result(len(images), list(self.weights))
        for start in range(0, len(images), self.batch_size):
            stop = min(start + self.batch_size, len(images))
            for name in self.weights:
                outcomes: list[ScoreOutcome] = run_scorer(
                    self.scorers[name], list(images[start:stop]), prompts[start:stop], metadata[start:stop]
                )
                for index, outcome in enumerate(outcomes, start):
                    if outcome.error is None:
                        components[name][index] = outcome.score
                    else:
                        errors[name][index] = f"{outcome.error.value}: {outcome.message}"
        combined = combine(components, self.weights, self.combine_mode)
        return RewardResult(components, combined, errors, ["in-process"])


def _item(item_id: str, image: np.ndarray, prompt: str, meta: dict[str, Any], image_format: str,
          binary: bool) -> dict[str, Any]:
    """One ``/score`` item. A task's mask (``meta["mask"]``, uint8 [H, W, 1], where in-process scorers read
    it) travels in the item's ``mask`` field: the protocol reserves that metadata key for the decoded mask.
    Other arrays in metadata (e.g. an edit's ``reference_image``) travel in ``metadata_images``, which the
    server decodes back into the item's metadata."""
    meta = dict(meta)
    mask = meta.pop("mask", None)
    arrays = {key: meta.pop(key) for key, value in list(meta.items()) if isinstance(value, np.ndarray)}
    item = {"id": item_id, "prompt": prompt, "image": encode_image(image, image_format, binary=binary),
            "metadata": meta}
    if mask is not None:
        item["mask"] = encode_image(np.asarray(mask, dtype=np.uint8), image_format, binary=binary)
    if arrays:
        item["metadata_images"] = {
            key: encode_image(array, image_format, binary=binary) for key, array in arrays.items()
        }
    return item
