"""What the trainer needs from a dataset: the Task protocol and the supervised batch it hands out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trainer.models.base import ImageInputs


@dataclass
class SupervisedBatch:
    """Supervised examples: target images in [0, 1] [B, C, H, W], their prompts, and the image inputs the
    model is conditioned on (inpainting: the masked source and mask; editing: the reference), if any."""

    images: torch.Tensor
    prompts: list[str]
    inputs: ImageInputs | None = None


class Task(Protocol):
    """What the trainer needs from a dataset. Items are addressed by their index in ``prompts`` (the
    pool), because image datasets may repeat a prompt with other images and masks."""

    prompts: list[str]
    """The pool RL epochs draw prompts from."""
    eval_indices: list[int]
    """Pool items of the fixed evaluation (one sample-grid row each)."""
    eval_prompts: list[str]
    """Their prompts."""

    def item_metadata(self, indices: list[int]) -> list[dict]:
        """Per-item metadata of pool items ``indices`` for the reward servers (target text, mask region,
        edit reference, GenEval specs)."""
        ...

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        """Image inputs (inpainting image and mask, edit reference, style) of pool items ``indices``."""
        ...

    def supervised_batch(self, batch_size: int, generator: torch.Generator) -> SupervisedBatch:
        """Target images, prompts and image inputs for supervised training (warm-up, SFT)."""
        ...

    def metrics(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        """Task metrics of generated images (e.g. accuracy by an independent classifier)."""
        ...
