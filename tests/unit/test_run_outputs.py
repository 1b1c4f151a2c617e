"""A run's image outputs: grids keep large images at their size and enlarge small ones, and what the trackers get
is the PNG's own pixels (TensorBoard's events read back)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.logging import RunLogger, save_grid


def _events(run_dir, axis: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard" / axis), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    return events


@pytest.mark.parametrize(("side", "scale"), [(16, 4), (40, 3), (64, 2), (200, 1), (1024, 1)])
def test_a_grid_enlarges_only_small_images(tmp_path, side, scale):
    images = torch.rand(6, 3, side, side if side < 1024 else 8)  # 2 rows of 3; a 1024 x 8 strip: its larger side
    pixels = save_grid(images, 2, tmp_path / "grid.png")
    width = 3 * ((side if side < 1024 else 8) + 1) + 1
    assert pixels.shape == ((2 * (side + 1) + 1) * scale, width * scale, 3)
    saved = np.asarray(Image.open(tmp_path / "grid.png"))
    assert np.array_equal(saved, pixels)
    first = (images[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    assert np.array_equal(pixels[scale: scale * (1 + first.shape[0]): scale, scale: scale * (1 + first.shape[1]): scale],
                          first)


def test_a_grey_grid_is_saved_grey_and_given_to_trackers_as_rgb(tmp_path):
    logger = RunLogger(tmp_path, True, True)
    logger.image_grid("samples_before", torch.rand(4, 1, 16, 16), 2, 0)
    logger.trackers[0].close()
    saved = Image.open(tmp_path / "samples_before.png")
    assert saved.mode == "L" and saved.size == ((2 * 17 + 1) * 4, (2 * 17 + 1) * 4)
    (event,) = _events(tmp_path, "rl").Images("samples_before")
    shown = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)))
    assert shown.shape == (*np.asarray(saved).shape, 3) and all(np.array_equal(shown[..., c], saved) for c in range(3))
