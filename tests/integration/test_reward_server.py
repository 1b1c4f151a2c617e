"""Reward servers over real HTTP on 127.0.0.1: the endpoints, limits, drain, the pool client and launcher.

Two kinds of real servers are used: ``python -m reward_server`` subprocesses started by
``LocalRewardPool`` (the production path), and uvicorn servers in a thread of the test process
(``_serve``), which can host test scorers that are slow, never ready or impostors.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, replica_answering, serve, spawn_reward_server, wait_for
from sklearn.datasets import load_digits

from reward_server.__main__ import main as server_main
from reward_server.app import create_app
from reward_server.inprocess import InProcessRewardClient
from reward_server.scorers import SCORERS as SCORER_REGISTRY
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image
from shared.protocol import MSGPACK_MEDIA_TYPE
from shared.wire import compress_body, pack_msgpack, supported_encodings
from trainer.rewards import (
    HttpRewardClient,
    LocalRewardPool,
    RewardClientError,
    RewardPoolError,
    RewardRequestError,
    RewardUnavailableError,
)
from trainer.rewards.wire import DEFAULT_WIRE_FORMAT, WIRE_FORMATS

SCORERS = ["digit", "brightness", "jpeg_compressibility"]
POOL_LIMITS = ["--max-items", "16", "--max-body-bytes", "300000", "--max-image-side", "64"]


def _dead_url() -> str:
    """A loopback URL with nothing listening (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(0.02)


async def _queued(app: Any, items: int, scorer: str = "slow", timeout_s: float = 10.0) -> None:
    """Wait until ``scorer``'s queue holds ``items`` items (a request is in, not just sent)."""

    async def poll() -> None:
        while app.state.service.workers[scorer].queued_items < items:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


class _TestScorer:
    """A scorer for server behaviour tests: waits ``delay_s`` per batch, loads when ``gate`` opens."""

    description = "test scorer"
    score_range = (0.0, 1.0)

    def __init__(
        self,
        name: str = "slow",
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
        version: str = "t-v1",
    ) -> None:
        self.name = name
        self.delay_s = delay_s
        self.gate = gate
        self.version = version

    def load(self) -> None:
        if self.gate is not None:
            self.gate.wait(timeout=60)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        time.sleep(self.delay_s)
        return [0.5] * len(images)


def _item(item_id: str, image: np.ndarray, prompt: str = "digit 1", wire_format: str = "png", **extra: Any) -> dict:
    return {"id": item_id, "prompt": prompt, "image": encode_image(image, wire_format), **extra}


def _digit_images(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out sklearn digits as uint8 [B, 16, 16, 1] (bright = ink) and their labels."""
    digits = load_digits()
    indices = np.random.default_rng(0).permutation(len(digits.target))[900 : 900 + count]
    images = np.stack([np.kron(digits.images[i], np.ones((2, 2))) for i in indices]) * 255 / 16
    return np.round(images).astype(np.uint8)[..., None], digits.target[indices]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRewardPool]:
    log_dir = tmp_path_factory.mktemp("pool")
    with LocalRewardPool(SCORERS, replicas=2, log_dir=log_dir, extra_args=POOL_LIMITS, ready_timeout_s=60) as running:
        yield running


@pytest.fixture(scope="module")
def http(pool: LocalRewardPool) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pool.urls[0], trust_env=False, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def in_process() -> Iterator[InProcessRewardClient]:
    with InProcessRewardClient.from_names({"digit": 1.0, "brightness": 0.5, "jpeg_compressibility": 0.1}) as client:
        yield client


# Endpoints ------------------------------------------------------------------------------------------


def test_health_and_info(http: httpx.Client, pool: LocalRewardPool) -> None:
    assert http.get("/livez").json()["status"] == "alive"
    assert http.get("/readyz").status_code == 200
    info = http.get("/info").json()
    assert info["ready"] is True and info["instance"].startswith("local-0-")
    assert [scorer["name"] for scorer in info["scorers"]] == SCORERS
    digit = info["scorers"][0]
    assert digit["version"].startswith("digits-logreg-v1+") and (digit["score_min"], digit["score_max"]) == (
        0,
        1,
    )
    assert info["limits"] == {
        "max_items": 16,
        "max_image_side": 64,
        "max_body_bytes": 300000,
        "max_pixels_per_request": ServerSettings().max_pixels_per_request,
        "max_values": ServerSettings().max_values,
    }
    assert "rewardflow_ready 1" in http.get("/metrics").text


@pytest.mark.parametrize("wire_format", ["png", "raw"])
def test_score_digits_and_closed_forms(http: httpx.Client, wire_format: str) -> None:
    images, labels = _digit_images(4)
    rgb = np.full((32, 32, 3), 51, np.uint8)
    items = [
        _item(f"d{i}", image, f"a handwritten {label}", wire_format)
        for i, (image, label) in enumerate(zip(images, labels, strict=True))
    ]
    items.append(_item("flat", rgb, "digit 0", wire_format, metadata={"note": "rgb"}))
    response = http.post("/score", json={"request_id": "req-1", "items": items})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["request_id"] == "req-1" and set(body["models"]) == set(SCORERS)
    assert [result["id"] for result in body["results"]] == [item["id"] for item in items]
    for result, label in zip(body["results"][:4], labels, strict=True):
        digit = result["scores"]["digit"]
        assert digit["ok"] and digit["score"] > 0.5 and digit["details"]["predicted"] == label
    flat = body["results"][4]["scores"]
    assert flat["brightness"]["score"] == pytest.approx(0.2)
    assert flat["jpeg_compressibility"]["score"] < 0
    assert set(body["timing"]["scorers"]) == set(SCORERS)
    assert body["timing"]["scorers"]["digit"]["batch_size"] == 5


def test_score_a_subset_of_scorers_and_per_item_failures(http: httpx.Client) -> None:
    items = [
        _item("ok", np.zeros((16, 16, 1), np.uint8), "digit 8"),
        _item("no-target", np.zeros((16, 16, 1), np.uint8), "a cat"),
        {"id": "corrupt", "prompt": "digit 1", "image": {"format": "png", "data": "aGVsbG8="}},
        _item("bad-size", np.zeros((12, 12, 1), np.uint8), "digit 1"),
    ]
    response = http.post("/score", json={"scorers": ["digit", "brightness"], "items": items})
    assert response.status_code == 200
    results = {result["id"]: result["scores"] for result in response.json()["results"]}
    assert set(results["ok"]) == {"digit", "brightness"}
    assert results["ok"]["digit"]["ok"]
    assert results["no-target"]["digit"] == {
        "ok": False,
        "score": None,
        "details": {},
        "error": {
            "code": "PARSE",
            "message": "no digit 0-9 or digit word in prompt 'a cat' nor metadata['digit']",
        },
    }
    assert results["no-target"]["brightness"]["ok"]
    assert results["corrupt"]["digit"]["error"]["code"] == "DECODE"
    assert results["corrupt"]["brightness"]["error"]["code"] == "DECODE"
    assert results["bad-size"]["digit"]["error"]["code"] == "BAD_INPUT"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "Invalid JSON"),
        (b'{"items": []}', "items: List should have at least 1 item"),
        (
            b'{"items": [{"id": "a", "prompt": "", "image": {"format": "gif", "data": "AA"}}]}',
            "items.0.image.format",
        ),
        (
            b'{"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": "AA"}}]}',
            "requires shape",
        ),
        (b'{"itemz": []}', "itemz: Extra inputs are not permitted"),
        (
            b'{"scorers": ["aesthetic"], "items": '
            b'[{"id": "a", "prompt": "", "image": {"format": "png", "data": "AA"}}]}',
            "unknown scorer(s) ['aesthetic']",
        ),
    ],
)
def test_malformed_requests_are_422_with_a_message(http: httpx.Client, body: bytes, message: str) -> None:
    response = http.post("/score", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert message in response.json()["detail"]


def test_limits(http: httpx.Client) -> None:
    image = np.zeros((16, 16, 1), np.uint8)
    too_many = http.post("/score", json={"items": [_item(str(i), image) for i in range(17)]})
    assert too_many.status_code == 413 and "17 items exceed the limit of 16" in too_many.json()["detail"]

    huge = http.post("/score", json={"items": [_item("a", image, prompt="x" * 300_001)]})
    assert huge.status_code == 413 and "300000 bytes" in huge.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts while reading
        yield b'{"items": [{"id": "a", "prompt": "'
        for _ in range(31):
            yield b"x" * 10_000
        yield b'"}]}'

    streamed = http.post("/score", content=chunks())
    assert streamed.status_code == 413

    wide = http.post("/score", json={"items": [_item("ok", image), _item("wide", np.zeros((8, 65, 1), np.uint8))]})
    assert wide.status_code == 422
    assert "items.1 (id 'wide'): image is 8x65, larger than the maximum side 64" in wide.json()["detail"]


def test_bearer_token() -> None:
    app = create_app(build_scorers(["brightness"]), ServerSettings(token="s3cret"))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    with serve(app) as url, httpx.Client(base_url=url, trust_env=False) as client:
        body = {"items": [{"id": "a", "prompt": "", "image": image}]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            response = client.post("/score", json=body, headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert client.get("/info").status_code == 401
        assert client.post("/score", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/readyz").status_code == 200  # health probes need no token

        images = np.zeros((2, 4, 4, 1), np.uint8)
        with HttpRewardClient([url], {"brightness": 1.0}, token="s3cret") as good:
            assert good.score(images, ["", ""]).combined.tolist() == [0.0, 0.0]
        with HttpRewardClient([url], {"brightness": 1.0}, token="wrong") as bad:
            with pytest.raises(RewardRequestError, match="HTTP 401"):
                bad.score(images, ["", ""])


def test_not_ready_until_loaded() -> None:
    gate = threading.Event()
    app = create_app({"slow": _TestScorer(gate=gate)}, ServerSettings())
    with serve(app, wait_ready=False) as url, httpx.Client(base_url=url, trust_env=False) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["detail"] == "loading"
        body = {"items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}]}
        busy = client.post("/score", json=body)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        gate.set()
        wait_for(f"{url}/readyz")
        assert client.post("/score", json=body).status_code == 200


def test_deadline_turns_late_items_into_timeouts() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.5)}, ServerSettings())
    body = {
        "deadline_ms": 100,
        "items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}],
    }
    with serve(app) as url:
        response = httpx.post(f"{url}/score", json=body, trust_env=False)
    assert response.status_code == 200
    assert response.json()["results"][0]["scores"]["slow"]["error"]["code"] == "TIMEOUT"


class _CountingScorer(_TestScorer):
    """Records the size of every batch it computes."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(delay_s=delay_s)
        self.calls: list[int] = []

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.calls.append(len(images))
        return super().score(images, prompts, metadata)


def test_deadline_keeps_finished_items_and_drops_expired_ones_before_computing_them() -> None:
    scorer = _CountingScorer(delay_s=0.6)
    app = create_app({"slow": scorer}, ServerSettings(max_batch_size=1, batch_wait_ms=0))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    body = {"deadline_ms": 1000, "items": [{"id": str(i), "prompt": "", "image": image} for i in range(4)]}
    with serve(app) as url:
        response = httpx.post(f"{url}/score", json=body, trust_env=False)
        _wait_until(lambda: app.state.service.workers["slow"].queued_items == 0)  # it reached the expired items
        metrics = httpx.get(f"{url}/metrics", trust_env=False).text
    scores = [r["scores"]["slow"] for r in response.json()["results"]]
    assert scores[0]["error"] is None and scores[0]["score"] is not None  # finished before the deadline: kept
    assert [s["error"]["code"] for s in scores[1:]] == ["TIMEOUT"] * 3  # item 2 was still being scored
    assert scorer.calls == [1, 1]  # items 3 and 4 were past the deadline when their turn came: never computed
    assert 'rewardflow_items_total{outcome="TIMEOUT",scorer="slow"}' in metrics


def test_full_queue_is_429_and_drain_lets_in_flight_work_finish() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.6)}, ServerSettings(max_items=2, max_queue_items=2))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    body = {"items": [{"id": str(i), "prompt": "", "image": image} for i in range(2)]}
    with serve(app) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                in_flight = asyncio.create_task(client.post("/score", json=body))
                await _queued(app, 2)
                full = await client.post("/score", json=body)
                assert full.status_code == 429 and full.headers["retry-after"] == "1"
                app.state.service.begin_drain()
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["detail"] == "draining"
                assert (await client.post("/score", json=body)).status_code == 503
                finished = await in_flight
                assert finished.status_code == 200
                assert [r["scores"]["slow"]["score"] for r in finished.json()["results"]] == [0.5, 0.5]

        asyncio.run(scenario())


