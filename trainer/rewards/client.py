"""The trainer's only way to reach rewards: a pool client over HTTP replicas, and an in-process twin.

Both implement :class:`RewardClient`: ``score_async`` / ``submit`` / ``score`` return a
:class:`RewardResult` with one float64 array per scorer and their weighted combination. A reward that
could not be computed is NaN, never 0: the algorithm gives such samples no advantage and counts them.
If a whole chunk cannot be scored by any replica, :class:`RewardUnavailableError` is raised.

The HTTP client runs on a private event loop in a background thread, so the (synchronous) training loop
can ``submit`` batch k and keep sampling batch k+1 while it is scored. No torch here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import numpy as np
from pydantic import ValidationError

from shared.imagecodec import encode_image
from shared.protocol import InfoResponse, ScoreResponse

if TYPE_CHECKING:
    from reward_server.scorers import ScoreOutcome, Scorer

WIRE_FORMATS = ("png", "raw")
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RewardClientError(RuntimeError):
    """Base class of reward client failures."""


class RewardUnavailableError(RewardClientError):
    """No replica could score a chunk within the allowed retries (connection errors, timeouts, 429, 5xx)."""


class RewardRequestError(RewardClientError):
    """A replica rejected a request as invalid (a 4xx other than 408/429); retrying cannot help."""


@dataclass
class RewardResult:
    """Rewards of one batch.

    Attributes:
        components: scorer name -> float64 ``[B]``; NaN where that scorer failed for the item.
        combined: float64 ``[B]``, ``sum(weight * component)`` over the non-zero weights; NaN if any of
            those components is NaN.
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


class RewardClient(Protocol):
    """What the trainer needs from a reward client (HTTP pool or in-process)."""

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


def combine(components: Mapping[str, np.ndarray], weights: Mapping[str, float]) -> np.ndarray:
    """Weighted sum of the components; a NaN in a component with a non-zero weight makes the item NaN.

    Components with weight 0 are scored and logged but never affect (or invalidate) the combination.
    """
    if not weights:
        raise ValueError("weights must name at least one scorer")
    length = len(next(iter(components.values())))
    combined = np.zeros(length, dtype=np.float64)
    for name, weight in weights.items():
        if weight != 0.0:
            combined += float(weight) * components[name]
    return combined


def _check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    if not weights:
        raise ValueError("weights must name at least one scorer, e.g. {'digit': 1.0}")
    bad = {name: w for name, w in weights.items() if not np.isfinite(w)}
    if bad:
        raise ValueError(f"weights must be finite, got {bad}")
    return {name: float(w) for name, w in weights.items()}


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
    return np.array(images, copy=True), [str(p) for p in prompts], meta


def _empty_result(
    batch_size: int, names: Sequence[str]
) -> tuple[dict[str, np.ndarray], dict[str, dict[int, str]]]:
    return {name: np.full(batch_size, np.nan) for name in names}, {name: {} for name in names}


