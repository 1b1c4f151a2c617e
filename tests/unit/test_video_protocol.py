"""Video items on the wire and image scorers over video frames: schemas, the codec, frame sampling and reduction."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from reward_server.scorers.base import run_scorer
from reward_server.scorers.frames import FrameSampling, frame_indices
from shared.imagecodec import encode_image, encode_video
from shared.protocol import BinaryScoreRequest, ErrorCode, ScoreRequest, TooManyFramesError
from shared.rewards import check_batch
from shared.wire import pack_msgpack, unpack_msgpack
from trainer.rewards.wire import encode_body

CLIP = np.random.default_rng(0).integers(0, 256, (5, 8, 12, 3), dtype=np.uint8)


def _request(video: dict, **item: object) -> dict:
    return {"items": [{"id": "a", "prompt": "p", "video": video, **item}]}


def test_json_and_msgpack_video_items_validate() -> None:
    request = ScoreRequest.model_validate(_request(encode_video(CLIP, 24, "png")))
    assert request.items[0].video is not None and len(request.items[0].video.frames) == 5
    assert request.items[0].video.fps == 24 and request.items[0].image is None
    body = pack_msgpack(_request(encode_video(CLIP, 16, "raw", binary=True)))
    binary = BinaryScoreRequest.model_validate(unpack_msgpack(body))
    frame = binary.items[0].video.frames[2]
    np.testing.assert_array_equal(np.frombuffer(frame.data, np.uint8).reshape(frame.shape), CLIP[2])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v.update(frames=[]), "at least 1 item"),
        (lambda v: v.update(fps=0), "greater than 0"),
        (lambda v: v.update(fps=-3), "greater than 0"),
        (lambda v: v["frames"].append(encode_image(CLIP[0, :4], "raw")), "one shape"),
    ],
    ids=["empty", "fps-0", "fps-negative", "sizes"],
)
def test_bad_videos_are_refused_naming_the_problem(change, message: str) -> None:
    video = encode_video(CLIP, 16, "raw")
    change(video)
    with pytest.raises(ValidationError, match=message):
        ScoreRequest.model_validate(_request(video))


def test_an_item_holds_one_of_image_and_video() -> None:
    with pytest.raises(ValidationError, match="exactly one of image and video"):
        ScoreRequest.model_validate(_request(encode_video(CLIP), image=encode_image(CLIP[0])))
    with pytest.raises(ValidationError, match="exactly one of image and video"):
        ScoreRequest.model_validate({"items": [{"id": "a", "prompt": "p"}]})
    with pytest.raises(ValidationError, match="'fps' is reserved"):
        ScoreRequest.model_validate(_request(encode_video(CLIP), metadata={"fps": 3}))


def test_too_many_frames_is_its_own_error() -> None:
    with pytest.raises(TooManyFramesError, match="5 frames exceeds the limit of 4"):
        ScoreRequest.model_validate(_request(encode_video(CLIP, 16, "raw")), context={"max_frames": 4})


def test_client_bodies_send_videos_with_their_fps() -> None:
    batch, prompts, meta = check_batch(np.stack([CLIP, CLIP]), ["x", "y"], [{"fps": 8}, {}])
    body = encode_body(batch, prompts, meta, 0, wire_format="msgpack", scorers=["s"], timeout_s=5)
    items = BinaryScoreRequest.model_validate(unpack_msgpack(body)).items
    assert [item.video.fps for item in items] == [8.0, 16.0] and items[0].metadata == {}
    with pytest.raises(ValueError, match=r"\[B, F, H, W, C\]"):
        check_batch(np.zeros((2, 0, 4, 4, 3), np.uint8), ["x", "y"], None)


@pytest.mark.parametrize(
    ("frames", "count", "expected"),
    [(33, 8, [0, 5, 9, 14, 18, 23, 27, 32]), (5, 8, [0, 1, 2, 3, 4]), (9, 3, [0, 4, 8]), (7, 1, [0]), (2, 2, [0, 1])],
)
def test_frames_are_evenly_spaced_with_first_and_last(frames: int, count: int, expected: list[int]) -> None:
    assert frame_indices(frames, count) == expected


class _MeanPixel:
    """Scores an image by its mean pixel / 255; fails images whose first pixel is 0 (a stand-in for a bad frame)."""

    name, description, score_range, version = "mean_pixel", "test", (0.0, 1.0), "1"
    calls: list[int] = []

    def score(self, images, prompts, metadata):
        self.calls.append(len(images))
        assert all(image.ndim == 3 for image in images)
        return [float("nan") if image[0, 0, 0] == 0 else float(image.mean()) / 255 for image in images]


def test_image_scorers_score_sampled_frames_reduced_by_mean_or_min() -> None:
    clip = np.stack([np.full((4, 4, 3), 10 * (i + 1), np.uint8) for i in range(9)])
    image = np.full((4, 4, 3), 51, np.uint8)
    scorer = _MeanPixel()
    mean, still = run_scorer(scorer, [clip, image], ["p", "p"], [{}, {}], FrameSampling(3, "mean"))
    assert mean.details["frames"] == [0, 4, 8] and mean.details["reduce"] == "mean"
    assert mean.details["frame_scores"] == pytest.approx([10 / 255, 50 / 255, 90 / 255])
    assert mean.score == pytest.approx(50 / 255) and still.score == pytest.approx(0.2) and "frames" not in still.details
    assert max(scorer.calls[-2:]) <= 2  # never more images per call than the items it was given
    (low,) = run_scorer(scorer, [clip], ["p"], [{}], FrameSampling(3, "min"))
    assert low.score == pytest.approx(10 / 255)
    clip[4, 0, 0, 0] = 0  # a failed frame fails the clip: NaN, never a partial mean
    (failed,) = run_scorer(scorer, [clip], ["p"], [{}], FrameSampling(3, "mean"))
    assert failed.error is ErrorCode.INTERNAL and failed.message.startswith("frame 4:")


def test_video_scorers_get_whole_clips_and_refuse_images() -> None:
    class Clip(_MeanPixel):
        modality = "video"

        def score(self, images, prompts, metadata):
            return [float(len(video)) / 100 for video in images]

    video, image = run_scorer(Clip(), [CLIP, CLIP[0]], ["p", "p"], [{}, {}])
    assert video.score == pytest.approx(0.05)
    assert image.error is ErrorCode.BAD_INPUT and "scores videos" in image.message


@pytest.mark.parametrize("setting", [{"frames": 0}, {"reduce": "median"}])
def test_frame_sampling_refuses_bad_settings(setting: dict) -> None:
    with pytest.raises(ValueError, match="video"):
        FrameSampling(**setting)


def test_the_preflight_counts_every_frame() -> None:
    from shared.protocol import Limits
    from trainer.rewards.preflight import Requests

    limits = Limits(max_items=256, max_image_side=4096, max_body_bytes=1 << 30, max_pixels_per_request=1 << 27)
    assert Requests(16, 480, frames=33).beyond("u", limits) is None
    problem = Requests(32, 480, frames=33).beyond("u", limits)
    assert "243302400 pixels" in problem and "reward.batch_size=17 or less" in problem
    frames = Requests(2, 480, frames=33).beyond("u", limits.model_copy(update={"max_frames": 32}))
    assert "videos of 33 frames" in frames and "--max-frames 33" in frames
