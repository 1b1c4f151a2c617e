"""The trainer's HTTP reward client over real replicas on 127.0.0.1: round-robin, retries on other replicas,
hedging, timeouts and budgets, and replicas that are down, not ready, overloaded or serve another model."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.responses import JSONResponse
from fixtures_reward_server import SCORERS, StubScorer, dead_url, digit_images, wait_until
from servers import replica_answering, serve

from reward_server.app import create_app
from reward_server.inprocess import InProcessRewardClient
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image
from trainer.rewards import (
    HttpRewardClient,
    LocalRewardPool,
    RewardClientError,
    RewardRequestError,
    RewardUnavailableError,
)
from trainer.rewards.wire import WIRE_FORMATS


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_client_round_robins_and_matches_in_process_scores(
    pool: LocalRewardPool, in_process: InProcessRewardClient, wire_format: str
) -> None:
    images, labels = digit_images(12)
    prompts = [f"digit {label}" for label in labels]
    with HttpRewardClient(pool.urls, in_process.weights, batch_size=3, wire_format=wire_format) as client:
        remote = client.score(images, prompts)
    local = in_process.score(images, prompts)
    assert len(remote.instances) == 4 and {i.split("-")[1] for i in remote.instances} == {"0", "1"}
    for name in SCORERS:
        np.testing.assert_allclose(remote.components[name], local.components[name], rtol=1e-12)
    weights = in_process.weights
    expected = sum(weights[name] * remote.components[name] for name in SCORERS)
    np.testing.assert_allclose(remote.combined, expected)
    assert remote.components["digit"].mean() > 0.8


def test_client_rgb_and_metadata_targets(pool: LocalRewardPool) -> None:
    images, labels = digit_images(2)
    rgb = np.repeat(images, 3, axis=3)
    with HttpRewardClient(pool.urls, {"digit": 1.0}) as client:
        result = client.score(rgb, ["", ""], [{"digit": int(label)} for label in labels])
    assert (result.combined > 0.5).all()


def test_client_failed_items_are_nan_not_zero(pool: LocalRewardPool) -> None:
    images, labels = digit_images(3)
    with HttpRewardClient(pool.urls, {"digit": 1.0, "brightness": 1.0}) as client:
        result = client.score(images, [f"digit {labels[0]}", "a cat", f"digit {labels[2]}"])
    assert np.isnan(result.components["digit"][1]) and np.isnan(result.combined[1])
    assert not np.isnan(result.components["brightness"]).any()
    assert not np.isnan(result.combined[[0, 2]]).any()
    assert result.errors["digit"] == {1: "PARSE: no digit 0-9 or digit word in prompt 'a cat' nor metadata['digit']"}
    assert result.num_failed == 1


def test_client_retries_on_another_replica(pool: LocalRewardPool) -> None:
    images = np.zeros((8, 16, 16, 1), np.uint8)
    with HttpRewardClient([dead_url(), *pool.urls], {"brightness": 1.0}, batch_size=2, backoff_s=0.01) as client:
        result = client.score(images, ["x"] * 8)
        assert result.combined.tolist() == [0.0] * 8
        assert all(instance.startswith("local-") for instance in result.instances)


def test_client_retries_503_on_another_replica() -> None:
    gate = threading.Event()
    loading = create_app(
        {"brightness": StubScorer(name="brightness", gate=gate)}, ServerSettings(instance_id="loading")
    )
    ready = create_app(build_scorers(["brightness"]), ServerSettings(instance_id="ready"))
    with serve(loading, wait_ready=False) as loading_url, serve(ready) as ready_url:
        with HttpRewardClient(
            [loading_url, ready_url],
            {"brightness": 1.0},
            backoff_s=0.01,
            verify_replicas=False,
            probe_interval_s=0.05,
        ) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            assert result.instances == ["ready"]
            metrics = httpx.get(f"{loading_url}/metrics", trust_env=False).text
            assert 'rewardflow_requests_total{path="/score",status="503"} 1.0' in metrics
            assert client.replica_states()[loading_url]["available"] is False  # 503: out at once
            gate.set()
            wait_until(lambda: client.replica_states()[loading_url]["available"])


def test_client_skips_replicas_not_ready_at_start_up() -> None:
    gate = threading.Event()
    loading = create_app(
        {"brightness": StubScorer(name="brightness", gate=gate, version="brightness-v1")},
        ServerSettings(instance_id="loading"),
    )
    ready = create_app(build_scorers(["brightness"]), ServerSettings(instance_id="ready"))
    with serve(loading, wait_ready=False) as loading_url, serve(ready) as ready_url:
        with HttpRewardClient(
            [loading_url, ready_url], {"brightness": 1.0}, batch_size=1, probe_interval_s=0.05
        ) as client:
            assert client.score(np.zeros((2, 4, 4, 1), np.uint8), ["", ""]).instances == ["ready"] * 2
            metrics = httpx.get(f"{loading_url}/metrics", trust_env=False).text
            assert 'path="/score"' not in metrics  # never tried: out of rotation from the /info check
            gate.set()
            wait_until(lambda: client.replica_states()[loading_url]["available"])
            instances = client.score(np.zeros((8, 4, 4, 1), np.uint8), [""] * 8).instances
        assert set(instances) == {"loading", "ready"}  # least-outstanding spreads concurrent chunks


def test_client_raises_when_every_replica_is_down() -> None:
    urls = [dead_url(), dead_url()]
    started = time.monotonic()
    with HttpRewardClient(urls, {"brightness": 1.0}, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RewardUnavailableError, match="after 3 attempts") as caught:
            client.score(np.zeros((2, 4, 4, 1), np.uint8), ["", ""])
    assert all(url in str(caught.value) for url in urls)
    assert time.monotonic() - started < 10


def test_client_4xx_is_final(pool: LocalRewardPool) -> None:
    with HttpRewardClient(pool.urls, {"aesthetic": 1.0}, verify_replicas=False) as client:
        with pytest.raises(RewardRequestError, match=r"HTTP 422: unknown scorer\(s\) \['aesthetic'\]"):
            client.score(np.zeros((1, 16, 16, 1), np.uint8), ["digit 1"])


def test_client_score_async_and_submit(pool: LocalRewardPool) -> None:
    images = np.full((3, 16, 16, 1), 255, np.uint8)
    with HttpRewardClient(pool.urls, {"brightness": 1.0}) as client:
        future = client.submit(images, ["a", "b", "c"])
        images[:] = 0  # inputs were copied at submit time
        assert future.result(timeout=30).combined.tolist() == [1.0, 1.0, 1.0]
        result = asyncio.run(client.score_async(images, ["a", "b", "c"]))
        assert result.combined.tolist() == [0.0, 0.0, 0.0]


def test_check_replicas(pool: LocalRewardPool) -> None:
    with HttpRewardClient(pool.urls, {"digit": 1.0, "brightness": 1.0}) as client:
        infos = client.check_replicas()
    assert set(infos) == set(pool.urls)
    impostor = create_app({"digit": StubScorer(name="digit", version="digits-other")}, ServerSettings())
    with serve(impostor) as url:
        with HttpRewardClient([*pool.urls, url], {"digit": 1.0}) as client:
            with pytest.raises(RewardClientError, match="runs digit digits-other"):
                client.check_replicas()
        with HttpRewardClient([url], {"brightness": 1.0}) as client:
            with pytest.raises(RewardClientError, match=r"does not serve scorer\(s\) \['brightness'\]"):
                client.check_replicas()


def test_hedged_request_beats_a_straggler() -> None:
    fast = StubScorer(name="slow", delay_s=0.0)
    straggler = StubScorer(name="slow", delay_s=0.0)
    apps = [
        create_app({"slow": s}, ServerSettings(instance_id=n)) for s, n in ((fast, "fast"), (straggler, "straggler"))
    ]
    with serve(apps[0]) as fast_url, serve(apps[1]) as straggler_url:
        with HttpRewardClient([straggler_url, fast_url], {"slow": 1.0}, batch_size=1, hedge=True) as client:
            # Latency observations for the p95 the hedge waits: 60, so that a few slow ones (a busy machine)
            # do not move it.
            client.score(np.zeros((60, 4, 4, 1), np.uint8), [""] * 60)
            straggler.delay_s = 3.0
            started = time.monotonic()
            results = [client.score(np.zeros((1, 4, 4, 1), np.uint8), [""]) for _ in range(4)]
            elapsed = time.monotonic() - started
        straggler.delay_s = 0.0
    # Unhedged, two of the four requests would wait out the straggler: 6 s.
    assert elapsed < 2.0, f"hedging did not cut the straggler short ({elapsed:.1f} s)"
    assert all(r.instances == ["fast"] and r.combined.tolist() == [0.5] for r in results)


def test_step_budget_bounds_a_score_call() -> None:
    app = create_app({"slow": StubScorer(delay_s=1.0)}, ServerSettings())
    with serve(app) as url:
        with HttpRewardClient([url], {"slow": 1.0}, step_timeout_s=0.3) as client:
            started = time.monotonic()
            with pytest.raises(RewardUnavailableError, match="step budget of 0.3 s"):
                client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            assert time.monotonic() - started < 1.5


def test_per_attempt_timeout_retries_elsewhere() -> None:
    quick = create_app({"slow": StubScorer()}, ServerSettings(instance_id="quick"))
    with socket.socket() as silent, serve(quick) as quick_url:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the backlog, but nothing ever answers
        silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with HttpRewardClient(
            [silent_url, quick_url],
            {"slow": 1.0},
            timeout_s=0.4,
            backoff_s=0.01,
            breaker_failures=1,
            verify_replicas=False,
        ) as client:
            started = time.monotonic()
            results = [client.score(np.zeros((1, 4, 4, 1), np.uint8), [""]) for _ in range(3)]
            elapsed = time.monotonic() - started
            states = client.replica_states()
    assert all(r.instances == ["quick"] for r in results)
    assert states[silent_url]["available"] is False  # one timeout with breaker_failures=1: out
    assert elapsed < 2.0  # at most one 0.4 s timeout, then the silent replica is skipped


def test_429_is_retried_on_another_replica_without_a_strike() -> None:
    full = create_app(
        {"slow": StubScorer(delay_s=1.0)}, ServerSettings(max_items=1, max_queue_items=1, instance_id="full")
    )
    free = create_app({"slow": StubScorer()}, ServerSettings(instance_id="free"))
    with serve(full) as full_url, serve(free) as free_url:
        blocker = threading.Thread(
            target=httpx.post,
            args=(f"{full_url}/score",),
            kwargs={
                "json": {"items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}]},
                "trust_env": False,
            },
        )
        blocker.start()
        wait_until(lambda: full.state.service.workers["slow"].queued_items == 1)
        with HttpRewardClient([full_url, free_url], {"slow": 1.0}, backoff_s=0.01, verify_replicas=False) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            states = client.replica_states()
        blocker.join()
    assert result.instances == ["free"]
    assert states[full_url]["available"] is True  # busy is not broken


def test_client_rejects_bad_options() -> None:
    for kwargs, message in (
        ({"wire_format": "pickle"}, "wire_format"),
        ({"combine_mode": "max"}, "combine_mode"),
        ({"step_timeout_s": 0}, "timeouts"),
    ):
        with pytest.raises(ValueError, match=message):
            HttpRewardClient(["http://127.0.0.1:1"], {"a": 1.0}, **kwargs)
    with pytest.raises(ValueError, match="distinct"):
        HttpRewardClient(["http://127.0.0.1:1", "http://127.0.0.1:1/"], {"a": 1.0})


@pytest.mark.parametrize("status", [501, 505, 507])
def test_client_retries_any_5xx_on_another_replica(status: int) -> None:
    broken = replica_answering(lambda: JSONResponse({"detail": f"status {status}"}, status_code=status))

    good = create_app({"slow": StubScorer()}, ServerSettings(instance_id="good"))
    with serve(broken) as broken_url, serve(good) as good_url:
        with HttpRewardClient([broken_url, good_url], {"slow": 1.0}, backoff_s=0.01, verify_replicas=False) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            states = client.replica_states()
    assert result.instances == ["good"]
    assert states[broken_url]["consecutive_failures"] == 1  # the first attempt went to the broken one


def test_cancelling_a_hedged_attempt_cancels_its_request() -> None:
    scorer = StubScorer(delay_s=0.3)
    app = create_app({"slow": scorer}, ServerSettings())
    with serve(app) as url:
        with HttpRewardClient([url], {"slow": 1.0}, batch_size=1, max_concurrency=32, hedge=True) as client:
            client.score(np.zeros((24, 4, 4, 1), np.uint8), [""] * 24)  # latencies >= 0.3 s: the hedge's p95
            scorer.delay_s = 2.0
            client.step_timeout_s = 0.1  # the step gives up while the attempt waits for the hedge delay
            with pytest.raises(RewardUnavailableError, match="step budget"):
                client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            wait_until(lambda: client.replica_states()[url]["outstanding"] == 0, timeout_s=1.0)


class _ValueScorer(StubScorer):
    """Scores every item ``value``."""

    def __init__(self, value: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [self.value] * len(images)


def test_a_replica_whose_model_changes_under_the_client_is_taken_out_not_mixed_in() -> None:
    """Fingerprints were compared at start-up and by the probe only: a replica restarted with other weights
    (same URL) had its scores mixed into every batch until it failed for another reason."""
    steady, changed = _ValueScorer(0.5), _ValueScorer(0.5)
    with (
        serve(create_app({"slow": steady}, ServerSettings(instance_id="steady"))) as first,
        serve(create_app({"slow": changed}, ServerSettings(instance_id="changed"))) as second,
    ):
        with HttpRewardClient([first, second], {"slow": 1.0}, batch_size=1) as client:
            assert client.score(np.zeros((4, 4, 4, 3), np.uint8), [""] * 4).combined.tolist() == [0.5] * 4
            changed.version, changed.value = "t-v2", 0.9  # as if restarted with other weights
            result = client.score(np.zeros((8, 4, 4, 3), np.uint8), [""] * 8)
            assert result.combined.tolist() == [0.5] * 8 and result.num_failed == 0
            assert [s["available"] for s in client.replica_states().values()] == [True, False]
