"""What the trainer needs from a dataset: the Task protocol and the supervised batch it hands out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
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
    metric_names: tuple[str, ...]
    """The names ``metrics`` returns (the task's own metrics; empty: none), known before any image is made."""
    metric_scorers: tuple[str, ...]
    """Served scorers whose scores ``metrics`` reads: a run must score with them (reward.weights or
    eval.alarm_scorers)."""
    holds_out: bool
    """Whether RL leaves the evaluation's prompts out (files of prompts); False where the prompts are the task's
    classes (digits, words), which RL must all train."""
    supervises: bool
    """Whether ``supervised_batch`` has target images (the supervised warm-up needs them); False for prompts
    alone."""

    def item_key(self, index: int) -> str | tuple:
        """What pool item ``index`` is: its prompt (a tuple with the files of its image inputs where it has them).
        A training and a test split sharing a key share an example."""
        ...

    def item_metadata(self, indices: list[int]) -> list[dict]:
        """Per-item metadata of pool items ``indices`` for the reward servers (target text, mask region,
        edit reference, GenEval specs)."""
        ...

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        """Image inputs (inpainting image and mask, edit reference, style) of pool items ``indices``."""
        ...

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0) -> SupervisedBatch:
        """Target images, prompts and image inputs for supervised training (warm-up, SFT); ``step``: the warm-up
        step the batch is for (read by a task whose examples change during the warm-up)."""
        ...

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict[str, np.ndarray]) -> dict[str, float]:
        """Task metrics of generated images (e.g. accuracy by an independent classifier, or read off
        ``scores``: each served scorer's scores of these images, NaN where one failed)."""
        ...


def training_items(task: Task) -> list[int]:
    """Pool items RL samples: those whose prompt is not an evaluation prompt, so that the evaluation is on
    held-out prompts, where the task holds out and at least as many remain as are evaluated; else every item
    (digits: one prompt per class, whose held-out parts are then the evaluation's noise and the task metric's
    classifier)."""
    if not task.holds_out:
        return list(range(len(task.prompts)))
    evaluated = set(task.eval_prompts)
    rest = [i for i, prompt in enumerate(task.prompts) if prompt not in evaluated]
    return rest if len(rest) >= len(evaluated) else list(range(len(task.prompts)))
