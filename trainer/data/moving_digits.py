"""The embedded video task: a handwritten digit moving in the direction the prompt names, e.g. "a handwritten digit
7 moving right", 10 digits x 4 directions.

Supervised clips are digits of the training split (``DigitImages``) translated one pixel a frame along the named
axis (offsets -2..+2 for 5 frames, zero-filled), so every frame still looks like the dataset's digit to the frame
classifiers. Metrics, computed here from the clip: ``digit_accuracy`` (the held-out SVM of the digits task on every
frame) and ``direction_accuracy`` (the ink centroid's mean step points along the named direction more than across
it: the served ``motion`` scorer's rule, scoring/motion.py).

From warm-up step ``misnamed_from`` on, a share ``misnamed_share`` of the clips is captioned with another direction
than the one it moves in: a warm-up fitted to them follows every named direction in part and alike, which GRPO
then sharpens (bench/RESULTS.md, the embedded video task).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from scoring.motion import DIRECTIONS, centroid_paths, direction_margins
from trainer.data.digits import DigitAccuracy, DigitImages, to_grid8
from trainer.models.base import ImageInputs

TEMPLATE = "a handwritten digit {digit} moving {direction}"
_PROMPT = re.compile(r"digit (\d) moving (left|right|up|down)\b")


def parse_prompt(prompt: str) -> tuple[int, str]:
    """(digit, direction) of a task prompt."""
    found = _PROMPT.search(prompt)
    if found is None:
        raise ValueError(f"not a moving digits prompt: {prompt!r} (expected {TEMPLATE!r})")
    return int(found.group(1)), found.group(2)


def translate(image: torch.Tensor, dx: int, dy: int) -> torch.Tensor:
    """``image`` [..., H, W] moved by (dx, dy) pixels, zero-filled where it leaves the frame."""
    out = torch.zeros_like(image)
    height, width = image.shape[-2:]
    ys, yd = (slice(0, height - dy), slice(dy, height)) if dy >= 0 else (slice(-dy, height), slice(0, height + dy))
    xs, xd = (slice(0, width - dx), slice(dx, width)) if dx >= 0 else (slice(-dx, width), slice(0, width + dx))
    out[..., yd, xd] = image[..., ys, xs]
    return out


def moving_clip(image: torch.Tensor, direction: str, frames: int) -> torch.Tensor:
    """[frames, C, H, W]: ``image`` [C, H, W] moving one pixel a frame along ``direction``, centred on its middle
    frame."""
    ux, uy = (int(u) for u in DIRECTIONS[direction])
    offsets = [f - (frames - 1) // 2 for f in range(frames)]
    return torch.stack([translate(image, ux * o, uy * o) for o in offsets])


def misname(labels: list[int], share: float, classes: int, generator: torch.Generator) -> list[int]:
    """``labels`` with a ``share`` of them (each independently) replaced by one of the other ``classes - 1``
    labels, uniformly."""
    wrong = (torch.rand(len(labels), generator=generator) < share).tolist()
    shift = torch.randint(1, classes, (len(labels),), generator=generator).tolist()
    return [(label + s) % classes if w else label for label, w, s in zip(labels, wrong, shift, strict=True)]


class MovingDigitsTask:
    """Generate a clip of the prompt's digit moving in the prompt's direction (scikit-learn's digits)."""

    metric_names = ("direction_accuracy", "digit_accuracy")
    metric_scorers = ()
    holds_out = False
    supervises = True

    def __init__(self, image_size: int, frames: int = 5, misnamed_share: float = 0.0, misnamed_from: int = 0):
        self.prompts = [TEMPLATE.format(digit=d, direction=m) for d in range(10) for m in DIRECTIONS]
        self.eval_indices = list(range(len(self.prompts)))
        self.eval_prompts = list(self.prompts)
        self.frames = frames
        self.misnamed_share = misnamed_share
        self.misnamed_from = misnamed_from
        self._images = DigitImages(image_size)
        self._accuracy: DigitAccuracy | None = None

    def item_key(self, index: int) -> str:
        return self.prompts[index]

    def item_metadata(self, indices: list[int]) -> list[dict]:
        """The digit (for the ``digit`` scorer) and the direction (for the ``motion`` scorer)."""
        parsed = [parse_prompt(self.prompts[i]) for i in indices]
        return [{"digit": digit, "direction": direction} for digit, direction in parsed]

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0):
        """Clips [B, F, 1, H, W] of random training digits moving in random directions, with their prompts; from
        warm-up ``step`` ``misnamed_from`` on, a ``misnamed_share`` of the prompts names another direction."""
        from trainer.data.task import SupervisedBatch

        names = list(DIRECTIONS)
        idx = torch.randint(len(self._images), (batch_size,), generator=generator).tolist()
        moves = torch.randint(len(names), (batch_size,), generator=generator).tolist()
        clips = [moving_clip(self._images.images[i], names[m], self.frames) for i, m in zip(idx, moves, strict=True)]
        named = moves
        if self.misnamed_share > 0 and step >= self.misnamed_from:
            named = misname(moves, self.misnamed_share, len(names), generator)
        prompts = [
            TEMPLATE.format(digit=int(self._images.labels[i]), direction=names[m])
            for i, m in zip(idx, named, strict=True)
        ]
        return SupervisedBatch(torch.stack(clips), prompts)

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict) -> dict[str, float]:
        """Direction accuracy (centroid rule) and per-frame digit accuracy (held-out SVM) of clips [B, F, 1, H, W]."""
        if self._accuracy is None:
            self._accuracy = DigitAccuracy()
        clips = images.float().mean(2).cpu().numpy()  # [B, F, H, W] ink
        digits, directions = zip(*map(parse_prompt, prompts), strict=True)
        paths = centroid_paths(clips)
        mean_steps = (paths[:, -1] - paths[:, 0]) / max(clips.shape[1] - 1, 1)
        correct = direction_margins(mean_steps, list(directions)) > 0
        predicted = self._accuracy.classifier.predict(to_grid8(clips.reshape(-1, *clips.shape[2:])))
        wanted = np.repeat(np.array(digits), clips.shape[1])
        return {"direction_accuracy": float(correct.mean()), "digit_accuracy": float((predicted == wanted).mean())}
