"""Tasks and datasets, registered by name: where prompts, supervised examples and task metrics come from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from trainer.data.digits import DigitAccuracy, DigitImages, digit_prompt
from trainer.data.prompt_file import PromptFileTask
from trainer.models.base import ImageInputs


@dataclass
class SupervisedBatch:
    """Supervised examples: target images in [0, 1] [B, C, H, W], their prompts, and the image inputs the
    model is conditioned on (inpainting: the masked source and mask; editing: the reference), if any."""

    images: torch.Tensor
    prompts: list[str]
    inputs: ImageInputs | None = None


class Task(Protocol):
    """What the trainer needs from a dataset."""

    prompts: list[str]
    """The pool RL epochs draw prompts from."""
    eval_prompts: list[str]
    """Evaluation prompts; sample grids show one row per prompt."""

    def metadata(self, prompt: str) -> dict:
        """Per-item metadata sent with the prompt to the reward servers."""
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


class DigitsTask:
    """Generate the handwritten digit named in the prompt (scikit-learn's digits)."""

    def __init__(self, image_size: int):
        self.prompts = [digit_prompt(d) for d in range(10)]
        self.eval_prompts = list(self.prompts)
        self._images = DigitImages(image_size)
        self._accuracy: DigitAccuracy | None = None

    def metadata(self, prompt: str) -> dict:
        return {"digit": int(prompt.strip()[-1])}

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator) -> SupervisedBatch:
        images, prompts = self._images.batch(batch_size, generator)
        return SupervisedBatch(images, prompts)

    def metrics(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        if self._accuracy is None:
            self._accuracy = DigitAccuracy()
        return {"digit_accuracy": self._accuracy(images, prompts)}


DATASETS = {
    "digits": lambda config: DigitsTask(config.image_size),
    "prompt_file": lambda config: PromptFileTask(config.path),
}


def build_task(config) -> Task:
    """The task ``config.name`` (a DataConfig) names."""
    if config.name not in DATASETS:
        raise ValueError(f"data.name={config.name!r} is not registered; choose one of: {', '.join(sorted(DATASETS))}")
    return DATASETS[config.name](config)
