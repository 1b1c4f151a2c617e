"""How an image scorer scores a video item: a few frames evenly spaced over the clip (first and last included), each
scored as an image, their scores reduced to one (``mean`` by default, or ``min``), each frame's score in the details.

A video reaches a scorer as uint8 ``[F, H, W, C]`` (an image is ``[H, W, C]``). Scorers that read whole clips
declare ``modality = "video"`` and get them as they are (:func:`reward_server.scorers.base.run_scorer`).
The reduction is a server setting (``--video-frames``, ``--video-reduce``), shown in ``/info``: a reward's definition
belongs to the server, the same on every replica, not to each request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from scoring.frames import FRAMES, frame_indices

REDUCTIONS = ("mean", "min")


@dataclass(frozen=True)
class FrameSampling:
    """``frames`` frames per video scored by an image scorer, reduced by ``reduce``: ``mean`` rewards a clip that is
    good throughout on average, ``min`` one with no bad frame (text legible in every sampled frame)."""

    frames: int = FRAMES
    reduce: str = "mean"

    def __post_init__(self) -> None:
        if self.frames < 1:
            raise ValueError(f"video frames must be >= 1, got {self.frames}")
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"video reduce must be one of {REDUCTIONS}, got {self.reduce!r}")


def is_video(array: np.ndarray) -> bool:
    """Whether a decoded item is a video (uint8 ``[F, H, W, C]``) rather than an image (``[H, W, C]``)."""
    return array.ndim == 4


def expand(
    images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]], sampling: FrameSampling
) -> tuple[list[np.ndarray], list[str], list[dict[str, Any]], list[list[int]]]:
    """Every item as the images an image scorer scores: an image as itself, a video as its sampled frames (with the
    item's prompt and metadata). Returns the flat images, prompts, metadata, and per item its frame indices (empty
    for an image)."""
    flat: list[np.ndarray] = []
    flat_prompts: list[str] = []
    flat_meta: list[dict[str, Any]] = []
    picked: list[list[int]] = []
    for image, prompt, meta in zip(images, prompts, metadata, strict=True):
        indices = frame_indices(len(image), sampling.frames) if is_video(image) else []
        frames = [image[i] for i in indices] if indices else [image]
        flat.extend(frames)
        flat_prompts.extend([prompt] * len(frames))
        flat_meta.extend([meta] * len(frames))
        picked.append(indices)
    return flat, flat_prompts, flat_meta, picked


def reduce_scores(scores: list[float], reduce: str) -> float:
    """One score for a clip from its frames' scores."""
    return float(np.mean(scores)) if reduce == "mean" else float(min(scores))
