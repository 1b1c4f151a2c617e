"""Scorers: the digit classifier on real sklearn digits, closed forms, and the shared contract."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures_models import CONFORMANCE_METADATA, CONFORMANCE_SKIP
from PIL import Image
from sklearn.datasets import load_digits
from threadpoolctl import threadpool_limits

from reward_server.scorers import SCORERS, ScoreOutcome, Scorer, build_scorers, run_scorer
from reward_server.scorers.digit import (
    DigitScorer,
    parse_target_digit,
    reward_split_indices,
    to_digit_features,
)
from shared.protocol import ErrorCode


@pytest.fixture(scope="module")
def digit_scorer() -> DigitScorer:
    scorer = DigitScorer()
    scorer.load()
    return scorer


def _held_out_digits(count: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Held-out sklearn digits as 16x16x1 uint8 images (bright = ink), upscaled by np.kron."""
    digits = load_digits()
    held_out = np.random.default_rng(0).permutation(len(digits.target))[900 : 900 + count]
    images = [
        np.round(np.kron(digits.images[i], np.ones((2, 2))) * 255 / 16).astype(np.uint8)[:, :, None] for i in held_out
    ]
    return images, digits.target[held_out]


def test_reward_split_follows_the_documented_rule() -> None:
    indices = reward_split_indices()
    np.testing.assert_array_equal(indices, np.random.default_rng(0).permutation(1797)[:900])
    assert len(set(indices.tolist())) == 900


def test_digit_classifier_is_the_same_whatever_the_blas_threads(digit_scorer: DigitScorer) -> None:
    """The fit runs on one BLAS thread: a process allowed two (or one) gets the same weights, hence the same
    version and rewards. Fitted on two threads, this machine's weights differed beyond the version's 6 decimals."""
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            other = DigitScorer()
            other.load()
        assert other.version == digit_scorer.version


def test_digit_scores_the_named_digit_high_and_others_low(digit_scorer: DigitScorer) -> None:
    images, labels = _held_out_digits(200)
    right = digit_scorer.score(images, [f"a handwritten digit {label}" for label in labels], [{}] * len(images))
    wrong = digit_scorer.score(images, [f"the number {(label + 3) % 10}" for label in labels], [{}] * len(images))
    right_scores = np.array([outcome.score for outcome in right])
    assert right_scores.mean() > 0.85
    assert np.mean([o.details["predicted"] == label for o, label in zip(right, labels, strict=True)]) > 0.9
    assert np.mean([outcome.score for outcome in wrong]) < 0.05
    assert all(0.0 <= outcome.score <= 1.0 for outcome in right + wrong)


def test_digit_accepts_any_multiple_of_8_and_rgb(digit_scorer: DigitScorer) -> None:
    images, labels = _held_out_digits(1)
    small = images[0][::2, ::2]
    large = np.kron(images[0][:, :, 0], np.ones((2, 2), np.uint8))[:, :, None]
    rgb = np.repeat(images[0], 3, axis=2)
    outcomes = digit_scorer.score([images[0], small, large, rgb], [str(labels[0])] * 4, [{}] * 4)
    scores = [outcome.score for outcome in outcomes]
    assert scores[0] == pytest.approx(scores[2]) == pytest.approx(scores[3])
    assert scores[1] > 0.5


def test_digit_features_invert_the_upscaling() -> None:
    digits = load_digits()
    image = np.kron(digits.images[5], np.ones((2, 2)))[:, :, None] * 255 / 16
    features = to_digit_features(np.round(image).astype(np.uint8))
    np.testing.assert_allclose(features, digits.data[5], atol=16 / 255)


@pytest.mark.parametrize(
    ("prompt", "metadata", "expected"),
    [
        ("a handwritten 7", {}, 7),
        ("digit 3, then 5", {}, 5),
        ("a handwritten Seven", {}, 7),
        ("one image of the digit 4", {}, 4),
        ("the digit nine", {"digit": 2}, 9),
        ("a nice picture", {"digit": 2}, 2),
        ("a nice picture", {"digit": "6"}, 6),
        ("10 apples", {}, None),
        ("someone", {}, None),
        ("", {"digit": 11}, None),
        ("", {"digit": True}, None),
    ],
)
def test_parse_target_digit(prompt: str, metadata: dict[str, Any], expected: int | None) -> None:
    assert parse_target_digit(prompt, metadata) == expected


def test_digit_failures_are_errors_not_zeros(digit_scorer: DigitScorer) -> None:
    images, _ = _held_out_digits(1)
    outcomes = digit_scorer.score([images[0], np.zeros((12, 12, 1), np.uint8)], ["no target here", "3"], [{}, {}])
    assert outcomes[0].score is None and outcomes[0].error == ErrorCode.PARSE
    assert outcomes[1].score is None and outcomes[1].error == ErrorCode.BAD_INPUT
    assert "multiples of 8" in outcomes[1].message


def test_brightness_closed_form() -> None:
    scorer = build_scorers(["brightness"], load=True)["brightness"]
    half = np.zeros((4, 4, 3), np.uint8)
    half[:2] = 255
    images = [np.full((8, 8, 1), 51, np.uint8), half, np.zeros((2, 2, 3), np.uint8)]
    assert scorer.score(images, [""] * 3, [{}] * 3) == pytest.approx([0.2, 0.5, 0.0])


