"""``motion``: whether a video's subject moves in the direction its prompt names, steadily (the embedded video task).

The subject is the ink (bright pixels, grey levels averaged over channels) and its path the ink centroid per frame.
Score: ``sigmoid((margin - spread / 4 - SPEED / 2) / SCALE)`` (scoring/motion.py), ``margin`` the mean per-frame step
along the named direction less its size across it (pixels a frame), ``spread`` the steps' mean distance from their
mean. Its optimum is the named motion: one pixel a frame, steady, scores 0.88; a still clip 0.12; the wrong way,
sideways or wobbling less. Direction: the last of left / right / up / down in the prompt, else
``metadata["direction"]``; none is a PARSE error, never a score of 0. An own metric (the embedded task's; the trainer's
``direction_accuracy`` is ``margin > 0``, the same rule: scoring/motion.py). Details: margin, spread, the steps.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from reward_server.scorers.base import ScoreOutcome
from scoring.motion import DIRECTIONS, centroid_paths, direction_margins, motion_scores
from shared.protocol import ErrorCode

_DIRECTION = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)


def parse_direction(prompt: str, metadata: dict[str, Any]) -> str | None:
    """The direction an item asks for: the last direction word of ``prompt``, else ``metadata["direction"]``."""
    found = _DIRECTION.findall(prompt)
    if found:
        return found[-1].lower()
    value = metadata.get("direction")
    return value.strip().lower() if isinstance(value, str) and value.strip().lower() in DIRECTIONS else None


def centroid_path(video: np.ndarray) -> np.ndarray:
    """[F, 2] ink centroid (x, y) per frame of uint8 [F, H, W, C] (grey levels averaged over channels)."""
    return centroid_paths(video.astype(np.float64).mean(axis=3)[None] / 255.0)[0]


class MotionScorer:
    """The centroid's margin along the prompt's direction less a quarter of its wobble and half the speed, squashed."""

    name = "motion"
    description = "the ink centroid moves the prompt's way (left/right/up/down), steadily; the embedded video task's"
    score_range = (0.0, 1.0)
    modality = "video"
    version = "motion-centroid-v2"

    def load(self) -> None:
        self.score([np.zeros((2, 16, 16, 1), np.uint8)], ["moving up"], [{}])

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        return [
            self.outcome(video, prompt, meta) for video, prompt, meta in zip(images, prompts, metadata, strict=True)
        ]

    @staticmethod
    def outcome(video: np.ndarray, prompt: str, metadata: dict[str, Any]) -> ScoreOutcome:
        """One clip's score."""
        direction = parse_direction(prompt, metadata)
        if direction is None:
            return ScoreOutcome.failure(
                ErrorCode.PARSE, f"no direction (left, right, up, down) in prompt {prompt!r} nor metadata['direction']"
            )
        if len(video) < 2:
            return ScoreOutcome.failure(ErrorCode.BAD_INPUT, "motion needs a video of >= 2 frames")
        steps = np.diff(centroid_path(video), axis=0)
        mean = steps.mean(axis=0)
        margin = float(direction_margins(mean[None], [direction])[0])
        spread = float(np.linalg.norm(steps - mean, axis=1).mean())
        score = float(motion_scores(steps[None], [direction])[0])
        details = {"direction": direction, "margin": float(margin), "spread": spread, "steps": steps.round(4).tolist()}
        return ScoreOutcome(score=score, details=details)
