"""Videos ([B, F, C, H, W]) in the trainer's outputs and reward requests: uint8 conversion, animated grids, rollout
previews (animated GIF), lossless evaluation grids (APNG), TensorBoard summaries and the fps reward metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from trainer.logging import RunLogger, grid_pixels, input_rows, save_image, to_uint8
from trainer.models.base import ImageInputs
from trainer.video import adapter_fps, with_fps

VIDEOS = torch.rand(2, 3, 3, 8, 12, generator=torch.Generator().manual_seed(0))  # [B, F, C, H, W]


def _frames(path) -> list[np.ndarray]:
    with Image.open(path) as image:
        return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]


def test_to_uint8_keeps_frames_first_per_item() -> None:
    pixels = to_uint8(VIDEOS)
    assert pixels.shape == (2, 3, 8, 12, 3) and pixels.dtype == np.uint8
    np.testing.assert_array_equal(pixels[1, 2], to_uint8(VIDEOS[1])[2])  # frame 2 of item 1, as an image


def test_a_video_grid_is_the_grid_of_each_frame() -> None:
    pixels = to_uint8(VIDEOS)
    grid = grid_pixels(pixels, rows=1)
    assert grid.shape[0] == 3
    for frame in range(3):
        np.testing.assert_array_equal(grid[frame], grid_pixels(np.ascontiguousarray(pixels[:, frame]), 1))


def test_videos_save_as_lossless_apng_or_animated_gif(tmp_path) -> None:
    clip = to_uint8(VIDEOS)[0]
    png = save_image(clip, tmp_path / "grid.png", fps=8)
    assert (png.frames, png.fps, png.height, png.width) == (3, 8, 8, 12)
    for got, sent in zip(_frames(tmp_path / "grid.png"), clip, strict=True):
        np.testing.assert_array_equal(got, sent)  # every frame's exact pixels
    gif = save_image(clip, tmp_path / "samples.jpg", fps=8)  # a view: an animated GIF instead of a JPEG
    assert gif.path.suffix == ".gif" and len(_frames(gif.path)) == 3
    with Image.open(gif.path) as image:
        assert image.info["duration"] == 120 and image.info["loop"] == 0  # GIF delays count in 10 ms


def test_input_images_are_held_over_the_frames() -> None:
    inputs = ImageInputs(image=torch.rand(2, 3, 8, 12))
    (row,) = input_rows(inputs, VIDEOS)
    assert row.shape == VIDEOS.shape and torch.equal(row[:, 0], row[:, 2])


def test_rollouts_and_evaluations_of_videos_are_animated(tmp_path) -> None:
    logger = RunLogger(tmp_path, enabled=True, tensorboard=True)
    logger.fps = 10
    logger.rollout_samples(1, VIDEOS, ["a", "b"], [0.5, 0.25], {"s": [0.5, 0.25]})
    assert len(_frames(tmp_path / "rollouts" / "epoch0001.gif")) == 3
    assert (tmp_path / "rollouts" / "epoch0001.jsonl").read_text().count("\n") == 2
    logger.image_grid("eval_0001", VIDEOS, rows=2, step=1, prompts=["a", "b"])
    lossless = _frames(tmp_path / "eval_0001.png")
    np.testing.assert_array_equal(lossless[1], grid_pixels(np.ascontiguousarray(to_uint8(VIDEOS)[:, 1]), 2))
    assert len(_frames(tmp_path / "eval_0001.gif")) == 3
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard" / "rl")).Reload()
    assert events.Images("eval/samples")[0].encoded_image_string.startswith(b"GIF89a")  # TensorBoard plays it
    assert events.Images("rollouts/samples")[0].encoded_image_string.startswith(b"GIF89a")


def test_reward_metadata_carries_the_adapters_fps() -> None:
    class Wan:
        fps = 24

    assert adapter_fps(Wan()) == 24 and adapter_fps(object()) == 16
    assert with_fps([{"x": 1}], VIDEOS, 24) == [{"fps": 24, "x": 1}]
    assert with_fps([{"x": 1}], VIDEOS[:, 0], 24) == [{"x": 1}]  # images: as they are


@pytest.mark.parametrize("fps", [1, 16, 30])
def test_gif_frame_delays_follow_the_fps(tmp_path, fps: int) -> None:
    save_image(to_uint8(VIDEOS)[0], tmp_path / "a.gif", fps=fps)
    with Image.open(tmp_path / "a.gif") as image:
        assert image.info["duration"] == max(10 * round(100 / fps), 20)
