"""Video items through a real uvicorn server: the client's clips arrive pixel for pixel with their fps, image scorers
score sampled frames, the video scorers (temporal consistency, OCR over frames) answer, and bad clips get a 4xx."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from servers import serve
from text_images import render

from reward_server.app import create_app
from reward_server.scorers import build_scorers
from reward_server.settings import ServerSettings
from shared.imagecodec import encode_image, encode_video
from trainer.rewards import HttpRewardClient

RNG = np.random.default_rng(7)
CLIPS = RNG.integers(0, 256, (2, 5, 24, 40, 3), dtype=np.uint8)  # [B, F, H, W, C]


class Recorder:
    """A video scorer that keeps what it was given (the clips and their metadata) and scores 0.5."""

    name, description, score_range, version, modality = "recorder", "test", (0.0, 1.0), "r1", "video"

    def __init__(self) -> None:
        self.seen: list[tuple[np.ndarray, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def load(self) -> None:
        pass

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        with self.lock:
            self.seen.extend(zip(images, metadata, strict=True))
        return [0.5] * len(images)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


SETTINGS = {"max_frames": 6, "video_frames": 3, "video_reduce": "mean"}


@pytest.fixture(scope="module")
def server(recorder: Recorder) -> Iterator[str]:
    scorers = {"recorder": recorder, **build_scorers(["brightness"])}
    with serve(create_app(scorers, ServerSettings(instance_id="video", **SETTINGS))) as url:
        yield url


@pytest.fixture(scope="module")
def model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """temporal_consistency (a tiny CLIP) and ocr (RapidOCR): some 15 s to load on a busy 2-core machine."""
    from fixtures_models import build_tiny_clip_score

    model_dir = tmp_path_factory.mktemp("video-models")
    build_tiny_clip_score(model_dir, "clipscore", processor_subfolder=False)
    scorers = build_scorers(["temporal_consistency", "ocr"], model_dir=model_dir)
    with serve(create_app(scorers, ServerSettings(instance_id="video-models", **SETTINGS))) as url:
        yield url


@pytest.mark.parametrize("wire_format", ["msgpack", "msgpack+zstd", "png"])
def test_videos_arrive_pixel_for_pixel_with_their_fps(server: str, recorder: Recorder, wire_format: str) -> None:
    recorder.seen.clear()
    weights = {"recorder": 1.0, "brightness": 1.0}
    with HttpRewardClient([server], weights, wire_format=wire_format, timeout_s=30) as client:
        result = client.score(CLIPS, ["a", "b"], [{"fps": 24}, {}])
    assert len(recorder.seen) == 2
    for (seen, meta), sent, fps in zip(recorder.seen, CLIPS, (24.0, 16.0), strict=True):
        np.testing.assert_array_equal(seen, sent)
        assert meta["fps"] == fps
    expected = [np.mean([clip[i].mean() / 255 for i in (0, 2, 4)]) for clip in CLIPS]  # 3 frames of 5, evenly spaced
    np.testing.assert_allclose(result.components["brightness"], expected, rtol=1e-9)


def test_image_scorers_report_each_frame(server: str) -> None:
    body = {"scorers": ["brightness"], "items": [{"id": "v", "prompt": "", "video": encode_video(CLIPS[0], 8)}]}
    answer = httpx.post(f"{server}/score", json=body, timeout=30, trust_env=False)
    assert answer.status_code == 200, answer.text
    details = answer.json()["results"][0]["scores"]["brightness"]["details"]
    assert details["frames"] == [0, 2, 4] and details["reduce"] == "mean" and len(details["frame_scores"]) == 3
    info = httpx.get(f"{server}/info", trust_env=False).json()
    assert info["video"] == {"frames": 3, "reduce": "mean"} and info["limits"]["max_frames"] == 6


@pytest.mark.slow
def test_temporal_consistency_and_ocr_score_videos(model_server: str) -> None:
    still = np.repeat(render("OPEN", size=(160, 96), font_size=32)[None], 4, axis=0)
    items = [
        {"id": "still", "prompt": 'a sign that reads "OPEN"', "video": encode_video(still, 16)},
        {"id": "noise", "prompt": 'a sign that reads "OPEN"', "video": encode_video(CLIPS[0], 16)},
    ]
    answer = httpx.post(  # noqa: S113
        f"{model_server}/score", json={"scorers": ["temporal_consistency", "ocr"], "items": items}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    still_scores, noise_scores = (result["scores"] for result in answer.json()["results"])
    assert still_scores["temporal_consistency"]["score"] == pytest.approx(1.0, abs=1e-5)
    assert noise_scores["temporal_consistency"]["score"] < still_scores["temporal_consistency"]["score"]
    ocr = still_scores["ocr"]
    assert ocr["score"] == pytest.approx(1.0) and ocr["details"]["frames"] == [0, 2, 3]
    assert [d["recognized"] for d in ocr["details"]["frame_details"]] == ["OPEN"] * 3
    assert noise_scores["ocr"]["ok"] and noise_scores["ocr"]["score"] < 0.5


def _frames(count: int, size: tuple[int, int] = (8, 8)) -> list[dict[str, Any]]:
    return [encode_image(RNG.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(count)]


@pytest.mark.parametrize(
    ("video", "status", "message"),
    [
        ({"fps": 16, "frames": []}, 422, "at least 1 item"),
        ({"fps": 0, "frames": _frames(2)}, 422, "greater than 0"),
        ({"fps": 16, "frames": _frames(7)}, 413, "7 frames exceeds the limit of 6"),
        ({"fps": 16, "frames": _frames(1) + _frames(1, (8, 9))}, 422, "frames must all have one size"),
        ({"fps": 16, "frames": [*_frames(1), {"format": "png", "data": "aGVsbG8="}]}, 422, "frame 1 does not decode"),
    ],
    ids=["empty", "fps-0", "too-many-frames", "sizes", "undecodable"],
)
def test_bad_videos_get_a_4xx_naming_the_problem(server: str, video: dict, status: int, message: str) -> None:
    body = {"scorers": ["brightness"], "items": [{"id": "v", "prompt": "", "video": video}]}
    answer = httpx.post(f"{server}/score", json=body, timeout=30, trust_env=False)
    assert answer.status_code == status and message in answer.json()["detail"], answer.text


def test_a_video_counts_its_frames_pixels(tmp_path: Path) -> None:
    settings = ServerSettings(instance_id="small", max_pixels_per_request=4 * 8 * 8)
    with serve(create_app(build_scorers(["brightness"]), settings)) as url:
        body = {"items": [{"id": "v", "prompt": "", "video": {"fps": 16, "frames": _frames(5)}}]}
        answer = httpx.post(f"{url}/score", json=body, timeout=30, trust_env=False)
    assert answer.status_code == 413 and "320 pixels" in answer.json()["detail"]
