"""The torch forms of the weight-free scorers (digit, brightness), for the trainer's differentiable rewards. Apart
from their numpy rules (``scoring.digit``, ``scoring.brightness``) so that the CPU reward image, which serves those
rules without torch, never imports torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from scoring.digit import fit_digit_classifier, parse_target_digit


def digit_features(images_BCHW: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] [B, C, H, W] -> [B, 64] features, as ``to_digit_features`` of their uint8 form
    (x 255), differentiably: channel mean, 8x8 block means, scaled to 0..16."""
    batch, _, height, width = images_BCHW.shape
    if height % 8 or width % 8:
        raise ValueError(f"image sides must be multiples of 8 (e.g. 16x16), got {height}x{width}")
    gray = images_BCHW.mean(dim=1)
    blocks = gray.reshape(batch, 8, height // 8, 8, width // 8).mean(dim=(2, 4))
    return (blocks * 16.0).reshape(batch, 64)


class DigitProbability(nn.Module):
    """p(target digit | image) = softmax(W f + b)[target], W and b the fitted classifier's (float64 buffers, so
    the probabilities match sklearn's predict_proba to float64 round-off); frozen, differentiable in the images."""

    name = "digit"

    def __init__(self, classifier=None) -> None:
        super().__init__()
        classifier = classifier if classifier is not None else fit_digit_classifier()
        self.register_buffer("weight", torch.from_numpy(np.asarray(classifier.coef_, dtype=np.float64)))
        self.register_buffer("bias", torch.from_numpy(np.asarray(classifier.intercept_, dtype=np.float64)))

    def targets(self, prompts: list[str], metadata: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """[B] long: each prompt's digit, or a ValueError naming the first prompt that names none."""
        metadata = metadata or [{}] * len(prompts)
        found = [parse_target_digit(p, m) for p, m in zip(prompts, metadata, strict=True)]
        missing = [p for p, d in zip(prompts, found, strict=True) if d is None]
        if missing:
            raise ValueError(f"the digit reward needs a digit 0-9 or digit word in every prompt: {missing[0]!r}")
        return torch.tensor(found, dtype=torch.long, device=self.weight.device)

    def forward(
        self, images_BCHW: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        """[B] float32 probabilities of each prompt's digit."""
        logits = digit_features(images_BCHW.double()) @ self.weight.T + self.bias
        probs = torch.softmax(logits, dim=1)
        return probs.gather(1, self.targets(prompts, metadata)[:, None])[:, 0].float()


class Brightness(nn.Module):
    """[B] mean of images in [0, 1] (differentiable; the served score of their uint8 form to 1/510)."""

    name = "brightness"

    def forward(self, images_BCHW: torch.Tensor, prompts: list[str], metadata: Any = None) -> torch.Tensor:
        return images_BCHW.float().mean(dim=(1, 2, 3))