def test_a_full_queue_refuses_only_requests_for_its_own_scorer() -> None:
    """One scorer's full queue made every request a 429, also those for the server's other scorers."""
    app = create_app(
        {"slow": _TestScorer(delay_s=0.6), "quick": _TestScorer(name="quick")},
        ServerSettings(max_items=2, max_queue_items=2),
    )
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    items = [{"id": str(i), "prompt": "", "image": image} for i in range(2)]
    with serve(app) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                in_flight = asyncio.create_task(client.post("/score", json={"scorers": ["slow"], "items": items}))
                await _queued(app, 2)
                assert (await client.post("/score", json={"scorers": ["slow"], "items": items})).status_code == 429
                ready = await client.get("/readyz")  # for load balancers: this replica is busy
                assert ready.status_code == 503 and ready.json()["detail"] == "queue full: ['slow']"
                quick = await client.post("/score", json={"scorers": ["quick"], "items": items})
                assert quick.status_code == 200
                assert [r["scores"]["quick"]["score"] for r in quick.json()["results"]] == [0.5, 0.5]
                assert (await in_flight).status_code == 200

        asyncio.run(scenario())


def test_concurrent_requests_share_a_micro_batch() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.05)}, ServerSettings(batch_wait_ms=200))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    with serve(app) as url:

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                bodies = [{"items": [{"id": "a", "prompt": "", "image": image}]} for _ in range(2)]
                return await asyncio.gather(*(client.post("/score", json=body) for body in bodies))

        responses = asyncio.run(both())
    assert [r.json()["timing"]["scorers"]["slow"]["batch_size"] for r in responses] == [2, 2]


