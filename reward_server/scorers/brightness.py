"""``brightness``: mean pixel value over all pixels and channels, divided by 255 (range 0..1)."""

from __future__ import annotations

from typing import Any

import numpy as np

from scoring.brightness import brightness_of


class BrightnessScorer:
    """Mean intensity in [0, 1]; a weight-free reward for smoke tests and toy runs."""

    name = "brightness"
    description = "mean pixel value / 255 over all pixels and channels"
    score_range = (0.0, 1.0)
    version = "brightness-v1"

    def load(self) -> None:
        """Nothing to load."""

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [brightness_of(image) for image in images]
