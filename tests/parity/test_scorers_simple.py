"""Parity of the weight-free scorers (``jpeg_compressibility``, ``colorfulness``, ``brightness``, ``digit``) with
short transcriptions of their references, on seeded random images."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from transcribed import Source, transcribes

from reward_server.scorers import SCORERS, run_scorer

DDPO = "kvablack/ddpo-pytorch"
DDPO_COMMIT = "1958463f020112c9a7bc85768d296daacc2e1b4b"
JULIA_IQI = "JuliaImages/ImageQualityIndexes.jl"
JULIA_IQI_COMMIT = "17ee2bbb30913b9b21cf13e17ed8e8fd0872b9c6"


def _smooth_images(seed: int, count: int, size: int = 48) -> torch.Tensor:
    """``[count, 3, size, size]`` floats in [0, 1]: upsampled noise, so that JPEG sizes differ by content."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 6, 6, generator=g)
    fine = torch.rand(count, 3, size, size, generator=g) * torch.linspace(0.0, 0.4, count).view(count, 1, 1, 1)
    up = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    return (0.8 * up + fine).clamp(0, 1)


def _ddpo_jpeg_compressibility(images_NCHW: torch.Tensor) -> np.ndarray:
    """kvablack/ddpo-pytorch@1958463 ``ddpo_pytorch/rewards.py`` ``jpeg_compressibility``: the pipeline's float
    images to uint8 (x 255, round, clamp), each saved by PIL as JPEG at quality 95, minus its size in kB."""
    uint8_NHWC = (images_NCHW * 255).round().clamp(0, 255).to(torch.uint8).numpy().transpose(0, 2, 3, 1)
    sizes = []
    for image in uint8_NHWC:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return -np.array(sizes)


@transcribes(
    "scorer:jpeg_compressibility",
    source=Source(DDPO, DDPO_COMMIT, "ddpo_pytorch/rewards.py", "jpeg_compressibility"),
)
def test_jpeg_compressibility_is_ddpo_on_the_quantised_images() -> None:
    images_NCHW = _smooth_images(0, 4)
    expected = _ddpo_jpeg_compressibility(images_NCHW)
    # The wire carries what DDPO's reward function quantises to: uint8 HWC.
    wire = list((images_NCHW * 255).round().clamp(0, 255).to(torch.uint8).numpy().transpose(0, 2, 3, 1))
    scorer = SCORERS["jpeg_compressibility"]()
    scorer.load()
    outcomes = run_scorer(scorer, wire, [""] * 4, [{}] * 4)
    assert [o.score for o in outcomes] == expected.tolist()
    assert len(set(expected.tolist())) == 4  # the sizes differ: the comparison is not vacuous


def _julia_hasler_susstrunk_m3(image: np.ndarray) -> float:
    """JuliaImages/ImageQualityIndexes.jl@17ee2bb ``src/colorfulness.jl`` ``hasler_and_susstrunk_m3``: R, G, B on
    0..255, rg = R - G, yb = (R + G) / 2 - B; sqrt(std(rg)^2 + std(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2),
    with Julia's ``std`` (corrected: divides by N - 1); a gray image scores 0."""
    if image.shape[2] == 1:
        return 0.0
    red, green, blue = (image[:, :, c].astype(np.float64) for c in range(3))
    rg, yb = red - green, 0.5 * (red + green) - blue
    spread = math.sqrt(rg.std(ddof=1) ** 2 + yb.std(ddof=1) ** 2)
    return spread + 0.3 * math.sqrt(rg.mean() ** 2 + yb.mean() ** 2)


