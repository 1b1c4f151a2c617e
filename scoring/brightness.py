"""The ``brightness`` reward: mean intensity over all pixels and channels, in [0, 1]. The server scores uint8
images with ``brightness_of``; the trainer's differentiable form takes the same mean of decoded images in [0, 1]."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


def brightness_of(image: np.ndarray) -> float:
    """A uint8 image's mean value / 255."""
    return float(image.mean()) / 255.0


class Brightness(nn.Module):
    """[B] mean of images in [0, 1] (differentiable; the served score of their uint8 form to 1/510)."""

    name = "brightness"

    def forward(self, images_BCHW: torch.Tensor, prompts: list[str], metadata: Any = None) -> torch.Tensor:
        return images_BCHW.float().mean(dim=(1, 2, 3))
