"""The embedded task: scikit-learn's bundled 8x8 handwritten digits, upscaled, with digit prompts.

Split rule (shared with the ``digit`` reward scorer, which reimplements it so the services stay
independent): ``np.random.default_rng(0).permutation(1797)``; the first 900 indices are the training /
reward split, the rest are held out for the evaluation classifier. Accuracy is judged by a classifier of
another kind (an RBF SVM) than the reward's, trained only on the held-out split, so a policy that learns
to fool the reward model is not rewarded by the metric.
"""

from __future__ import annotations

import numpy as np
import torch

PROMPT = "a handwritten digit {digit}"
TRAIN_SPLIT = 900


def digit_prompt(digit: int) -> str:
    return PROMPT.format(digit=digit)


def _split(part: str) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    perm = np.random.default_rng(0).permutation(len(data.target))
    idx = perm[:TRAIN_SPLIT] if part == "train" else perm[TRAIN_SPLIT:]
    return data.images[idx] / 16.0, data.target[idx]


def to_grid8(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """[B, 1, H, W] (or [B, H, W]) intensities in [0, 1], H and W multiples of 8 -> [B, 64] block means."""
    x = np.asarray(images, dtype=np.float64).reshape(len(images), images.shape[-2], images.shape[-1])
    f = x.shape[1] // 8
    return x.reshape(len(x), 8, f, 8, f).mean(axis=(2, 4)).reshape(len(x), 64)


class DigitImages:
    """The training split as 1-channel images in [0, 1] of side ``size`` (nearest upscaling), with prompts."""

    def __init__(self, size: int = 16):
        if size % 8:
            raise ValueError(f"digits image size must be a multiple of 8, got {size}")
        images, labels = _split("train")
        f = size // 8
        self.images = torch.from_numpy(np.kron(images, np.ones((f, f)))).float().unsqueeze(1)
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        idx = torch.randint(len(self), (batch_size,), generator=generator)
        return self.images[idx], [digit_prompt(int(d)) for d in self.labels[idx]]


class DigitAccuracy:
    """The task metric: an RBF SVM trained on the held-out split labels generated images."""

    def __init__(self):
        from sklearn.svm import SVC

        images, labels = _split("heldout")
        self.classifier = SVC(gamma="scale", C=10.0).fit(images.reshape(len(images), 64), labels)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> float:
        """Share of images (in [0, 1], [B, 1, H, W]) whose predicted digit is the one their prompt names."""
        predicted = self.classifier.predict(to_grid8(images.cpu().numpy()))
        wanted = np.array([int(p.strip()[-1]) for p in prompts])
        return float((predicted == wanted).mean())
