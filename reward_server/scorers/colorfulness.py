"""``colorfulness``: the Hasler-Süsstrunk colorfulness metric, a closed form that needs no weights.

Hasler and Süsstrunk, "Measuring colourfulness in natural images" (SPIE 2003), with R, G, B in 0..255::

    rg = R - G,  yb = (R + G) / 2 - B
    M = sqrt(std(rg)^2 + std(yb)^2) + 0.3 * sqrt(mean(rg)^2 + mean(yb)^2)

Standard deviations are population ones (over all pixels). Gray images (C = 1, or R = G = B) score 0;
the paper's scale reads about 15 as "slightly", 33 "moderately", 59 "quite" and 82 "highly" colourful.
The score is unbounded above in the protocol's sense (an image of half pure red, half pure green scores
293.25), so ``score_range`` leaves the top open. Departures: the reference implementation
(ImageQualityIndexes.jl) takes sample deviations (N - 1), a spread larger by sqrt(N / (N - 1)): 2e-6 at
512x512 (docs/departures.md, "Scorers").
"""

from __future__ import annotations

from typing import Any

import numpy as np


def colorfulness(image: np.ndarray) -> float:
    """Hasler-Süsstrunk M of a uint8 ``[H, W, C]`` image (C = 1 counts as gray: 0)."""
    if image.shape[2] == 1:
        return 0.0
    red, green, blue = (image[:, :, channel].astype(np.float64) for channel in range(3))
    rg = red - green
    yb = 0.5 * (red + green) - blue
    spread = np.sqrt(rg.std() ** 2 + yb.std() ** 2)
    offset = np.sqrt(rg.mean() ** 2 + yb.mean() ** 2)
    return float(spread + 0.3 * offset)


class ColorfulnessScorer:
    """Hasler-Süsstrunk colorfulness M (0 for gray, about 15-110 for natural images)."""

    name = "colorfulness"
    description = "Hasler-Süsstrunk colorfulness M of the RGB image (0 = gray; no weights)"
    score_range = (0.0, None)
    version = "hasler-susstrunk-2003"

    def load(self) -> None:
        """Nothing to load: a closed form."""

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [colorfulness(image) for image in images]
