"""The ``brightness`` reward: mean intensity over all pixels and channels, in [0, 1]. The server scores uint8
images with ``brightness_of``; the trainer's differentiable form (``scoring.modules.Brightness``) takes the same
mean of decoded images in [0, 1]."""

from __future__ import annotations

import numpy as np


def brightness_of(image: np.ndarray) -> float:
    """A uint8 image's mean value / 255."""
    return float(image.mean()) / 255.0