class _BrokenScorer(_TestScorer):
    def load(self) -> None:
        raise FileNotFoundError("/models/missing.safetensors")


def test_load_failure_is_reported() -> None:
    failures: list[BaseException] = []
    app = create_app({"broken": _BrokenScorer()}, ServerSettings(), on_load_failure=failures.append)
    with serve(app, wait_ready=False) as url:
        wait_for(f"{url}/readyz", status=503)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        detail = httpx.get(f"{url}/readyz", trust_env=False).json()["detail"]
    assert detail == "loading failed: FileNotFoundError: /models/missing.safetensors"
    assert isinstance(failures[0], FileNotFoundError)


def test_cli_exits_with_status_1_when_a_scorer_fails_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCORER_REGISTRY, "broken", lambda model_dir=None: _BrokenScorer(name="broken"))
    assert server_main(["--scorers", "broken", "--port", str(free_port()), "--log-level", "error"]) == 1


def test_cli_exits_with_status_3_when_a_scorer_needs_model_files_and_has_no_model_dir() -> None:
    """The trainer's launcher reads that status to name reward.model_dir (it matched the log's text before)."""
    assert server_main(["--scorers", "aesthetic", "--port", str(free_port()), "--log-level", "error"]) == 3


def test_sigterm_drains_then_exits_cleanly(tmp_path) -> None:
    port = free_port()
    log = tmp_path / "server.log"
    command = [
        sys.executable,
        "-m",
        "reward_server",
        "--scorers",
        "brightness",
        "--port",
        str(port),
        "--drain-grace-s",
        "1",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/readyz")
        process.send_signal(signal.SIGTERM)
        wait_for(f"http://127.0.0.1:{port}/readyz", status=503, timeout_s=0.9)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "draining" in log.read_text()


# Client ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_client_round_robins_and_matches_in_process_scores(
    pool: LocalRewardPool, in_process: InProcessRewardClient, wire_format: str
) -> None:
    images, labels = _digit_images(12)
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
    images, labels = _digit_images(2)
    rgb = np.repeat(images, 3, axis=3)
    with HttpRewardClient(pool.urls, {"digit": 1.0}) as client:
        result = client.score(rgb, ["", ""], [{"digit": int(label)} for label in labels])
    assert (result.combined > 0.5).all()


