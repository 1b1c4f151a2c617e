"""``hpsv2``, ``imagereward``, ``hpsv3`` and ``unifiedreward`` through one real reward server (``python -m
reward_server`` on loopback) on tiny checkpoints (converted from their reference layouts; UnifiedReward's rigged
to answer "Final Score:4"): ``/info`` lists each with its fingerprint and range, and ``POST /score`` returns the
scores the scorer computes in-process."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from fixtures_hps import build_tiny_hps
from fixtures_hpsv3 import build_tiny_hpsv3
from fixtures_imagereward import build_tiny_imagereward
from fixtures_models import build_tiny_qwen_vl, rig_answer
from servers import reward_server_process

from reward_server.scorers import SCORERS
from shared.imagecodec import encode_image

NAMES = ("hpsv2", "imagereward")
VLM_NAMES = ("hpsv3", "unifiedreward")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("preference-server-models")
    build_tiny_hps(model_dir)
    build_tiny_imagereward(model_dir)
    build_tiny_hpsv3(model_dir)
    rig_answer(build_tiny_qwen_vl(model_dir / "unifiedreward"), "Final Score:4")
    with reward_server_process(",".join(NAMES + VLM_NAMES), model_dir, timeout_s=120) as url:
        yield url, model_dir


def test_post_score_with_hpsv2_and_imagereward(server) -> None:
    url, model_dir = server
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 56, 3), dtype=np.uint8) for _ in range(2)]
    prompts = ["a red cup on a table", "digit 1"]
    items = [
        {"id": f"item-{i}", "prompt": prompt, "image": encode_image(image, "png")}
        for i, (image, prompt) in enumerate(zip(images, prompts, strict=True))
    ]
    with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
        info = client.get("/info").json()
        response = client.post("/score", json={"request_id": "preference-1", "items": items, "scorers": list(NAMES)})
    assert response.status_code == 200, response.text
    listed = {entry["name"]: entry for entry in info["scorers"]}
    assert listed["hpsv2"]["version"].startswith("hpsv2+clip-32+")
    assert (listed["hpsv2"]["score_min"], listed["hpsv2"]["score_max"]) == (-1.0, 1.0)
    assert listed["imagereward"]["version"].startswith("imagereward+blip-32+")
    assert (listed["imagereward"]["score_min"], listed["imagereward"]["score_max"]) == (None, None)
    results = {result["id"]: result["scores"] for result in response.json()["results"]}
    for name in NAMES:
        local = SCORERS[name](model_dir=model_dir)
        local.load()
        expected = [outcome.score for outcome in local.score(images, prompts, [{}, {}])]
        for i, value in enumerate(expected):
            scored = results[f"item-{i}"][name]
            assert scored["ok"] and scored["details"]["truncated"] is False, scored
            assert scored["score"] == pytest.approx(value, abs=1e-5)


def test_post_score_with_hpsv3_and_unifiedreward(server) -> None:
    url, model_dir = server
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (48, 40, 3), dtype=np.uint8) for _ in range(2)]
    prompts = ["a red cup on a table", "a dog"]
    items = [
        {"id": f"item-{i}", "prompt": prompt, "image": encode_image(image, "png")}
        for i, (image, prompt) in enumerate(zip(images, prompts, strict=True))
    ]
    with httpx.Client(base_url=url, trust_env=False, timeout=60) as client:
        info = client.get("/info").json()
        response = client.post("/score", json={"request_id": "vlm-1", "items": items, "scorers": list(VLM_NAMES)})
    assert response.status_code == 200, response.text
    listed = {entry["name"]: entry for entry in info["scorers"]}
    assert listed["hpsv3"]["version"].startswith("hpsv3+qwen2_vl+")
    assert (listed["hpsv3"]["score_min"], listed["hpsv3"]["score_max"]) == (None, None)
    assert listed["unifiedreward"]["version"].startswith("unifiedreward+qwen2_5_vl+")
    assert (listed["unifiedreward"]["score_min"], listed["unifiedreward"]["score_max"]) == (1.0, 5.0)
    results = {result["id"]: result["scores"] for result in response.json()["results"]}
    local = SCORERS["hpsv3"](model_dir=model_dir)
    local.load()
    for i, expected in enumerate(local.score(images, prompts, [{}, {}])):
        scored = results[f"item-{i}"]
        assert scored["hpsv3"]["ok"] and scored["hpsv3"]["score"] == pytest.approx(expected.score, abs=1e-5)
        assert scored["hpsv3"]["details"]["sigma"] == pytest.approx(expected.details["sigma"], abs=1e-5)
        assert scored["unifiedreward"] == {**scored["unifiedreward"], "ok": True, "score": 4.0}
