"""The reward server's behaviour around scoring: the bearer token, readiness, deadlines, queues and micro-batches,
load failures and the CLI's exit statuses, the drain on SIGTERM, metrics and a scorer worker that dies. Servers run
as uvicorn in a thread of the test process (``servers.serve``), which can host slow or broken test scorers, or as
``python -m reward_server`` subprocesses."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest
from fixtures_reward_server import StubScorer, queued, wait_until
from prometheus_client.parser import text_string_to_metric_families
from servers import free_port, serve, spawn_reward_server, wait_for

from reward_server.__main__ import main as server_main
from reward_server.app import create_app
from reward_server.scorers import SCORERS as SCORER_REGISTRY
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image
from trainer.rewards import HttpRewardClient, RewardRequestError


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
    app = create_app({"slow": StubScorer(gate=gate)}, ServerSettings())
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
    app = create_app({"slow": StubScorer(delay_s=0.5)}, ServerSettings())
    body = {
        "deadline_ms": 100,
        "items": [{"id": "a", "prompt": "", "image": encode_image(np.zeros((4, 4, 1), np.uint8))}],
    }
    with serve(app) as url:
        response = httpx.post(f"{url}/score", json=body, trust_env=False)
    assert response.status_code == 200
    assert response.json()["results"][0]["scores"]["slow"]["error"]["code"] == "TIMEOUT"


class _CountingScorer(StubScorer):
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
        wait_until(lambda: app.state.service.workers["slow"].queued_items == 0)  # it reached the expired items
        metrics = httpx.get(f"{url}/metrics", trust_env=False).text
    scores = [r["scores"]["slow"] for r in response.json()["results"]]
    assert scores[0]["error"] is None and scores[0]["score"] is not None  # finished before the deadline: kept
    assert [s["error"]["code"] for s in scores[1:]] == ["TIMEOUT"] * 3  # item 2 was still being scored
    assert scorer.calls == [1, 1]  # items 3 and 4 were past the deadline when their turn came: never computed
    assert 'rewardflow_items_total{outcome="TIMEOUT",scorer="slow"}' in metrics


def test_full_queue_is_429_and_drain_lets_in_flight_work_finish() -> None:
    app = create_app({"slow": StubScorer(delay_s=0.6)}, ServerSettings(max_items=2, max_queue_items=2))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    body = {"items": [{"id": str(i), "prompt": "", "image": image} for i in range(2)]}
    with serve(app) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                in_flight = asyncio.create_task(client.post("/score", json=body))
                await queued(app, 2)
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
        {"slow": StubScorer(delay_s=0.6), "quick": StubScorer(name="quick")},
        ServerSettings(max_items=2, max_queue_items=2),
    )
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    items = [{"id": str(i), "prompt": "", "image": image} for i in range(2)]
    with serve(app) as url:

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                in_flight = asyncio.create_task(client.post("/score", json={"scorers": ["slow"], "items": items}))
                await queued(app, 2)
                assert (await client.post("/score", json={"scorers": ["slow"], "items": items})).status_code == 429
                ready = await client.get("/readyz")  # for load balancers: this replica is busy
                assert ready.status_code == 503 and ready.json()["detail"] == "queue full: ['slow']"
                quick = await client.post("/score", json={"scorers": ["quick"], "items": items})
                assert quick.status_code == 200
                assert [r["scores"]["quick"]["score"] for r in quick.json()["results"]] == [0.5, 0.5]
                assert (await in_flight).status_code == 200

        asyncio.run(scenario())


def test_concurrent_requests_share_a_micro_batch() -> None:
    app = create_app({"slow": StubScorer(delay_s=0.05)}, ServerSettings(batch_wait_ms=200))
    image = encode_image(np.zeros((4, 4, 1), np.uint8))
    with serve(app) as url:

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10) as client:
                bodies = [{"items": [{"id": "a", "prompt": "", "image": image}]} for _ in range(2)]
                return await asyncio.gather(*(client.post("/score", json=body) for body in bodies))

        responses = asyncio.run(both())
    assert [r.json()["timing"]["scorers"]["slow"]["batch_size"] for r in responses] == [2, 2]


class _BrokenScorer(StubScorer):
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


def test_prometheus_metrics() -> None:
    app = create_app(
        {"slow": StubScorer(delay_s=0.01), "brightness": build_scorers(["brightness"])["brightness"]},
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


class _HugeScorer(StubScorer):
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[int]:
        return [10**400] * len(images)


class _ExitingScorer(StubScorer):
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
        wait_until(lambda: client.get("/readyz").status_code == 503, timeout_s=2.0)
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
        wait_until(lambda: httpx.get(url, trust_env=False).json()["detail"] == "draining")
        if signals == 2:
            process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        process.wait(timeout=15)
        assert time.monotonic() - started < 5.0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
