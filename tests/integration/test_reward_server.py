"""Reward servers over real HTTP on 127.0.0.1: the endpoints, limits, drain, the pool client and launcher.

Two kinds of real servers are used: ``python -m reward_server`` subprocesses started by
``LocalRewardPool`` (the production path), and uvicorn servers in a thread of the test process
(``_serve``), which can host test scorers that are slow, never ready or impostors.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from sklearn.datasets import load_digits

from reward_server.__main__ import main as server_main
from reward_server.app import create_app
from reward_server.scorers import SCORERS as SCORER_REGISTRY
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image
from trainer.rewards import (
    HttpRewardClient,
    InProcessRewardClient,
    LocalRewardPool,
    RewardClientError,
    RewardPoolError,
    RewardRequestError,
    RewardUnavailableError,
)

SCORERS = ["digit", "brightness", "jpeg_compressibility"]
POOL_LIMITS = ["--max-items", "16", "--max-body-bytes", "300000", "--max-image-side", "64"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _dead_url() -> str:
    """A loopback URL with nothing listening (connection refused)."""
    return f"http://127.0.0.1:{_free_port()}"


def _wait_for(url: str, status: int = 200, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code == status:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {status} within {timeout_s} s")


@contextmanager
def _serve(app: FastAPI, *, wait_ready: bool = True) -> Iterator[str]:
    """Run ``app`` under uvicorn on a free loopback port in a thread; yield its base URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{url}/readyz" if wait_ready else f"{url}/livez")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


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

    def score(
        self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> list[float]:
        time.sleep(self.delay_s)
        return [0.5] * len(images)


def _item(
    item_id: str, image: np.ndarray, prompt: str = "digit 1", wire_format: str = "png", **extra: Any
) -> dict:
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
    with LocalRewardPool(
        SCORERS, replicas=2, log_dir=log_dir, extra_args=POOL_LIMITS, ready_timeout_s=60
    ) as running:
        yield running


@pytest.fixture(scope="module")
def http(pool: LocalRewardPool) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pool.urls[0], trust_env=False, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def in_process() -> Iterator[InProcessRewardClient]:
    with InProcessRewardClient.from_names(
        {"digit": 1.0, "brightness": 0.5, "jpeg_compressibility": 0.1}
    ) as client:
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
    assert info["limits"] == {"max_items": 16, "max_image_side": 64, "max_body_bytes": 300000}
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
            b'{"scorers": ["aesthetic"], "items": [{"id": "a", "prompt": "", "image": {"format": "png", "data": "AA"}}]}',
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

    wide = http.post(
        "/score", json={"items": [_item("ok", image), _item("wide", np.zeros((8, 65, 1), np.uint8))]}
    )
    assert wide.status_code == 422
    assert "items.1 (id 'wide'): image is 8x65, larger than the maximum side 64" in wide.json()["detail"]


def test_bearer_token() -> None:
    app = create_app(build_scorers(["brightness"]), ServerSettings(token="s3cret"))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    with _serve(app) as url, httpx.Client(base_url=url, trust_env=False) as client:
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
    with _serve(app, wait_ready=False) as url, httpx.Client(base_url=url, trust_env=False) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["detail"] == "loading"
        body = {"items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}]}
        busy = client.post("/score", json=body)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        gate.set()
        _wait_for(f"{url}/readyz")
        assert client.post("/score", json=body).status_code == 200


def test_deadline_turns_late_items_into_timeouts() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.5)}, ServerSettings())
    body = {
        "deadline_ms": 100,
        "items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}],
    }
    with _serve(app) as url:
        response = httpx.post(f"{url}/score", json=body, trust_env=False)
    assert response.status_code == 200
    assert response.json()["results"][0]["scores"]["slow"]["error"]["code"] == "TIMEOUT"


def test_full_queue_is_429_and_drain_lets_in_flight_work_finish() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.6)}, ServerSettings(max_items=2, max_queue_items=2))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    body = {"items": [{"id": str(i), "prompt": "", "image": image} for i in range(2)]}
    with _serve(app) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                in_flight = asyncio.create_task(client.post("/score", json=body))
                await asyncio.sleep(0.2)
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


