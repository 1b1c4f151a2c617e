"""One attempt at scoring a chunk: its POST to one replica (and, with hedging, a copy to another), the answer
read, and the replica's health updated. The client's retry loop (:mod:`trainer.rewards.client`) calls it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import httpx
import numpy as np
from pydantic import ValidationError

from shared.protocol import ScoreResponse
from shared.wire import compress_body
from trainer.rewards.errors import AttemptFailed, RewardRequestError, is_retryable
from trainer.rewards.pool import Replica, ReplicaPool
from trainer.rewards.wire import detail, media_type, retry_after_s

logger = logging.getLogger("rewardflow.rewards")

_LATENCY_WINDOW = 256
REPLICA_REFUSALS = (401, 403, 404, 413)
"""4xx answers that depend on the replica's settings (token, routes, size limits), not on the request alone: the
replica leaves rotation and the request goes to another, while there is one in rotation."""


class Attempts:
    """Sends a chunk's body to a replica of ``pool`` over ``http`` (the client's lazily made HTTP client), at
    most ``max_concurrency`` requests at once; with ``hedge``, a copy goes to another replica once the first is
    slower than the p95 of the observed latencies. Runs on the client's event loop."""

    def __init__(
        self,
        pool: ReplicaPool,
        http: Callable[[], httpx.AsyncClient],
        *,
        wire_format: str,
        auth: dict[str, str],
        timeout_s: float,
        max_concurrency: int,
        hedge: bool,
    ) -> None:
        self.pool = pool
        self._http = http
        self.wire_format = wire_format
        self.encoding = wire_format.partition("+")[2] or None
        self._auth = auth
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.hedge = hedge
        self.latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)
        self._semaphore: asyncio.Semaphore | None = None

    async def hedged(self, replica: Replica, bodies: dict[str | None, bytes], tried: set[str]) -> ScoreResponse:
        """One attempt; with ``hedge``, a copy goes to another replica if the first is slower than p95.

        Cancelling it cancels the attempts in flight, which give back their replica and concurrency slot.
        """
        primary = asyncio.ensure_future(self.one(replica, bodies))
        pending = {primary}
        try:
            hedge_after = self._hedge_delay_s()
            if hedge_after is None:
                return await primary
            done, _ = await asyncio.wait(pending, timeout=hedge_after)
            if done:
                return primary.result()
            backup = self.pool.hedge_target(tried)
            if backup is None:
                return await primary
            tried.add(backup.url)
            logger.debug("hedging a request to %s after %.3f s on %s", backup.url, hedge_after, replica.url)
            pending.add(asyncio.ensure_future(self.one(backup, bodies)))
            failure: AttemptFailed | None = None
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    try:
                        return task.result()
                    except AttemptFailed as exc:
                        failure = exc
            assert failure is not None
            raise failure
        finally:
            for task in pending:
                task.cancel()

    def _hedge_delay_s(self) -> float | None:
        if not self.hedge or len(self.latencies) < 20:
            return None
        return float(np.percentile(np.fromiter(self.latencies, float), 95))

    async def one(self, replica: Replica, bodies: dict[str | None, bytes]) -> ScoreResponse:
        """POST one chunk to one replica and parse the answer; update the replica's health.

        Raises:
            AttemptFailed: retryable failure (connection error, timeout, 408/429/5xx, bad response).
            RewardRequestError: the replica rejected the request as invalid.
        """
        encoding = self._encoding_for(replica)
        if encoding not in bodies:
            bodies[encoding] = await asyncio.to_thread(compress_body, bodies[None], encoding)
        headers = {"Content-Type": media_type(self.wire_format), **self._auth}
        if encoding is not None:
            headers["Content-Encoding"] = encoding
        response, elapsed = await self._post(replica, bodies[encoding], headers)
        return self._read(replica, response, encoding, elapsed)

    async def _post(self, replica: Replica, body: bytes, headers: dict[str, str]) -> tuple[httpx.Response, float]:
        """The replica's answer and how long it took, within a concurrency slot; no answer is a failed attempt."""
        client = self._http()
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        async with self._semaphore:
            replica.outstanding += 1
            started = time.monotonic()
            try:
                response = await asyncio.wait_for(
                    client.post(f"{replica.url}/score", content=body, headers=headers), timeout=self.timeout_s
                )
            except asyncio.TimeoutError:
                raise self.pool.failed(replica, f"{replica.url}: no answer within {self.timeout_s} s") from None
            except httpx.RequestError as exc:  # transport errors, and an answer it cannot decode
                down = isinstance(exc, httpx.ConnectError)
                raise self.pool.failed(replica, f"{replica.url}: {type(exc).__name__}: {exc}", down=down) from None
            finally:
                replica.outstanding -= 1
        return response, time.monotonic() - started

    def _read(self, replica: Replica, response: httpx.Response, encoding: str | None, elapsed: float) -> ScoreResponse:
        """The parsed scores of a 200; any other status is a failed attempt, or the request's own error."""
        status = response.status_code
        if status == 200:
            return self._scores(replica, response, elapsed)
        if status == 415 and encoding is not None:  # the replica does not take this encoding after all
            replica.encodings = frozenset()
            raise AttemptFailed(f"{replica.url}: HTTP 415: {detail(response)}", retry_after_s=0.0)
        if status == 429:  # overloaded, not broken: no strike against the replica
            raise AttemptFailed(f"{replica.url}: HTTP 429: {detail(response)}", retry_after_s=retry_after_s(response))
        if is_retryable(status):
            raise self.pool.failed(
                replica,
                f"{replica.url}: HTTP {status}: {detail(response)}",
                retry_after_s=retry_after_s(response),
                down=status == 503,
            )
        if status in REPLICA_REFUSALS and self.pool.others_in_rotation(replica):
            raise self.pool.failed(
                replica,
                f"{replica.url} refused the request with HTTP {status} ("
                f"{detail(response)}), which the others may take: check its token and limits",
                retry_after_s=0.0,
                down=True,
            )
        raise RewardRequestError(f"{replica.url}/score rejected the request with HTTP {status}: {detail(response)}")

    def _scores(self, replica: Replica, response: httpx.Response, elapsed: float) -> ScoreResponse:
        """A 200's body, if it parses and the replica still serves the pool's models; its latency is recorded."""
        try:
            parsed = ScoreResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise self.pool.failed(replica, f"{replica.url}: malformed response: {exc}") from None
        changed = self.pool.changed_models(parsed.models)
        if changed is not None:  # e.g. restarted with other weights: its scores would not be comparable
            raise self.pool.failed(replica, f"{replica.url}: {changed}", down=True)
        self.pool.succeeded(replica)
        self.latencies.append(elapsed)
        return parsed

    def _encoding_for(self, replica: Replica) -> str | None:
        if self.encoding is None or (replica.encodings is not None and self.encoding not in replica.encodings):
            return None
        return self.encoding
