"""``videoalign`` through a real reward server (``python -m reward_server`` on loopback) on a tiny VideoReward
checkpoint converted from the authors' layout: ``/info`` lists it as a video scorer, a video item gets the reward the
scorer computes in-process with VQ, MQ, TA and Overall in its details, and an image item is a 4xx-class error."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from fixtures_videoalign import build_tiny_videoalign
from servers import reward_server_process

from reward_server.scorers import SCORERS, run_scorer
from shared.imagecodec import encode_image, encode_video

pytestmark = pytest.mark.slow  # builds, converts and serves a Qwen2-VL: over the default tier's budget

RNG = np.random.default_rng(4)
CLIP = RNG.integers(0, 256, (8, 36, 52, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model_dir = build_tiny_videoalign(tmp_path_factory.mktemp("videoalign-server-models"))
    with reward_server_process("videoalign", model_dir, timeout_s=180) as url:
        yield url, model_dir


def test_a_video_item_gets_videoreward_and_an_image_item_fails(server) -> None:
    url, model_dir = server
    items = [
        {"id": "clip", "prompt": "a cat chasing a ball", "video": encode_video(CLIP, 12)},
        {"id": "still", "prompt": "a cat", "image": encode_image(CLIP[0], "png")},
    ]
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
        info = client.get("/info").json()
        response = client.post("/score", json={"request_id": "videoalign-1", "items": items, "scorers": ["videoalign"]})
    assert response.status_code == 200, response.text
    (listed,) = [entry for entry in info["scorers"] if entry["name"] == "videoalign"]
    assert listed["version"].startswith("videoalign+qwen2_vl+")
    assert (listed["score_min"], listed["score_max"]) == (None, None)
    results = {result["id"]: result["scores"]["videoalign"] for result in response.json()["results"]}
    local = SCORERS["videoalign"](model_dir=model_dir)
    local.load()
    (expected,) = run_scorer(local, [CLIP], ["a cat chasing a ball"], [{"fps": 12.0}])
    scored = results["clip"]
    assert scored["ok"] and scored["score"] == pytest.approx(expected.score, abs=1e-5)
    for key in ("VQ", "MQ", "TA", "Overall"):
        assert scored["details"][key] == pytest.approx(expected.details[key], abs=1e-5)
    assert scored["details"]["frames"] == [0, 2, 5, 7]  # 8 frames at 12 fps: 4 frames, the least, evenly
    still = results["still"]
    assert not still["ok"] and still["error"]["code"] == "BAD_INPUT" and "is an image" in still["error"]["message"]