def test_jpeg_compressibility_closed_form() -> None:
    scorer = build_scorers(["jpeg_compressibility"], load=True)["jpeg_compressibility"]
    flat = np.full((64, 64, 3), 128, np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    gray = noise[:, :, :1]
    scores = scorer.score([flat, noise, gray], [""] * 3, [{}] * 3)
    for image, score in zip([flat, noise, gray], scores, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image.squeeze(2) if image.shape[2] == 1 else image).save(buffer, format="JPEG", quality=95)
        assert score == pytest.approx(-len(buffer.getvalue()) / 1000)
    assert scores[1] < scores[2] < scores[0] < 0


class _Raising:
    name = "raising"
    score_range = (None, None)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def score(self, images: list, prompts: list, metadata: list) -> list:
        raise self.exc


class _Returning:
    name = "returning"

    def __init__(self, values: list, score_range: tuple = (None, None)) -> None:
        self.values = values
        self.score_range = score_range

    def score(self, images: list, prompts: list, metadata: list) -> list:
        return self.values


@pytest.mark.parametrize(
    ("scorer", "code"),
    [
        (_Raising(RuntimeError("boom")), ErrorCode.INTERNAL),
        (_Raising(MemoryError()), ErrorCode.OOM),
        (_Raising(type("OutOfMemoryError", (RuntimeError,), {})("CUDA")), ErrorCode.OOM),
        (_Returning([0.5]), ErrorCode.INTERNAL),  # one outcome for two images
    ],
)
def test_run_scorer_turns_batch_failures_into_item_errors(scorer: Any, code: ErrorCode) -> None:
    outcomes = run_scorer(scorer, [np.zeros((8, 8, 1), np.uint8)] * 2, ["", ""], [{}, {}])
    assert [outcome.error for outcome in outcomes] == [code, code]
    assert all(outcome.score is None for outcome in outcomes)


def test_run_scorer_rejects_non_finite_and_non_numbers() -> None:
    values = [float("nan"), float("inf"), "high", 0.25, ScoreOutcome.failure(ErrorCode.PARSE, "no")]
    outcomes = run_scorer(_Returning(values), [np.zeros((8, 8, 1), np.uint8)] * 5, [""] * 5, [{}] * 5)
    assert [o.error for o in outcomes] == [ErrorCode.INTERNAL] * 3 + [None, ErrorCode.PARSE]
    assert outcomes[3].score == 0.25 and outcomes[3].ok


def test_run_scorer_turns_a_score_too_large_for_a_float_into_an_item_error() -> None:
    outcomes = run_scorer(_Returning([10**400, 0.5]), [np.zeros((8, 8, 1), np.uint8)] * 2, ["", ""], [{}, {}])
    assert [o.error for o in outcomes] == [ErrorCode.INTERNAL, None]
    assert "non-number" in outcomes[0].message and outcomes[1].score == 0.5


def test_run_scorer_refuses_a_score_outside_the_declared_range_past_round_off() -> None:
    """Such a score was passed on as a reward; within float32 round-off it lands on the range's edge."""
    values = [1.5, -0.2, 1 + 1e-7, -1e-7, 0.75]
    outcomes = run_scorer(_Returning(values, (0.0, 1.0)), [np.zeros((8, 8, 1), np.uint8)] * 5, [""] * 5, [{}] * 5)
    assert [o.error for o in outcomes] == [ErrorCode.INTERNAL] * 2 + [None] * 3
    assert outcomes[0].message == "scorer returned 1.5, outside its declared range [0, 1]"
    assert [o.score for o in outcomes[2:]] == [1.0, 0.0, 0.75]
    below = run_scorer(_Returning([0.5, -3.0], (None, 0.0)), [np.zeros((8, 8, 1), np.uint8)] * 2, ["", ""], [{}, {}])
    assert below[0].message == "scorer returned 0.5, outside its declared range [-inf, 0]" and below[1].score == -3.0


def test_build_scorers_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown scorer.*'nope'.*available"):
        build_scorers(["digit", "nope"])


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_registered_scorer_meets_the_contract(name: str, conformance_model_dir: Path) -> None:
    """Conformance suite run over every registered scorer."""
    if name in CONFORMANCE_SKIP:
        pytest.skip(CONFORMANCE_SKIP[name])
    scorer = SCORERS[name](model_dir=conformance_model_dir)
    assert isinstance(scorer, Scorer)
    assert scorer.name == name and scorer.description
    scorer.load()
    assert scorer.version and scorer.version != "unloaded"
    low, high = scorer.score_range
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (16, 16, channels), dtype=np.uint8) for channels in (1, 3, 1)]
    images.append(rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8))  # a video: sampled frames, or the clip
    if getattr(scorer, "modality", "image") == "video":
        images = [np.stack([image] * 2) for image in images[:3]] + images[3:]
    metadata = [dict(CONFORMANCE_METADATA.get(name, {})) for _ in images]
    outcomes = run_scorer(scorer, images, ["digit 1", "digit 2", "digit 3", "digit 4"], metadata)
    assert len(outcomes) == 4
    for outcome in outcomes:
        assert outcome.ok, outcome.message
        assert (low is None or outcome.score >= low) and (high is None or outcome.score <= high)
