"""``sleep``: a stand-in for a GPU model that holds every batch for a fixed time (benchmarks and tests).

The score is cheap and deterministic, the mean of every 8th pixel in both directions over all channels
divided by 255 (range 0..1), so that results can be checked; the time a batch takes is dominated by
the fixed hold, as a GPU model's would be by its forward pass. ``time.sleep`` releases the GIL, like a
CUDA kernel wait, so the server's event loop keeps running meanwhile.

Not in the scorer registry (that is :mod:`reward_server.scorers`): ``python -m reward_server`` serves it
as ``--scorers sleep`` with ``--sleep-ms MS`` (and ``--sleep-load-s S``, a model load's duration).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class SleepScorer:
    """Holds each batch for ``ms_per_batch`` milliseconds, then scores subsampled mean brightness.

    ``load`` takes ``load_s`` seconds, as loading a model would.
    """

    name = "sleep"
    description = "holds each batch for a fixed time; score: mean of every 8th pixel / 255"
    score_range = (0.0, 1.0)

    def __init__(self, ms_per_batch: float = 0.0, load_s: float = 0.0) -> None:
        if ms_per_batch < 0 or load_s < 0:
            raise ValueError(f"ms_per_batch and load_s must be >= 0, got {ms_per_batch} and {load_s}")
        self.ms_per_batch = ms_per_batch
        self.load_s = load_s

    @property
    def version(self) -> str:
        return f"sleep-v1-{self.ms_per_batch:g}ms"

    def load(self) -> None:
        time.sleep(self.load_s)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        time.sleep(self.ms_per_batch / 1000.0)
        return [subsampled_brightness(image) for image in images]


def subsampled_brightness(image: np.ndarray) -> float:
    """The ``sleep`` scorer's score of one uint8 ``[H, W, C]`` image."""
    return float(image[::8, ::8].mean()) / 255.0
