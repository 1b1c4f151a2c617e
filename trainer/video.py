"""Video in the trainer's outputs and reward requests: a batch whose ``images.ndim == 5`` is ``[B, F, C, H, W]`` videos
(frames first per item, as a video adapter's ``decode`` returns them). Written as animated GIFs (previews the
trackers show: TensorBoard's image tab plays them, W&B logs them as videos) and lossless animated PNGs (APNG)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared.imagecodec import DEFAULT_FPS
from trainer.trackers import Picture, gif_bytes, pil_image


def is_video(images: Any) -> bool:
    """Whether a batch (tensor or array) holds videos: ``[B, F, C, H, W]`` (or uint8 ``[B, F, H, W, C]``)."""
    return images.ndim == 5


def adapter_fps(adapter: Any) -> int:
    """A video adapter's frame rate (its ``fps``), 16 where it has none."""
    return int(getattr(adapter, "fps", None) or DEFAULT_FPS)


def with_fps(metadata: Sequence[dict[str, Any]], images: Any, fps: float) -> list[dict[str, Any]]:
    """Reward metadata with each video item's ``fps`` (the reward client sends it with the frames); images' as is."""
    if not is_video(images):
        return list(metadata)
    return [{"fps": fps, **meta} for meta in metadata]


def save_video(frames: np.ndarray, path: str | os.PathLike, fps: float) -> Picture:
    """Save uint8 ``[F, H, W, C]`` as an animated GIF (``.gif``) or a lossless animated PNG (APNG, ``.png``, every
    frame's exact pixels, zlib level 1); the Picture records its frames and fps."""
    count, height, width, channels = frames.shape
    if str(path).endswith(".gif"):
        Path(path).write_bytes(gif_bytes(frames, fps))
    else:
        images = [pil_image(frame) for frame in frames]
        images[0].save(
            path,
            format="PNG",
            save_all=True,
            append_images=images[1:],
            duration=1000 / fps,
            loop=0,
            compress_level=1,
        )
    return Picture(Path(path), height, width, channels, frames=count, fps=fps)