@transcribes(
    "scorer:colorfulness",
    source=Source(JULIA_IQI, JULIA_IQI_COMMIT, "src/colorfulness.jl", "hasler_and_susstrunk_m3"),
)
def test_colorfulness_is_hasler_susstrunk_with_population_deviations() -> None:
    """Departure (docs/departures.md): our deviations are population ones (divide by N), so the spread term is the
    reference's times sqrt((N - 1) / N); the mean term is the same."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(5, 7), (16, 16), (33, 20)]]
    images.append(np.repeat(rng.integers(0, 256, (9, 9, 1), dtype=np.uint8), 3, axis=2))  # R = G = B
    images.append(rng.integers(0, 256, (8, 8, 1), dtype=np.uint8))  # one channel
    scorer = SCORERS["colorfulness"]()
    scorer.load()
    scores = [o.score for o in run_scorer(scorer, images, [""] * 5, [{}] * 5)]
    for image, score in zip(images, scores, strict=True):
        pixels = image.shape[0] * image.shape[1]
        red, green, blue = (image[:, :, c % image.shape[2]].astype(np.float64) for c in range(3))
        rg, yb = red - green, 0.5 * (red + green) - blue
        offset = 0.3 * math.sqrt(rg.mean() ** 2 + yb.mean() ** 2)
        reference = _julia_hasler_susstrunk_m3(image)
        assert score == pytest.approx((reference - offset) * math.sqrt((pixels - 1) / pixels) + offset, rel=1e-12)
    assert scores[3] == scores[4] == 0.0
    assert scores[0] != pytest.approx(_julia_hasler_susstrunk_m3(images[0]), rel=1e-3)  # N = 35: the departure shows


@transcribes("scorer:brightness", own="a toy reward of ours (mean intensity); no paper or reference code defines it")
def test_brightness_is_the_mean_intensity() -> None:
    rng = np.random.default_rng(1)
    images = [
        rng.integers(0, 256, (6, 10, 3), dtype=np.uint8),
        rng.integers(0, 256, (4, 4, 1), dtype=np.uint8),
        np.full((3, 3, 3), 255, np.uint8),
        np.zeros((2, 5, 3), np.uint8),
    ]
    scorer = SCORERS["brightness"]()
    scorer.load()
    scores = [o.score for o in run_scorer(scorer, images, [""] * 4, [{}] * 4)]
    expected = [sum(int(v) for v in image.ravel()) / image.size / 255 for image in images]
    assert scores == pytest.approx(expected, rel=1e-12)
    assert scores[2:] == [1.0, 0.0]


def _digit_reference(image: np.ndarray, target: int) -> float:
    """The documented rule of reward_server/scorers/digit.py, written out: a logistic regression (lbfgs,
    max_iter 5000) fit on ``load_digits()`` rows ``default_rng(0).permutation(1797)[:900]``; the image made gray
    (channel mean), block-averaged to 8x8 and scaled by 16 / 255; the predicted probability of ``target``."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    digits = load_digits()
    rows = np.random.default_rng(0).permutation(1797)[:900]
    with threadpool_limits(limits=1, user_api="blas"):
        classifier = LogisticRegression(max_iter=5000).fit(digits.data[rows], digits.target[rows])
    gray = image.astype(np.float64).mean(axis=2)
    side_h, side_w = gray.shape[0] // 8, gray.shape[1] // 8
    blocks = np.array(
        [
            [gray[i * side_h : (i + 1) * side_h, j * side_w : (j + 1) * side_w].mean() for j in range(8)]
            for i in range(8)
        ]
    )
    return float(classifier.predict_proba((blocks * 16 / 255).reshape(1, 64))[0, target])


@transcribes("scorer:digit", own="our toy learned reward (sklearn's bundled digits); no reference code exists")
def test_digit_is_the_documented_classifier_probability() -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Real digits upsampled to 16x16 (a 7 and a 3), a random image, an RGB image: the prompt names the target.
    seven = np.kron(digits.images[7] * 255 / 16, np.ones((2, 2))).round().astype(np.uint8)[:, :, None]
    three = np.kron(digits.images[3] * 255 / 16, np.ones((3, 3))).round().astype(np.uint8)[:, :, None]
    noise = np.random.default_rng(2).integers(0, 256, (16, 16, 1), dtype=np.uint8)
    color = np.random.default_rng(3).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    images = [seven, three, noise, color]
    prompts = ["a handwritten 7", "the digit three, not 5 but three", "draw 2", "a four"]
    targets = [7, 3, 2, 4]
    scorer = SCORERS["digit"]()
    scorer.load()
    outcomes = run_scorer(scorer, images, prompts, [{}] * 4)
    assert [o.details["target"] for o in outcomes] == targets
    expected = [_digit_reference(image, target) for image, target in zip(images, targets, strict=True)]
    assert [o.score for o in outcomes] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert outcomes[0].score > 0.5 and outcomes[1].score > 0.5  # the classifier reads real digits