def test_client_failed_items_are_nan_not_zero(pool: LocalRewardPool) -> None:
    images, labels = _digit_images(3)
    with HttpRewardClient(pool.urls, {"digit": 1.0, "brightness": 1.0}) as client:
        result = client.score(images, [f"digit {labels[0]}", "a cat", f"digit {labels[2]}"])
    assert np.isnan(result.components["digit"][1]) and np.isnan(result.combined[1])
    assert not np.isnan(result.components["brightness"]).any()
    assert not np.isnan(result.combined[[0, 2]]).any()
    assert result.errors["digit"] == {1: "PARSE: no digit 0-9 or digit word in prompt 'a cat' nor metadata['digit']"}
    assert result.num_failed == 1


def test_client_retries_on_another_replica(pool: LocalRewardPool) -> None:
    images = np.zeros((8, 16, 16, 1), np.uint8)
    with HttpRewardClient([_dead_url(), *pool.urls], {"brightness": 1.0}, batch_size=2, backoff_s=0.01) as client:
        result = client.score(images, ["x"] * 8)
        assert result.combined.tolist() == [0.0] * 8
        assert all(instance.startswith("local-") for instance in result.instances)


def test_client_retries_503_on_another_replica() -> None:
    gate = threading.Event()
    loading = create_app(
        {"brightness": _TestScorer(name="brightness", gate=gate)}, ServerSettings(instance_id="loading")
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
            _wait_until(lambda: client.replica_states()[loading_url]["available"])


def test_client_skips_replicas_not_ready_at_start_up() -> None:
    gate = threading.Event()
    loading = create_app(
        {"brightness": _TestScorer(name="brightness", gate=gate, version="brightness-v1")},
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
            _wait_until(lambda: client.replica_states()[loading_url]["available"])
            instances = client.score(np.zeros((8, 4, 4, 1), np.uint8), [""] * 8).instances
        assert set(instances) == {"loading", "ready"}  # least-outstanding spreads concurrent chunks


def test_client_raises_when_every_replica_is_down() -> None:
    urls = [_dead_url(), _dead_url()]
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
    impostor = create_app({"digit": _TestScorer(name="digit", version="digits-other")}, ServerSettings())
    with serve(impostor) as url:
        with HttpRewardClient([*pool.urls, url], {"digit": 1.0}) as client:
            with pytest.raises(RewardClientError, match="runs digit digits-other"):
                client.check_replicas()
        with HttpRewardClient([url], {"brightness": 1.0}) as client:
            with pytest.raises(RewardClientError, match=r"does not serve scorer\(s\) \['brightness'\]"):
                client.check_replicas()


def test_launcher_holds_each_port_from_its_choice_on(tmp_path) -> None:
    """A replica's port is bound by the launcher and the socket passed to it (``--fd``): from launch on, no other
    process can take it (the launcher used to pick a free port, release it and let the replica bind it later,
    which a concurrent job could win). Until the replica listens, a connection is refused, not left waiting."""
    pool = LocalRewardPool(["brightness"], replicas=2, log_dir=tmp_path)
    try:
        pool.launch()
        ports = list(pool.ports)
        assert len(set(ports)) == 2
        for port in ports:
            with socket.socket() as rival, pytest.raises(OSError, match="Address already in use"):
                rival.bind(("127.0.0.1", port))
        pool.wait_ready()
        assert [httpx.get(f"{url}/readyz", trust_env=False).status_code for url in pool.urls] == [200, 200]
    finally:
        pool.stop()
    for port in ports:  # released with the replicas (SO_REUSEADDR: past connections' TIME_WAIT, never a listener)
        with socket.socket() as after:
            after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            after.bind(("127.0.0.1", port))


def test_a_killed_replica_restarts_on_its_port_while_a_client_holds_a_connection_to_it() -> None:
    """The connections a killed replica had accepted linger (FIN_WAIT) while their clients keep them; the bound
    socket's SO_REUSEADDR, which they inherit, lets the restart bind the port again (without it: EADDRINUSE)."""
    with LocalRewardPool(["brightness"], replicas=1) as pool, httpx.Client(trust_env=False) as client:
        assert client.get(f"{pool.urls[0]}/readyz").status_code == 200  # a kept-alive connection
        pool.kill(0)
        pool.restart(0)
        assert client.get(f"{pool.urls[0]}/readyz").status_code == 200


def test_a_server_given_an_fd_that_is_not_a_tcp_socket_exits_with_one_line(tmp_path) -> None:
    with open(tmp_path / "file", "w") as not_a_socket:
        fd = not_a_socket.fileno()
        result = subprocess.run(
            [sys.executable, "-m", "reward_server", "--scorers", "brightness", "--fd", str(fd)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1 and last == f"--fd {fd}: not an open socket (Socket operation on non-socket)", last


def test_launcher_reports_a_replica_that_dies(tmp_path) -> None:
    with pytest.raises(RewardPoolError, match="exited with status 2(.|\n)*unrecognized arguments: --bogus"):
        with LocalRewardPool(["brightness"], replicas=1, log_dir=tmp_path, extra_args=["--bogus"]):
            pass
    assert (tmp_path / "replica-0.log").exists()
    pool = LocalRewardPool(["brightness"], replicas=1, extra_args=["--bogus"])  # logs in a temporary directory
    with pytest.raises(RewardPoolError, match="end of (.*replica-0.log)") as info:
        with pool:
            pass
    log = pool.log_paths[0]
    assert str(log) in str(info.value) and "--bogus" in log.read_text(), "the log the error names is kept"
    shutil.rmtree(log.parent)


def test_launcher_deletes_its_temporary_logs_when_it_stops() -> None:
    with LocalRewardPool(["brightness"], replicas=1) as pool:
        log = pool.log_paths[0]
        assert log.is_file()
    assert not log.parent.exists()


# Binary wire format ----------------------------------------------------------------------------------


def _post_msgpack(
    client: httpx.Client, body: dict, encoding: str | None = None, content_type: str = MSGPACK_MEDIA_TYPE
) -> httpx.Response:
    payload = pack_msgpack(body)
    headers = {"Content-Type": content_type}
    if encoding is not None:
        payload = compress_body(payload, encoding)
        headers["Content-Encoding"] = encoding
    return client.post("/score", content=payload, headers=headers)


@pytest.mark.parametrize("encoding", [None, *supported_encodings()])
@pytest.mark.parametrize("content_type", [MSGPACK_MEDIA_TYPE, "application/x-msgpack"])
def test_msgpack_body_scores_like_json(http: httpx.Client, encoding: str | None, content_type: str) -> None:
    images, labels = _digit_images(3)
    rgb = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)

    def items(binary: bool) -> list[dict]:
        digits = [
            {"id": f"d{i}", "prompt": f"digit {label}", "image": encode_image(image, "raw", binary=binary)}
            for i, (image, label) in enumerate(zip(images, labels, strict=True))
        ]
        png = {"id": "png", "prompt": "digit 1", "image": encode_image(rgb, "png", binary=binary)}
        masked = {
            "id": "masked",
            "prompt": "digit 2",
            "image": encode_image(rgb, "raw", binary=binary),
            "mask": encode_image(rgb[:, :, :1], "png", binary=binary),
            "metadata": {"note": [1, 2.5, None]},
        }
        return [*digits, png, masked]

    binary = _post_msgpack(http, {"request_id": "bin", "items": items(True)}, encoding, content_type)
    text = http.post("/score", json={"request_id": "bin", "items": items(False)})
    assert binary.status_code == 200, binary.text
    assert [r["scores"] for r in binary.json()["results"]] == [r["scores"] for r in text.json()["results"]]
    assert binary.json()["results"][-1]["scores"]["brightness"]["score"] == pytest.approx(rgb.mean() / 255)


@pytest.mark.parametrize(
    ("payload", "headers", "status", "message"),
    [
        (b"\xc1", {}, 422, "invalid msgpack"),
        (msgpack.packb({"items": [], "t": msgpack.Timestamp(1)}), {}, 422, "Timestamp is not accepted"),
        (msgpack.packb({"itemz": []}), {}, 422, "itemz: Extra inputs are not permitted"),
        (
            msgpack.packb({"items": [{"id": "a", "prompt": "", "image": {"format": "raw", "data": b"x"}}]}),
            {},
            422,
            "requires shape",
        ),
        (b"anything", {"Content-Encoding": "br"}, 415, "unsupported Content-Encoding 'br'"),
        (b"not zstd", {"Content-Encoding": "zstd"}, 422, "corrupt zstd body"),
        (compress_body(bytes(400_000), "zstd"), {"Content-Encoding": "zstd"}, 413, "300000 bytes"),
        (compress_body(bytes(400_000), "lz4"), {"Content-Encoding": "lz4"}, 413, "300000 bytes"),
    ],
)
def test_bad_binary_bodies(
    http: httpx.Client, payload: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    response = http.post("/score", content=payload, headers={"Content-Type": MSGPACK_MEDIA_TYPE, **headers})
    assert response.status_code == status, response.text
    assert message in response.json()["detail"]
    if status == 415:
        assert response.headers["accept-encoding"].startswith("identity")


def test_a_body_of_another_media_type_is_a_415_naming_the_two_it_takes(http: httpx.Client) -> None:
    """A text/plain body was read as JSON; curl's -d sends application/x-www-form-urlencoded."""
    image = encode_image(np.zeros((8, 8, 1), np.uint8), "png")
    body = json.dumps({"items": [{"id": "a", "prompt": "", "image": image}]})
    for media_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = http.post("/score", content=body, headers={"Content-Type": media_type})
        assert response.status_code == 415, response.text
        assert response.json()["detail"] == (
            f"unsupported Content-Type {media_type!r}: send application/json (curl: "
            "-H 'Content-Type: application/json') or application/msgpack"
        )
    for headers in ({}, {"Content-Type": "application/json; charset=utf-8"}):  # no type at all: JSON
        response = http.post("/score", content=body, headers=headers)
        assert response.status_code == 200, response.text


def test_msgpack_limits_match_json(http: httpx.Client) -> None:
    image = encode_image(np.zeros((16, 16, 1), np.uint8), "raw", binary=True)
    too_many = _post_msgpack(http, {"items": [{"id": str(i), "prompt": "", "image": image} for i in range(17)]})
    assert too_many.status_code == 413
    wide = encode_image(np.zeros((8, 65, 1), np.uint8), "raw", binary=True)
    response = _post_msgpack(http, {"items": [{"id": "wide", "prompt": "", "image": wide}]})
    assert response.status_code == 422 and "larger than the maximum side 64" in response.json()["detail"]


def test_info_lists_media_types_and_encodings(http: httpx.Client) -> None:
    info = http.get("/info").json()
    assert info["media_types"] == ["application/json", MSGPACK_MEDIA_TYPE]
    assert info["encodings"] == supported_encodings()


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_wire_formats_give_identical_scores(pool: LocalRewardPool, wire_format: str) -> None:
    """Parity: every wire format delivers the same pixels, so every scorer gives the same scores."""
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (6, 32, 32, 3), dtype=np.uint8)
    prompts = [f"digit {i}" for i in range(6)]
    weights = {"digit": 1.0, "brightness": 0.5, "jpeg_compressibility": 0.1}
    with HttpRewardClient(pool.urls, weights, batch_size=4, wire_format="png") as reference_client:
        reference = reference_client.score(images, prompts)
    with HttpRewardClient(pool.urls, weights, batch_size=4, wire_format=wire_format) as client:
        result = client.score(images, prompts)
    for name in weights:
        np.testing.assert_array_equal(result.components[name], reference.components[name])
    np.testing.assert_array_equal(result.combined, reference.combined)


def test_default_wire_format_is_msgpack(pool: LocalRewardPool) -> None:
    with HttpRewardClient(pool.urls, {"brightness": 1.0}) as client:
        assert client.wire_format == DEFAULT_WIRE_FORMAT == "msgpack"
        client.score(np.zeros((1, 16, 16, 1), np.uint8), [""])
    metrics = (
        httpx.get(f"{pool.urls[0]}/metrics", trust_env=False).text
        + httpx.get(f"{pool.urls[1]}/metrics", trust_env=False).text
    )
    assert 'rewardflow_request_body_bytes_count{media_type="application/msgpack"}' in metrics


# Metrics ---------------------------------------------------------------------------------------------


def test_prometheus_metrics() -> None:
    app = create_app(
        {"slow": _TestScorer(delay_s=0.01), "brightness": build_scorers(["brightness"])["brightness"]},
        ServerSettings(),
    )
    image = encode_image(np.full((4, 4, 1), 255, np.uint8))
    items = [{"id": str(i), "prompt": "", "image": image} for i in range(3)]
    items.append({"id": "bad", "prompt": "", "image": {"format": "png", "data": "aGVsbG8="}})
    with serve(app) as url, httpx.Client(base_url=url, trust_env=False) as client:
        assert client.post("/score", json={"items": items}).status_code == 200
        assert client.post("/score", content=b"{").status_code == 422
        response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {
        family.name: family for family in text_string_to_metric_families(response.text)
    }  # parses: valid Prometheus text format

    def value(family: str, sample: str, **labels: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample and s.labels == labels)

    assert value("rewardflow_requests", "rewardflow_requests_total", path="/score", status="200") == 1
    assert value("rewardflow_requests", "rewardflow_requests_total", path="/score", status="422") == 1
    assert value("rewardflow_items", "rewardflow_items_total", scorer="slow", outcome="OK") == 3
    assert value("rewardflow_items", "rewardflow_items_total", scorer="slow", outcome="DECODE") == 1
    assert value("rewardflow_batch_size", "rewardflow_batch_size_sum", scorer="slow") == 3
    assert value("rewardflow_inference_seconds", "rewardflow_inference_seconds_sum", scorer="slow") >= 0.01
    assert value("rewardflow_queue_seconds", "rewardflow_queue_seconds_count", scorer="slow") == 1
    assert value("rewardflow_queue_depth", "rewardflow_queue_depth", scorer="slow") == 0
    assert value("rewardflow_score", "rewardflow_score_bucket", scorer="brightness", le="0.9") == 0
    assert value("rewardflow_score", "rewardflow_score_bucket", scorer="brightness", le="1.0") == 3
    assert value("rewardflow_score", "rewardflow_score_sum", scorer="slow") == pytest.approx(1.5)
    assert value("rewardflow_request_duration_seconds", "rewardflow_request_duration_seconds_count", path="/score") == 2
    assert value("rewardflow_ready", "rewardflow_ready") == 1


# Client resilience -----------------------------------------------------------------------------------


def test_hedged_request_beats_a_straggler() -> None:
    fast = _TestScorer(name="slow", delay_s=0.0)
    straggler = _TestScorer(name="slow", delay_s=0.0)
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
    app = create_app({"slow": _TestScorer(delay_s=1.0)}, ServerSettings())
    with serve(app) as url:
        with HttpRewardClient([url], {"slow": 1.0}, step_timeout_s=0.3) as client:
            started = time.monotonic()
            with pytest.raises(RewardUnavailableError, match="step budget of 0.3 s"):
                client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            assert time.monotonic() - started < 1.5


def test_per_attempt_timeout_retries_elsewhere() -> None:
    quick = create_app({"slow": _TestScorer()}, ServerSettings(instance_id="quick"))
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
        {"slow": _TestScorer(delay_s=1.0)}, ServerSettings(max_items=1, max_queue_items=1, instance_id="full")
    )
    free = create_app({"slow": _TestScorer()}, ServerSettings(instance_id="free"))
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
        _wait_until(lambda: full.state.service.workers["slow"].queued_items == 1)
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


# Limits and failure handling --------------------------------------------------------------------------


def test_a_huge_deadline_is_a_422_naming_the_field(http: httpx.Client, pool: LocalRewardPool) -> None:
    image = encode_image(np.zeros((16, 16, 1), np.uint8))
    for deadline in ("9" * 400, str(24 * 3600 * 1000 + 1)):
        body = f'{{"deadline_ms": {deadline}, "items": [{{"id": "a", "prompt": "", "image": {json.dumps(image)}}}]}}'
        response = http.post("/score", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, response.text
        assert "deadline_ms: Input should be less than or equal to 86400000" in response.json()["detail"]
    with HttpRewardClient(pool.urls, {"brightness": 1.0}, timeout_s=10.0**6) as client:  # a day at most
        assert client.score(np.zeros((1, 16, 16, 1), np.uint8), [""]).combined.tolist() == [0.0]


@pytest.mark.parametrize("binary", [False, True])
def test_too_many_items_are_a_413_before_the_items_are_validated(http: httpx.Client, binary: bool) -> None:
    items = [{"id": "a", "not": "an item"}] * 17  # invalid and with repeated ids: only the count matters
    response = _post_msgpack(http, {"items": items}) if binary else http.post("/score", json={"items": items})
    assert response.status_code == 413
    assert response.json()["detail"] == "17 items exceed the limit of 16 (max_items)"


def test_pixels_per_request_are_bounded_before_decoding() -> None:
    small = create_app(build_scorers(["brightness"]), ServerSettings(max_pixels_per_request=1000))
    default = create_app(build_scorers(["brightness"]), ServerSettings())
    tile = encode_image(np.zeros((20, 20, 1), np.uint8))  # 400 pixels
    huge = encode_image(np.zeros((4096, 4096, 3), np.uint8))  # 16.8 Mpixels in a 50 kB PNG

    def item(item_id: str, **extra: Any) -> dict:
        return {"id": item_id, "prompt": "", "image": tile, **extra}

    with serve(small) as small_url, serve(default) as default_url:
        with httpx.Client(base_url=small_url, trust_env=False, timeout=30) as client:
            assert client.get("/info").json()["limits"]["max_pixels_per_request"] == 1000
            assert client.post("/score", json={"items": [item("a"), item("b")]}).status_code == 200
            for body in (  # 1200 pixels each: masks and metadata images count
                {"items": [item("a"), item("b"), item("c")]},
                {"items": [item("a", mask=tile), item("b")]},
                {"items": [item("a", metadata_images={"reference_image": tile}), item("b")]},
            ):
                response = client.post("/score", json=body)
                assert response.status_code == 413, response.text
                detail = response.json()["detail"]
                assert "hold 1200 pixels" in detail and "limit of 1000 (max_pixels_per_request)" in detail
                assert "--max-pixels-per-request" in detail
        body = {"items": [{"id": str(i), "prompt": "", "image": huge} for i in range(10)]}
        started = time.monotonic()
        response = httpx.post(f"{default_url}/score", json=body, trust_env=False, timeout=30)
        assert response.status_code == 413 and "hold 167772160 pixels" in response.json()["detail"]
        assert time.monotonic() - started < 2.0  # refused from the headers: nothing decoded


@pytest.mark.parametrize("status", [501, 505, 507])
def test_client_retries_any_5xx_on_another_replica(status: int) -> None:
    broken = replica_answering(lambda: JSONResponse({"detail": f"status {status}"}, status_code=status))

    good = create_app({"slow": _TestScorer()}, ServerSettings(instance_id="good"))
    with serve(broken) as broken_url, serve(good) as good_url:
        with HttpRewardClient([broken_url, good_url], {"slow": 1.0}, backoff_s=0.01, verify_replicas=False) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            states = client.replica_states()
    assert result.instances == ["good"]
    assert states[broken_url]["consecutive_failures"] == 1  # the first attempt went to the broken one


def test_cancelling_a_hedged_attempt_cancels_its_request() -> None:
    scorer = _TestScorer(delay_s=0.3)
    app = create_app({"slow": scorer}, ServerSettings())
    with serve(app) as url:
        with HttpRewardClient([url], {"slow": 1.0}, batch_size=1, max_concurrency=32, hedge=True) as client:
            client.score(np.zeros((24, 4, 4, 1), np.uint8), [""] * 24)  # latencies >= 0.3 s: the hedge's p95
            scorer.delay_s = 2.0
            client.step_timeout_s = 0.1  # the step gives up while the attempt waits for the hedge delay
            with pytest.raises(RewardUnavailableError, match="step budget"):
                client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
            _wait_until(lambda: client.replica_states()[url]["outstanding"] == 0, timeout_s=1.0)


class _RecordingScorer(_TestScorer):
    """Keeps the metadata of every item it scores."""

    def __init__(self) -> None:
        super().__init__(name="recording")
        self.metadata: list[dict[str, Any]] = []

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        self.metadata.extend(metadata)
        return [0.5] * len(images)


@pytest.mark.parametrize("wire_format", WIRE_FORMATS)
def test_arrays_in_metadata_reach_the_scorer_as_arrays(wire_format: str) -> None:
    scorer = _RecordingScorer()
    reference = np.random.default_rng(2).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    with serve(create_app({"recording": scorer}, ServerSettings())) as url:
        with HttpRewardClient([url], {"recording": 1.0}, wire_format=wire_format) as client:
            metadata = [
                {"judge_task": "edit", "reference_image": reference},
                {"reference_image": reference[:, :, 0], "mask": np.ones((4, 4, 1), np.uint8)},
            ]
            result = client.score(np.zeros((2, 4, 4, 1), np.uint8), ["", ""], metadata)
            with pytest.raises(
                ValueError,
                match=r"metadata\[0\]\['reference_image'\]: arrays in metadata are sent as images, "
                r"and images must be uint8, got float32",
            ):
                client.submit(
                    np.zeros((1, 4, 4, 1), np.uint8), [""], [{"reference_image": reference.astype(np.float32)}]
                )
    assert result.combined.tolist() == [0.5, 0.5]
    first, second = scorer.metadata
    assert first["judge_task"] == "edit" and first.keys() == {"judge_task", "reference_image"}
    np.testing.assert_array_equal(first["reference_image"], reference)
    np.testing.assert_array_equal(second["reference_image"], reference[:, :, :1])
    assert second["mask"].shape == (4, 4, 1)


class _HugeScorer(_TestScorer):
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[int]:
        return [10**400] * len(images)


class _ExitingScorer(_TestScorer):
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        raise SystemExit("the scorer called sys.exit")


def test_a_score_too_large_for_a_float_is_an_internal_error_and_the_worker_lives_on() -> None:
    app = create_app({"huge": _HugeScorer(name="huge")}, ServerSettings())
    body = {"items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}]}
    with serve(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=5) as client:
        for _ in range(2):
            response = client.post("/score", json=body)
            assert response.status_code == 200
            error = response.json()["results"][0]["scores"]["huge"]["error"]
            assert error["code"] == "INTERNAL" and error["message"].startswith("scorer returned a non-number 1000")
        assert client.get("/readyz").status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit
def test_a_dead_scorer_worker_fails_its_items_and_makes_the_server_unready() -> None:
    app = create_app({"exiting": _ExitingScorer(name="exiting")}, ServerSettings())
    body = {"items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}]}
    with serve(app) as url, httpx.Client(base_url=url, trust_env=False, timeout=5) as client:
        response = client.post("/score", json=body)
        assert response.status_code == 200
        assert response.json()["results"][0]["scores"]["exiting"]["error"] == {
            "code": "INTERNAL",
            "message": "the scorer worker failed on this batch",
        }
        _wait_until(lambda: client.get("/readyz").status_code == 503, timeout_s=2.0)
        assert client.get("/readyz").json()["detail"] == "scorer worker stopped: ['exiting'] (see the server log)"
        assert client.post("/score", json=body).status_code == 503


@pytest.mark.parametrize(("signals", "drain_grace_s"), [(2, 30.0), (1, 0.5)])
def test_signals_during_a_long_load_exit_without_waiting_for_it(signals: int, drain_grace_s: float) -> None:
    process, base = spawn_reward_server(
        ["--scorers", "sleep", "--sleep-load-s", "60", "--drain-grace-s", str(drain_grace_s), "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"{base}/readyz"
    try:
        wait_for(url, status=503)  # up, loading
        process.send_signal(signal.SIGTERM)
        _wait_until(lambda: httpx.get(url, trust_env=False).json()["detail"] == "draining")
        if signals == 2:
            process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        process.wait(timeout=15)
        assert time.monotonic() - started < 5.0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class _ValueScorer(_TestScorer):
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
