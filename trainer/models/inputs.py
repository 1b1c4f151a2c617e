"""Checks of the per-item image inputs an adapter is given, with errors that name what it expects."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from trainer.models.base import ImageInputs

VIDEO_SIZE = "model.height x model.width"
"""The config fields that set a video's frame size (what a first frame must have): ``require_image_input``'s
``sized_by`` for video models."""


def as_8bit(image: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3] on the host: the pictures a user hands a pipeline whose image
    encoder preprocesses them itself (Wan's CLIP, HunyuanVideo 1.5's SigLIP)."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def reject_image_inputs(
    model: str, inputs: ImageInputs | None, allowed: Sequence[str] = (), kind: str = "text-to-image"
) -> None:
    """ValueError when ``inputs`` carries a field that ``model`` (a ``kind`` model) does not use."""
    if inputs is None:
        return
    extra = [f.name for f in fields(inputs) if f.name not in allowed and getattr(inputs, f.name) is not None]
    if extra:
        fix = (
            f" (it uses {', '.join(allowed)}): name those in data.image_inputs"
            if allowed
            else f" (it is a {kind} model): train it on a data.name without images, or set model.name to a model "
            "that takes them"
        )
        raise ValueError(f"the {model} adapter takes no ImageInputs.{', .'.join(extra)}{fix}")


def require_image_input(
    model: str,
    inputs: ImageInputs | None,
    name: str,
    batch_size: int,
    channels: int,
    size: tuple[int, int] | None = None,
    multiple_of: int = 1,
    because: str = "",
    sized_by: str = "model.resolution",
) -> torch.Tensor:
    """``inputs.<name>`` checked to be [batch_size, channels, H, W] (H, W = ``size`` if given, else
    multiples of ``multiple_of``), or a ValueError that names the input, what was expected and ``because``;
    ``sized_by``: the config fields that set ``size`` (a video's frame: model.height and model.width)."""
    value = None if inputs is None else getattr(inputs, name)
    what = f"ImageInputs.{name}"
    if value is None:
        raise ValueError(
            f"the {model} adapter needs {what} ([B, {channels}, H, W] in [0, 1])"
            f"{' because ' + because if because else ''}; none was given"
        )
    if value.ndim != 4 or value.shape[0] != batch_size or value.shape[1] != channels:
        raise ValueError(
            f"{what} has shape {tuple(value.shape)}; the {model} adapter expects "
            f"[{batch_size}, {channels}, H, W] (one per prompt)"
        )
    if size is not None and tuple(value.shape[-2:]) != tuple(size):
        raise ValueError(
            f"{what} is {tuple(value.shape[-2:])} pixels; the {model} adapter generates "
            f"{tuple(size)} ({sized_by}): "
            + (
                "set data.image_size to model.resolution"
                if sized_by == "model.resolution"
                else "give it that size (data.image_size: the data's square side), or set those to the data's"
            )
        )
    if value.shape[-2] % multiple_of or value.shape[-1] % multiple_of:
        raise ValueError(f"{what} sides {tuple(value.shape[-2:])} must be multiples of {multiple_of}")
    return value


def require_references(
    model: str, inputs: ImageInputs | None, batch_size: int, size: tuple[int, int], most: int, pipeline: str
) -> torch.Tensor:
    """``inputs.reference`` checked, as [B, N, 3, H, W] (N = 1 for [B, 3, H, W]; 1 to ``most`` per item, the
    number ``pipeline`` takes), each at ``size``; a ValueError naming what is wrong otherwise."""
    value = None if inputs is None else inputs.reference
    if value is None or value.ndim != 5:
        return require_image_input(model, inputs, "reference", batch_size, 3, size)[:, None]
    if not 1 <= value.shape[1] <= most:
        allowed = "one" if most == 1 else f"1 to {most}"
        raise ValueError(
            f"ImageInputs.reference holds {value.shape[1]} images per item; the {model} adapter takes "
            f"{allowed} ({pipeline}): give each row that many"
        )
    return torch.stack(
        [
            require_image_input(model, ImageInputs(reference=value[:, i]), "reference", batch_size, 3, size)
            for i in range(value.shape[1])
        ],
        dim=1,
    )
