"""Which frames of a video an image scorer scores, shared by the reward server (uint8 clips) and the trainer's
in-process scorers (decoded clips with gradient), so that the two score a clip alike: ``FRAMES`` frames evenly
spaced over it, first and last included, their scores averaged (the server's defaults, ``--video-frames``,
``--video-reduce``).
"""

from __future__ import annotations

FRAMES = 8
"""Frames of a clip an image scorer scores by default."""


def frame_indices(num_frames: int, count: int) -> list[int]:
    """``count`` frame indices evenly spaced over ``num_frames`` frames, first and last included (all frames when
    the clip has no more than ``count``)."""
    if num_frames <= count:
        return list(range(num_frames))
    if count == 1:
        return [0]
    return [round(i * (num_frames - 1) / (count - 1)) for i in range(count)]


def score_clips(scorer, clips, prompts: list[str], count: int = FRAMES):
    """Each clip's score [B] by the image scorer ``scorer(images [N, C, H, W], prompts) -> [N]``: the mean of its
    scores on ``count`` evenly spaced frames of the clips [B, F, C, H, W] (differentiable where ``scorer`` is)."""
    index = frame_indices(clips.shape[1], count)
    frames = clips[:, index].flatten(0, 1)
    scores = scorer(frames, [prompt for prompt in prompts for _ in index])
    return scores.view(len(prompts), len(index)).mean(1)
