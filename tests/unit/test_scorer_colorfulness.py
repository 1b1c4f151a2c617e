"""``colorfulness``: the Hasler-Süsstrunk closed form on constructed images with hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.colorfulness import colorfulness


def _halves(left: tuple[int, int, int], right: tuple[int, int, int]) -> np.ndarray:
    image = np.zeros((4, 8, 3), np.uint8)
    image[:, :4] = left
    image[:, 4:] = right
    return image


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (np.full((5, 5, 3), 128, np.uint8), 0.0),  # gray
        (np.random.default_rng(0).integers(0, 256, (6, 6, 1), dtype=np.uint8), 0.0),  # one channel
        (_halves((0, 0, 0), (255, 255, 255)), 0.0),  # black and white: no chroma
        (np.full((3, 3, 3), (255, 0, 0), np.uint8), 0.3 * math.hypot(255, 127.5)),  # rg 255, yb 127.5
        (np.full((3, 3, 3), (0, 0, 255), np.uint8), 0.3 * 255),  # rg 0, yb -255
        # rg is +-255 (mean 0, std 255), yb is 127.5 everywhere (mean 127.5, std 0)
        (_halves((255, 0, 0), (0, 255, 0)), 255 + 0.3 * 127.5),
    ],
)
def test_colorfulness_known_values(image: np.ndarray, expected: float) -> None:
    assert colorfulness(image) == pytest.approx(expected)


def test_colorfulness_matches_the_formula_on_random_pixels() -> None:
    image = np.random.default_rng(1).integers(0, 256, (7, 9, 3), dtype=np.uint8)
    r, g, b = (image[:, :, i].astype(float).ravel() for i in range(3))
    rg, yb = r - g, (r + g) / 2 - b
    expected = math.sqrt(np.var(rg) + np.var(yb)) + 0.3 * math.sqrt(rg.mean() ** 2 + yb.mean() ** 2)
    assert colorfulness(image) == pytest.approx(expected)


def test_colorfulness_orders_images_and_serves_through_the_registry() -> None:
    scorer = SCORERS["colorfulness"]()
    scorer.load()
    gray = np.full((8, 8, 3), 90, np.uint8)
    pastel = np.full((8, 8, 3), (200, 180, 170), np.uint8)
    vivid = _halves((255, 0, 0), (0, 0, 255))
    outcomes = run_scorer(scorer, [gray, pastel, vivid], [""] * 3, [{}] * 3)
    scores = [outcome.score for outcome in outcomes]
    assert scores[0] == 0.0 < scores[1] < scores[2]
    assert scorer.version and scorer.score_range == (0.0, None)
