"""The ``digit`` reward: p(prompt's digit | image) under a logistic regression fitted on the reward split of
scikit-learn's bundled 8x8 digits. One definition of the split, the fit, the target and the features, used by the
reward server's scorer (numpy, on uint8 images) and by the trainer's differentiable reward (torch, on decoded
images in [0, 1]); both give the same probability to float tolerance on the same pixels (tests/unit/test_scoring.py).

Features: grayscale (channels averaged), block-averaged to 8x8, on load_digits' 0..16 scale. The classifier is
multinomial, so p = softmax(W f + b): differentiable in the pixels as it is.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

NUM_DIGITS_SAMPLES = 1797
REWARD_SPLIT_SIZE = 900
_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TARGET_PATTERN = re.compile(r"(?<![0-9])([0-9])(?![0-9])|\b(" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def reward_split_indices() -> np.ndarray:
    """Indices into ``load_digits()`` of the reward split (the rest is the trainer's held-out split)."""
    return np.random.default_rng(0).permutation(NUM_DIGITS_SAMPLES)[:REWARD_SPLIT_SIZE]


def fit_digit_classifier():
    """The fitted sklearn LogisticRegression on the reward split, on one BLAS thread (its weights then do not
    depend on the machine's core count)."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    digits = load_digits()
    indices = reward_split_indices()
    classifier = LogisticRegression(max_iter=5000)
    with threadpool_limits(limits=1, user_api="blas"):
        classifier.fit(digits.data[indices], digits.target[indices])
    assert list(classifier.classes_) == list(range(10))
    return classifier


def parse_target_digit(prompt: str, metadata: dict[str, Any]) -> int | None:
    """The digit an item asks for: last digit or digit word in ``prompt``, else ``metadata["digit"]``."""
    matches = list(_TARGET_PATTERN.finditer(prompt))
    if matches:
        last = matches[-1]
        return int(last.group(1)) if last.group(1) is not None else _WORDS.index(last.group(2).lower())
    value = metadata.get("digit")
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():  # 7.0 from a JSON client
        value = int(value)
    if isinstance(value, int) and 0 <= value <= 9:
        return value
    if isinstance(value, str) and value.strip() in tuple("0123456789"):
        return int(value.strip())
    return None


def to_digit_features(image: np.ndarray) -> np.ndarray:
    """uint8 ``[H, W, C]`` with H and W multiples of 8 -> 64 features on load_digits' 0..16 scale."""
    gray = image.astype(np.float64).mean(axis=2)
    height, width = gray.shape
    if height % 8 or width % 8:
        raise ValueError(f"image sides must be multiples of 8 (e.g. 16x16), got {height}x{width}")
    blocks = gray.reshape(8, height // 8, 8, width // 8).mean(axis=(1, 3))
    return (blocks * (16.0 / 255.0)).reshape(64)
