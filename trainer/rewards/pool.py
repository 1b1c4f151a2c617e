"""The replicas behind one client: which are in rotation (a circuit breaker per replica, probed back in), which
one takes the next request, and whether they all serve the same models (fingerprints from ``/info``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from shared.protocol import InfoResponse
from trainer.rewards.errors import AttemptFailed, RewardClientError, RewardRequestError, is_retryable
from trainer.rewards.wire import detail

logger = logging.getLogger("rewardflow.rewards")


@dataclass
class Replica:
    """What the client knows about one replica.

    ``available`` is the circuit breaker: False once the replica failed ``breaker_failures`` times in a row
    (or refused a connection, or answered 503), True again when a background probe of ``/readyz`` (and
    ``/info``, if fingerprints are known) passes.
    """

    url: str
    outstanding: int = 0
    consecutive_failures: int = 0
    available: bool = True
    encodings: frozenset[str] | None = None  # Content-Encodings from /info; None: not known yet
    probe: asyncio.Task[None] | None = None


class ReplicaPool:
    """Health and choice of the replicas at ``urls``, all of which must serve ``scorers`` at equal versions.

    Circuit breaker: a replica is taken out of rotation after ``breaker_failures`` consecutive failed
    attempts, or at once when it refuses a connection or answers 503 (loading, draining); a background task
    then probes its ``/readyz`` every ``probe_interval_s`` and re-admits it when it passes (and its ``/info``
    fingerprints still match the pool's). :meth:`check` reads every replica's ``/info``: the scorers must be
    served by each ready replica with the same model fingerprints (:class:`RewardClientError` otherwise);
    replicas not reachable or not ready yet start out of rotation and join when their probe passes.

    Runs on the client's event loop; ``http`` returns its (lazily made) HTTP client and ``auth`` its headers.
    """

    def __init__(
        self,
        urls: Sequence[str],
        scorers: Sequence[str],
        *,
        http: Callable[[], httpx.AsyncClient],
        auth: dict[str, str],
        breaker_failures: int,
        probe_interval_s: float,
    ) -> None:
        self.urls = list(urls)
        self.scorers = list(scorers)
        self.replicas = {url: Replica(url) for url in self.urls}
        self.breaker_failures = breaker_failures
        self.probe_interval_s = probe_interval_s
        self._http = http
        self._auth = auth
        self._round_robin = itertools.count()
        self._fingerprints: dict[str, str] | None = None  # scorer -> version, from the first ready replica
        self.outage_since: float | None = None  # when a request first found every replica out (monotonic)

    def pick(self, tried: set[str]) -> Replica:
        """The available replica not yet tried with the fewest outstanding requests (round-robin ties).

        Falls back to available replicas already tried, then to any replica not yet tried, then to any.
        """
        first = next(self._round_robin) % len(self.urls)
        rotated = [self.replicas[url] for url in self.urls[first:] + self.urls[:first]]
        available = [r for r in rotated if r.available]
        candidates = (
            [r for r in available if r.url not in tried]
            or available
            or [r for r in rotated if r.url not in tried]
            or rotated
        )
        return min(candidates, key=lambda r: (r.outstanding, r.consecutive_failures))

    def hedge_target(self, tried: set[str]) -> Replica | None:
        """The least busy available replica not yet tried, for a hedged copy of a request."""
        others = [r for r in self.replicas.values() if r.available and r.url not in tried]
        return min(others, key=lambda r: r.outstanding) if others else None

    def states(self) -> dict[str, dict[str, Any]]:
        return {
            url: {
                "available": r.available,
                "outstanding": r.outstanding,
                "consecutive_failures": r.consecutive_failures,
            }
            for url, r in self.replicas.items()
        }

    def others_in_rotation(self, replica: Replica) -> bool:
        """Whether a replica other than ``replica`` is in rotation."""
        return any(r.available for r in self.replicas.values() if r is not replica)

    def all_out(self) -> bool:
        """Whether every replica is out of rotation."""
        return not any(r.available for r in self.replicas.values())

    async def wait_for_a_replica(self, timeout_s: float, allowed_s: float, give_up: Callable[[], bool]) -> bool:
        """Wait at most ``timeout_s`` until a probe puts a replica back in rotation; False if none came back or
        ``give_up()`` turned true. The first request to wait in an outage says so (``allowed_s``: how long a
        request may wait in all)."""
        if self.outage_since is None:
            self.outage_since = time.monotonic()
            logger.warning(
                "every reward replica is out of rotation: waiting up to %.0f s for one to come back (reward.outage_s)",
                allowed_s,
            )
        deadline = time.monotonic() + timeout_s
        while self.all_out():
            left = deadline - time.monotonic()
            if left <= 0 or give_up():
                return False
            await asyncio.sleep(min(self.probe_interval_s, left))
        return True

    def succeeded(self, replica: Replica) -> None:
        replica.consecutive_failures = 0

    def failed(
        self, replica: Replica, message: str, *, retry_after_s: float | None = None, down: bool = False
    ) -> AttemptFailed:
        """Record a failed attempt (maybe opening the replica's circuit) and return the exception."""
        replica.consecutive_failures += 1
        if replica.available and (down or replica.consecutive_failures >= self.breaker_failures):
            logger.warning("reward replica %s out of rotation: %s", replica.url, message)
            self._take_out(replica)
        return AttemptFailed(message, retry_after_s=retry_after_s, down=down)

    def _take_out(self, replica: Replica) -> None:
        replica.available = False
        if replica.probe is None or replica.probe.done():
            replica.probe = asyncio.ensure_future(self._probe(replica))

    async def _probe(self, replica: Replica) -> None:
        """Poll ``/readyz`` (then ``/info``) until the replica passes, then put it back in rotation."""
        client = self._http()
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
            if self.outage_since is not None:  # the end of an outage is as visible as its start
                logger.warning(
                    "reward replica %s back in rotation (%s) after %.1f s without any",
                    replica.url,
                    parsed.instance,
                    time.monotonic() - self.outage_since,
                )
                self.outage_since = None
            else:
                logger.info("reward replica %s back in rotation (%s)", replica.url, parsed.instance)

    def _fingerprint_problem(self, info: InfoResponse) -> str | None:
        """Why a ready replica's ``/info`` does not fit the pool, or None (recording the first fit)."""
        versions = {scorer.name: scorer.version for scorer in info.scorers}
        missing = [name for name in self.scorers if name not in versions]
        if missing:
            return f"it does not serve scorer(s) {missing}; it has {sorted(versions)}"
        if self._fingerprints is None:
            self._fingerprints = {name: versions[name] for name in self.scorers}
            return None
        for name, expected in self._fingerprints.items():
            if versions[name] != expected:
                return f"it runs {name} {versions[name]}, other replicas run {expected}"
        return None

    def changed_models(self, models: dict[str, str]) -> str | None:
        """Why a response's model fingerprints differ from the pool's, or None."""
        for name, expected in (self._fingerprints or {}).items():
            if models.get(name, expected) != expected:
                return f"it now runs {name} {models[name]}, the pool {expected}"
        return None

    async def check(self, *, strict: bool) -> dict[str, InfoResponse]:
        """Read every replica's ``/info`` and check the scorers and their fingerprints.

        ``strict``: an unreachable or unready replica is an error; otherwise it is taken out of rotation
        (and probed), and only ready replicas' fingerprints are compared.
        """
        client = self._http()

        async def fetch(url: str) -> InfoResponse | None:
            try:
                response = await client.get(f"{url}/info", headers=self._auth)
            except httpx.TransportError as exc:
                if strict:
                    raise RewardClientError(f"cannot read {url}/info: {exc}") from exc
                return None
            if is_retryable(response.status_code) and not strict:
                return None
            if response.status_code != 200:
                raise RewardRequestError(f"{url}/info answered HTTP {response.status_code}: {detail(response)}")
            try:
                return InfoResponse.model_validate_json(response.content)
            except ValidationError as exc:
                raise RewardClientError(f"cannot read {url}/info: {exc}") from exc

        infos = dict(zip(self.urls, await asyncio.gather(*(fetch(url) for url in self.urls)), strict=True))
        for url, info in infos.items():
            replica = self.replicas[url]
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
