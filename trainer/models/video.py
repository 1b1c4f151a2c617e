"""What the video adapters share: the check of the configured clip size against the VAE's compression and the
transformer's patches."""

from __future__ import annotations

from typing import Any


def check_video_size(config: Any, temporal: int, spatial: int) -> None:
    """ValueErrors naming the nearest valid values for frames that are not ``temporal`` k + 1 and sides that are
    not multiples of ``spatial``; ``model.resolution`` does not apply to a video model."""
    if config.resolution:
        raise ValueError(
            f"model.resolution={config.resolution} does not apply to {config.name}: unset it and set model.height "
            "and model.width"
        )
    if config.frames % temporal != 1 % temporal:
        below = (config.frames - 1) // temporal * temporal + 1
        raise ValueError(
            f"model.frames={config.frames} must be {temporal}k + 1 (the VAE compresses {temporal} frames after the "
            f"first to one): the nearest are {below} and {below + temporal}"
        )
    for side in ("height", "width"):
        value = getattr(config, side)
        if value % spatial:
            below = value // spatial * spatial
            nearest = f"{below} and {below + spatial}" if below else f"{spatial}"
            raise ValueError(f"model.{side}={value} must be a multiple of {spatial}: the nearest are {nearest}")
