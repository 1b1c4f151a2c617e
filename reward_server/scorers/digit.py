"""``digit``: the probability that an image shows the digit named in its prompt.

A weight-free learned scorer for the embedded default run: a logistic-regression classifier trained at
start-up (0.2 s) on scikit-learn's bundled 8x8 digits, so nothing is downloaded. It trains on one BLAS thread:
the fitted weights then do not depend on the machine's core count (and threads only slow a fit this small).

Data split (the trainer reimplements this rule, it must not import this module):
``order = np.random.default_rng(0).permutation(1797)``; ``order[:900]`` is the reward split used here,
``order[900:]`` is held out for the trainer's evaluation classifier, so that the policy is evaluated by a
classifier it was not optimised against.

Input convention: grayscale (RGB is averaged), side lengths multiples of 8 (e.g. 16x16), bright = ink
(as in ``load_digits``, where 16 is full ink). Images are block-averaged to 8x8 and scaled to 0..16.
Target: the last standalone digit (``7``) or digit word (``seven``) in the prompt, else
``metadata["digit"]``; no target is a PARSE error, never a score of 0.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from reward_server.scorers.base import ScoreOutcome
from shared.protocol import ErrorCode

NUM_DIGITS_SAMPLES = 1797
REWARD_SPLIT_SIZE = 900
_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_TARGET_PATTERN = re.compile(r"(?<![0-9])([0-9])(?![0-9])|\b(" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def reward_split_indices() -> np.ndarray:
    """Indices into ``load_digits()`` of the reward split (the rest is the trainer's held-out split)."""
    return np.random.default_rng(0).permutation(NUM_DIGITS_SAMPLES)[:REWARD_SPLIT_SIZE]


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


class DigitScorer:
    """Probability of the prompt's digit under a classifier trained on the reward split of load_digits."""

    name = "digit"
    description = "p(prompt's digit | image) from a logistic regression on sklearn digits (reward split)"
    score_range = (0.0, 1.0)

    def __init__(self) -> None:
        self._classifier: LogisticRegression | None = None
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        digits = load_digits()
        indices = reward_split_indices()
        classifier = LogisticRegression(max_iter=5000)
        with threadpool_limits(limits=1, user_api="blas"):
            classifier.fit(digits.data[indices], digits.target[indices])
        assert list(classifier.classes_) == list(range(10))
        weights = np.concatenate([classifier.coef_.ravel(), classifier.intercept_]).round(6)
        self._version = "digits-logreg-v1+" + hashlib.sha256(weights.tobytes()).hexdigest()[:12]
        self._classifier = classifier
        self.score([np.zeros((16, 16, 1), np.uint8)], ["0"], [{}])

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._classifier is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        rows, features, targets = [], [], []
        for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            target = parse_target_digit(prompt, meta)
            if target is None:
                outcomes[i] = ScoreOutcome.failure(
                    ErrorCode.PARSE, f"no digit 0-9 or digit word in prompt {prompt!r} nor metadata['digit']"
                )
                continue
            try:
                features.append(to_digit_features(image))
            except ValueError as exc:
                outcomes[i] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, str(exc))
                continue
            rows.append(i)
            targets.append(target)
        if rows:
            # Row by row: a score must not depend on which items the server batched together (the
            # rounding of a batched matmul can), so that reruns and resumed runs see identical rewards.
            probabilities = [self._classifier.predict_proba(f[None])[0] for f in features]
            for row, target, probs in zip(rows, targets, probabilities, strict=True):
                predicted = int(np.argmax(probs))
                outcomes[row] = ScoreOutcome(
                    score=float(probs[target]),
                    details={
                        "target": target,
                        "predicted": predicted,
                        "predicted_prob": float(probs[predicted]),
                    },
                )
        return outcomes  # type: ignore[return-value]