def test_concurrent_requests_share_a_micro_batch() -> None:
    app = create_app({"slow": _TestScorer(delay_s=0.05)}, ServerSettings(batch_wait_ms=200))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    with _serve(app) as url:

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
    with _serve(app, wait_ready=False) as url:
        _wait_for(f"{url}/readyz", status=503)
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.05)
        detail = httpx.get(f"{url}/readyz", trust_env=False).json()["detail"]
    assert detail == "loading failed: FileNotFoundError: /models/missing.safetensors"
    assert isinstance(failures[0], FileNotFoundError)


def test_cli_exits_with_status_1_when_a_scorer_fails_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCORER_REGISTRY, "broken", lambda model_dir=None: _BrokenScorer(name="broken"))
    assert server_main(["--scorers", "broken", "--port", str(_free_port()), "--log-level", "error"]) == 1


def test_sigterm_drains_then_exits_cleanly(tmp_path) -> None:
    port = _free_port()
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
        _wait_for(f"http://127.0.0.1:{port}/readyz")
        process.send_signal(signal.SIGTERM)
        _wait_for(f"http://127.0.0.1:{port}/readyz", status=503, timeout_s=0.9)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "draining" in log.read_text()


# Client ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire_format", ["png", "raw"])
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
    assert result.errors["digit"] == {
        1: "PARSE: no digit 0-9 or digit word in prompt 'a cat' nor metadata['digit']"
    }
    assert result.num_failed == 1


def test_client_retries_on_another_replica(pool: LocalRewardPool) -> None:
    images = np.zeros((8, 16, 16, 1), np.uint8)
    with HttpRewardClient(
        [_dead_url(), *pool.urls], {"brightness": 1.0}, batch_size=2, backoff_s=0.01
    ) as client:
        result = client.score(images, ["x"] * 8)
        assert result.combined.tolist() == [0.0] * 8
        assert all(instance.startswith("local-") for instance in result.instances)


def test_client_retries_503_on_another_replica() -> None:
    gate = threading.Event()
    loading = create_app(
        {"brightness": _TestScorer(name="brightness", gate=gate)}, ServerSettings(instance_id="loading")
    )
    ready = create_app(build_scorers(["brightness"]), ServerSettings(instance_id="ready"))
    with _serve(loading, wait_ready=False) as loading_url, _serve(ready) as ready_url:
        with HttpRewardClient([loading_url, ready_url], {"brightness": 1.0}, backoff_s=0.01) as client:
            result = client.score(np.zeros((1, 4, 4, 1), np.uint8), [""])
        assert result.instances == ["ready"]
        metrics = httpx.get(f"{loading_url}/metrics", trust_env=False).text
        assert 'rewardflow_requests_total{path="/score",status="503"} 1' in metrics
        gate.set()


def test_client_raises_when_every_replica_is_down() -> None:
    urls = [_dead_url(), _dead_url()]
    started = time.monotonic()
    with HttpRewardClient(urls, {"brightness": 1.0}, max_retries=2, backoff_s=0.01) as client:
        with pytest.raises(RewardUnavailableError, match="after 3 attempts") as caught:
            client.score(np.zeros((2, 4, 4, 1), np.uint8), ["", ""])
    assert all(url in str(caught.value) for url in urls)
    assert time.monotonic() - started < 10


def test_client_4xx_is_final(pool: LocalRewardPool) -> None:
    with HttpRewardClient(pool.urls, {"aesthetic": 1.0}) as client:
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
    with _serve(impostor) as url:
        with HttpRewardClient([*pool.urls, url], {"digit": 1.0}) as client:
            with pytest.raises(RewardClientError, match="runs digit digits-other"):
                client.check_replicas()
        with HttpRewardClient([url], {"brightness": 1.0}) as client:
            with pytest.raises(RewardClientError, match=r"does not serve scorer\(s\) \['brightness'\]"):
                client.check_replicas()


def test_launcher_reports_a_replica_that_dies(tmp_path) -> None:
    with pytest.raises(RewardPoolError, match="exited with status 2(.|\n)*unrecognized arguments: --bogus"):
        with LocalRewardPool(["brightness"], replicas=1, log_dir=tmp_path, extra_args=["--bogus"]):
            pass
    assert (tmp_path / "replica-0.log").exists()
