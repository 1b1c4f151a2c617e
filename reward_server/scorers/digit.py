"""``digit``: the probability that an image shows the digit named in its prompt.

A weight-free learned scorer for the embedded default run: a logistic-regression classifier trained at
start-up (0.2 s) on scikit-learn's bundled 8x8 digits, so nothing is downloaded. It trains on one BLAS thread:
the fitted weights then do not depend on the machine's core count (and threads only slow a fit this small).

The split, the fit, the target and the features live in ``scoring.digit``, which also gives the trainer's
differentiable form of this reward (refl, draft, drtune). Data split (the trainer's evaluation reimplements it):
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
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from reward_server.scorers.base import ScoreOutcome
from scoring.digit import fit_digit_classifier, parse_target_digit, reward_split_indices, to_digit_features
from shared.protocol import ErrorCode

__all__ = ["DigitScorer", "parse_target_digit", "reward_split_indices", "to_digit_features"]


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
        classifier = fit_digit_classifier()
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
