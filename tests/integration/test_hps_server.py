"""``hpsv2`` through a real reward server (``python -m reward_server`` on loopback) on a tiny converted OpenCLIP
checkpoint: ``/info`` lists it with its fingerprint and range, ``POST /score`` returns the cosine scores."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
from fixtures_hps import build_tiny_hps
from servers import free_port, wait_for

from reward_server.scorers import SCORERS
from shared.imagecodec import encode_image


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("hps-server-models")
    build_tiny_hps(model_dir)
    port = free_port()
    log = model_dir / "server.log"
    command = [sys.executable, "-m", "reward_server", "--scorers", "hpsv2", "--model-dir", str(model_dir),
               "--port", str(port), "--log-level", "warning"]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        yield f"http://127.0.0.1:{port}", model_dir
    except TimeoutError:
        raise AssertionError(log.read_text()[-3000:]) from None
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def test_post_score_with_hpsv2(server) -> None:
    url, model_dir = server
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 56, 3), dtype=np.uint8) for _ in range(2)]
    prompts = ["a red cup on a table", "digit 1"]
    items = [{"id": f"item-{i}", "prompt": prompt, "image": encode_image(image, "png")}
             for i, (image, prompt) in enumerate(zip(images, prompts, strict=True))]
    with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
        info = client.get("/info").json()
        response = client.post("/score", json={"request_id": "hps-1", "items": items})
    assert response.status_code == 200, response.text
    listed = {entry["name"]: entry for entry in info["scorers"]}
    assert listed["hpsv2"]["version"].startswith("hpsv2+clip-32+")
    assert (listed["hpsv2"]["score_min"], listed["hpsv2"]["score_max"]) == (-1.0, 1.0)
    results = {result["id"]: result["scores"]["hpsv2"] for result in response.json()["results"]}
    local = SCORERS["hpsv2"](model_dir=model_dir)
    local.load()
    expected = [outcome.score for outcome in local.score(images, prompts, [{}, {}])]
    for i, value in enumerate(expected):
        assert results[f"item-{i}"]["ok"] and results[f"item-{i}"]["details"]["truncated"] is False
        assert results[f"item-{i}"]["score"] == pytest.approx(value, abs=1e-5)
