"""A run's image outputs: grids keep large images at their size and enlarge small ones; trackers get the files'
bytes, never a second encoding (TensorBoard's events read back); rollout samples with their prompts and rewards."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.logging import MASK_TINT, RunLogger, grid_pixels, input_rows, save_grid, to_uint8, with_inputs
from trainer.models.base import ImageInputs


def _events(run_dir, axis: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / axis), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.mark.parametrize(("side", "scale"), [(16, 4), (40, 3), (64, 2), (200, 1), (1024, 1)])
def test_a_grid_enlarges_only_small_images(tmp_path, side, scale):
    images = torch.rand(6, 3, side, side if side < 1024 else 8)  # 2 rows of 3; a 1024 x 8 strip: its larger side
    width = 3 * ((side if side < 1024 else 8) + 1) + 1
    picture = save_grid(images, 2, tmp_path / "grid.png")
    pixels = grid_pixels(to_uint8(images), 2)
    assert pixels.shape == ((2 * (side + 1) + 1) * scale, width * scale, 3)
    assert (picture.height, picture.width, picture.channels) == pixels.shape
    assert np.array_equal(np.asarray(Image.open(picture.path)), pixels)  # lossless
    first = (images[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    assert np.array_equal(
        pixels[scale : scale * (1 + first.shape[0]) : scale, scale : scale * (1 + first.shape[1]) : scale], first
    )


def test_a_grey_grid_is_saved_once_and_tensorboard_holds_its_bytes(tmp_path):
    logger = RunLogger(tmp_path, True, True)
    logger.image_grid("samples_before", torch.rand(4, 1, 16, 16), 2, 0, ["a handwritten digit 3", "a digit 8"])
    logger.trackers[0].close()
    saved = Image.open(tmp_path / "samples_before.png")
    assert saved.mode == "L" and saved.size == ((2 * 17 + 1) * 4, (2 * 17 + 1) * 4)
    (event,) = _events(tmp_path, "rl").Images("eval/samples")  # every evaluation's grid: one series
    assert event.encoded_image_string == (tmp_path / "samples_before.png").read_bytes()
    assert (event.width, event.height) == saved.size
    (text,) = _events(tmp_path, "rl").Tensors("eval/samples/text_summary")  # what each row shows
    assert text.tensor_proto.string_val[0].decode() == "row 1: a handwritten digit 3\nrow 2: a digit 8"


def test_rollout_samples_are_written_with_their_prompts_and_rewards(tmp_path):
    """A one-row JPEG grid and a row per image (prompt, reward, each scorer's score; NaN where one failed), and in
    TensorBoard the grid with a caption per image (prompt | reward (scores))."""
    logger = RunLogger(tmp_path, True, True)
    images = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.9, 0.1], [0.1, 0.1, 0.9]])[:, :, None, None].repeat(1, 1, 40, 24)
    scores = {"ocr": [0.5, float("nan"), 1.0], "pickscore": [0.2, 0.3, 0.4]}
    logger.rollout_samples(7, images, ["a cat", "a dog", "a sign saying hi"], [0.35, float("nan"), 0.7], scores)
    logger.trackers[0].close()
    grid = Image.open(tmp_path / "rollouts" / "epoch0007.jpg")
    assert grid.format == "JPEG" and grid.size == ((3 * 25 + 1) * 3, 42 * 3)  # 40 px: enlarged 3x
    inside = np.asarray(grid, dtype=np.float64)[12:114, 12:66] / 255  # the first image, away from its edges
    assert np.abs(inside - [0.9, 0.1, 0.1]).max() < 0.05  # JPEG: lossy
    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "epoch0007.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a cat", "a dog", "a sign saying hi"]
    assert rows[0] == {"prompt": "a cat", "reward": 0.35, "ocr": 0.5, "pickscore": 0.2}
    assert math.isnan(rows[1]["reward"]) and math.isnan(rows[1]["ocr"])
    events = _events(tmp_path, "rl")
    (image,) = events.Images("rollouts/samples")
    assert image.step == 7 and image.encoded_image_string == (tmp_path / "rollouts" / "epoch0007.jpg").read_bytes()
    (text,) = events.Tensors("rollouts/samples/text_summary")
    assert text.tensor_proto.string_val[0].decode().splitlines() == [
        "1. a cat | reward 0.350 (ocr 0.500, pickscore 0.200)",
        "2. a dog | reward nan (ocr nan, pickscore 0.300)",
        "3. a sign saying hi | reward 0.700 (ocr 1.000, pickscore 0.400)",
    ]


def test_rollout_samples_show_what_each_image_was_conditioned_on(tmp_path):
    """Below the rollouts, a row per image input: the inpainting source with its repaint region tinted, then each
    reference image (several per item: a row each), in the rollouts' own size and channels."""
    outputs = torch.full((2, 3, 24, 24), 0.5)
    ramp = torch.linspace(0, 1, 24)
    source = torch.stack(
        [ramp.view(1, 24).expand(24, 24), ramp.view(24, 1).expand(24, 24), torch.full((24, 24), 0.2)]
    ).repeat(2, 1, 1, 1)  # smooth: JPEG keeps it
    mask = torch.zeros(2, 1, 24, 24)
    mask[:, :, 8:16, 8:16] = 1
    references = torch.rand(2, 2, 3, 48, 48)  # two per item, larger than the outputs
    rows = input_rows(ImageInputs(image=source, mask=mask, reference=references), outputs)
    assert [tuple(r.shape) for r in rows] == [(2, 3, 24, 24)] * 3
    tint = torch.tensor(MASK_TINT).view(1, 3, 1, 1)
    assert torch.equal(rows[0][..., :8, :], source[..., :8, :])  # kept where nothing is repainted
    assert torch.allclose(rows[0][..., 8:16, 8:16], 0.5 * source[..., 8:16, 8:16] + 0.5 * tint)
    for i in (0, 1):  # resized to the outputs' size: the mean colour stays
        assert torch.allclose(rows[1 + i].mean((2, 3)), references[:, i].mean((2, 3)), atol=1e-2)
    grey = input_rows(ImageInputs(reference=references[:, 0]), torch.zeros(2, 1, 24, 24))
    assert [tuple(r.shape) for r in grey] == [(2, 1, 24, 24)] and input_rows(None, outputs) == []

    class Recorder:  # what a tracker is handed (the Tracker protocol)
        def samples(self, name, grid, images, captions, step):
            self.images = images

    recorder = Recorder()
    logger = RunLogger(tmp_path, True, False, [recorder])
    logger.rollout_samples(
        1,
        outputs,
        ["fill it", "fill it"],
        [0.1, 0.2],
        {"ocr": [0.1, 0.2]},
        ImageInputs(image=source, mask=mask, reference=references),
    )
    # each image for the trackers: its inputs, then itself, side by side
    assert [image.shape for image in recorder.images] == [(24, 4 * 24, 3)] * 2
    for i, image in enumerate(recorder.images):
        assert np.array_equal(image[:, :24], to_uint8(rows[0])[i]) and np.array_equal(
            image[:, 72:], to_uint8(outputs)[i]
        )
    grid = np.asarray(Image.open(tmp_path / "rollouts" / "epoch0001.jpg"), dtype=np.float64) / 255
    assert grid.shape == ((4 * 25 + 1) * 4, (2 * 25 + 1) * 4, 3)  # outputs, then 3 input rows; 24 px: 4x
    second_row = grid[4 * 26 : 4 * 50, 4 : 4 * 25].reshape(24, 4, 24, 4, 3).mean((1, 3))
    assert np.abs(second_row - rows[0][0].permute(1, 2, 0).numpy()).mean() < 0.03  # JPEG: lossy


def test_an_evaluation_grid_puts_each_rows_inputs_before_its_samples():
    """3 rows of 2 samples, each row's item with two references: a row is [reference 1, reference 2, sample 1,
    sample 2]; without inputs the samples stay as they are."""
    samples = torch.arange(6.0).view(6, 1, 1, 1).expand(6, 3, 8, 8) / 10
    references = torch.rand(3, 2, 3, 8, 8)
    shown = with_inputs(samples, 3, ImageInputs(reference=references))
    assert shown.shape == (12, 3, 8, 8)
    for r in range(3):
        assert torch.equal(shown[4 * r], references[r, 0]) and torch.equal(shown[4 * r + 1], references[r, 1])
        assert torch.equal(shown[4 * r + 2 : 4 * r + 4], samples[2 * r : 2 * r + 2])
    assert with_inputs(samples, 3, None) is samples


def test_a_breakdown_gives_each_values_mean_and_their_unweighted_mean():
    from trainer.evaluation import breakdown

    metadata = [
        {"tag": "counting"},
        {"tag": "counting"},
        {"tag": "colors"},
        {},
        {"tag": "position"},
        {"tag": "position"},
        {"tag": 3},
    ]
    scores = {
        "geneval": np.array([1.0, 0.0, 1.0, 1.0, np.nan, 0.0, 1.0]),
        "aesthetic": np.array([5.0, 6.0, 4.0, 9.0, np.nan, np.nan, 2.0]),
    }
    got = breakdown("tag", metadata, scores)
    assert got == {
        "by_tag/geneval/3": 1.0,
        "by_tag/geneval/colors": 1.0,
        "by_tag/geneval/counting": 0.5,
        "by_tag/geneval/position": 0.0,
        "by_tag/geneval/mean": (1.0 + 1.0 + 0.5 + 0.0) / 4,
        "by_tag/aesthetic/3": 2.0,
        "by_tag/aesthetic/colors": 4.0,
        "by_tag/aesthetic/counting": 5.5,
        "by_tag/aesthetic/position": got["by_tag/aesthetic/position"],
        "by_tag/aesthetic/mean": got["by_tag/aesthetic/mean"],
    }
    # a category whose every score failed is NaN, and so is the overall score: never a silent 0
    assert math.isnan(got["by_tag/aesthetic/position"]) and math.isnan(got["by_tag/aesthetic/mean"])
    assert breakdown("", metadata, scores) == {} and breakdown("category", metadata, scores) == {}