class HttpRewardClient:
    """Scores batches on a pool of reward server replicas.

    Batches are split into chunks of ``batch_size`` items, sent concurrently (at most ``max_concurrency``
    requests in flight) round-robin over the replicas. A chunk that meets a connection error, a timeout,
    408, 429 or 5xx is retried (at most ``max_retries`` times) on a different replica after a jittered
    exponential backoff that honours Retry-After; a replica that failed is tried last for
    ``cooldown_s``. Other 4xx answers raise :class:`RewardRequestError` at once.

    Args:
        urls: base URLs of the replicas, e.g. ``["http://127.0.0.1:8000"]``.
        weights: scorer name -> weight; these scorers are requested from every replica.
        token: bearer token of the servers, if they require one.
        timeout_s: per-attempt timeout. The server is asked to finish within 80% of it (``deadline_ms``),
            so that a slow item comes back as a NaN rather than the whole chunk timing out.
        max_concurrency: requests in flight at once, over all replicas.
        batch_size: items per request.
        max_retries: further attempts per chunk after the first.
        wire_format: ``png`` (lossless, compact, CPU-heavy) or ``raw`` (lossless, cheap, larger).
        connect_timeout_s: for establishing a connection.
        backoff_s: base of the exponential backoff between attempts.
        cooldown_s: how long a failed replica is tried after the healthy ones.
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
        wire_format: str = "png",
        connect_timeout_s: float = 5.0,
        backoff_s: float = 0.2,
        cooldown_s: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError("urls must name at least one reward server")
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
        if batch_size < 1 or max_concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("batch_size and max_concurrency must be >= 1, max_retries >= 0, timeout_s > 0")
        self.urls = [url.rstrip("/") for url in urls]
        self.weights = _check_weights(weights)
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.batch_size = batch_size
        self.max_retries = max_retries
        self.wire_format = wire_format
        self.backoff_s = backoff_s
        self.cooldown_s = cooldown_s
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self._round_robin = itertools.count()
        self._failed_until: dict[str, float] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._http: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
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
        return asyncio.run_coroutine_threadsafe(self._check_replicas(), self._loop).result()

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
            limits = httpx.Limits(
                max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
            )
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=limits, trust_env=False)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
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
        components, errors = _empty_result(len(images), list(self.weights))
        tasks = [
            asyncio.ensure_future(self._score_chunk(start, images, prompts, metadata, components, errors))
            for start in range(0, len(images), self.batch_size)
        ]
        try:
            instances = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return RewardResult(components, combine(components, self.weights), errors, list(instances))

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
            self._encode, start, images[start:stop], prompts[start:stop], metadata[start:stop]
        )
        client = self._client()
        assert self._semaphore is not None
        replicas = self._replica_order()
        failures: list[str] = []
        for attempt in range(self.max_retries + 1):
            url = replicas[attempt % len(replicas)]
            retry_after = None
            async with self._semaphore:
                try:
                    response = await client.post(f"{url}/score", content=body, headers=self._headers)
                except httpx.TransportError as exc:
                    failures.append(f"{url}: {type(exc).__name__}: {exc}")
                else:
                    if response.status_code == 200:
                        try:
                            parsed = ScoreResponse.model_validate_json(response.content)
                            self._store(parsed, start, stop, components, errors)
                            self._failed_until.pop(url, None)
                            return parsed.instance
                        except (ValidationError, KeyError) as exc:
                            failures.append(f"{url}: malformed response: {exc}")
                    elif response.status_code in _RETRYABLE_STATUS:
                        failures.append(f"{url}: HTTP {response.status_code}: {_detail(response)}")
                        retry_after = _retry_after_s(response)
                    else:
                        raise RewardRequestError(
                            f"{url}/score rejected the request with HTTP {response.status_code}: {_detail(response)}"
                        )
            self._failed_until[url] = time.monotonic() + self.cooldown_s
            if attempt < self.max_retries:
                delay = self.backoff_s * 2**attempt * random.uniform(0.5, 1.5)
                await asyncio.sleep(min(max(delay, retry_after or 0.0), 30.0))
        raise RewardUnavailableError(
            f"items {start}-{stop - 1}: no reward replica answered after {self.max_retries + 1} attempts: "
            + "; ".join(failures)
        )

    def _replica_order(self) -> list[str]:
        """Replicas in round-robin order, those that failed within ``cooldown_s`` last."""
        first = next(self._round_robin) % len(self.urls)
        rotated = self.urls[first:] + self.urls[:first]
        now = time.monotonic()
        healthy = [url for url in rotated if self._failed_until.get(url, 0.0) <= now]
        return healthy + [url for url in rotated if url not in healthy]

    def _encode(
        self, start: int, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> bytes:
        items = [
            {
                "id": str(start + i),
                "prompt": prompt,
                "image": encode_image(image, self.wire_format),
                "metadata": meta,
            }
            for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True))
        ]
        body = {
            "request_id": uuid.uuid4().hex,
            "deadline_ms": max(1, int(self.timeout_s * 800)),
            "scorers": list(self.weights),
            "items": items,
        }
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
        by_id = {result.id: result for result in response.results}
        for index in range(start, stop):
            scores = by_id[str(index)].scores
            for name in self.weights:
                result = scores[name]
                if result.ok and result.score is not None:
                    components[name][index] = result.score
                else:
                    error = result.error
                    errors[name][index] = f"{error.code.value}: {error.message}" if error else "missing error"

    async def _check_replicas(self) -> dict[str, InfoResponse]:
        client = self._client()
        infos: dict[str, InfoResponse] = {}
        for url in self.urls:
            try:
                response = await client.get(f"{url}/info", headers=self._headers)
                response.raise_for_status()
                infos[url] = InfoResponse.model_validate_json(response.content)
            except (httpx.HTTPError, ValidationError) as exc:
                raise RewardClientError(f"cannot read {url}/info: {exc}") from exc
        reference: dict[str, str] = {}
        for url, info in infos.items():
            versions = {scorer.name: scorer.version for scorer in info.scorers}
            missing = [name for name in self.weights if name not in versions]
            if missing:
                raise RewardClientError(
                    f"{url} does not serve scorer(s) {missing}; it has {sorted(versions)}"
                )
            for name in self.weights:
                expected = reference.setdefault(name, versions[name])
                if versions[name] != expected:
                    raise RewardClientError(
                        f"{url} runs {name} {versions[name]}, other replicas run {expected}"
                    )
        return infos


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
        self, scorers: Mapping[str, Scorer], weights: dict[str, float], *, batch_size: int = 32
    ) -> None:
        """Args: ``scorers`` are loaded scorer objects; ``weights`` must only name scorers among them."""
        self.weights = _check_weights(weights)
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
    def from_names(cls, weights: dict[str, float], *, batch_size: int = 32) -> InProcessRewardClient:
        """Build and load the weighted scorers from the reward server's registry."""
        from reward_server.scorers import build_scorers

        return cls(build_scorers(list(weights), load=True), weights, batch_size=batch_size)

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
        return RewardResult(components, combine(components, self.weights), errors, ["in-process"])
