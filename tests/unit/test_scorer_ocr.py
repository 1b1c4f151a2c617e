"""``ocr``: the real RapidOCR PP-OCR models on text rendered with a DejaVu TrueType font.

Thresholds are what these models achieve here with margin; the hard cases (small text, rotation,
clutter) are not required to be perfect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw
from text_images import font, ink_box, render

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.ocr import (
    MIN_BORDER_PX,
    OcrScorer,
    add_border,
    crop_to_mask,
    flow_grpo_similarity,
    levenshtein,
    normalise_text,
    paddle_result_lines,
    target_text,
    text_similarity,
)
from shared.protocol import ErrorCode

PROMPTS = Path(__file__).resolve().parents[2] / "data" / "flow_grpo" / "ocr_test_prompts.txt"


def fitting_font_size(text: str, width: int) -> int:
    return min(40, int(100 * width / font(100).getlength(text)))


@pytest.fixture(scope="module")
def ocr() -> OcrScorer:
    scorer = SCORERS["ocr"]()
    scorer.load()
    return scorer


@pytest.fixture(scope="module")
def real_prompts() -> list[str]:
    return [line for line in PROMPTS.read_text().splitlines() if line.strip()]


def test_ocr_reads_real_prompt_targets_exactly(ocr: OcrScorer, real_prompts: list[str]) -> None:
    prompts = real_prompts[:4]
    targets = [target_text(prompt, {}) for prompt in prompts]
    images = [render(target, font_size=fitting_font_size(target, 460)) for target in targets]
    outcomes = ocr.score(images, prompts, [{}] * len(prompts))
    for outcome, target in zip(outcomes, targets, strict=True):
        assert outcome.ok and outcome.score == pytest.approx(1.0), (target, outcome.details)
        assert normalise_text(outcome.details["recognized"]) == normalise_text(target)
        assert outcome.details["confidence"] > 0.9


def test_ocr_scores_a_wrong_target_lower(ocr: OcrScorer) -> None:
    image = render("Spring Collection 2024")
    right, near, wrong = ocr.score(
        [image] * 3,
        ['a banner "Spring Collection 2024"', 'a banner "Spring Collection 2025"', 'a ring "Forever Yours"'],
        [{}] * 3,
    )
    assert right.score == pytest.approx(1.0)
    assert near.score == pytest.approx(1 - 1 / 20)  # one character of 20 (whitespace removed)
    assert wrong.score < 0.3


def test_ocr_small_text_stays_one_line(ocr: OcrScorer) -> None:
    """Detection with limit type "max" does not upsample a small image and split its words."""
    (outcome,) = ocr.score([render("Spring Collect", size=(256, 64), font_size=24)], ['"Spring Collect"'], [{}])
    assert outcome.score == pytest.approx(1.0)
    assert len(outcome.details["line_confidences"]) == 1


@pytest.mark.parametrize(
    ("case", "threshold"),
    [("small_14px_on_512", 0.9), ("rotated_5_degrees", 0.9), ("cluttered_background", 0.85)],
)
def test_ocr_hard_cases(ocr: OcrScorer, case: str, threshold: float) -> None:
    text = "Step Goal Achieved"
    if case == "small_14px_on_512":
        image = render(text, font_size=14)
    elif case == "rotated_5_degrees":
        image = render(text, font_size=36, angle=5)
    else:
        noise = np.random.default_rng(0).integers(110, 256, (64, 64, 3), dtype=np.uint8)
        background = Image.fromarray(noise).resize((512, 512), Image.Resampling.NEAREST)
        image = render(text, font_size=40, background=background, bold=True)
    (outcome,) = ocr.score([image], [f'a watch showing "{text}"'], [{}])
    assert outcome.ok and outcome.score >= threshold, outcome.details


def test_ocr_mask_restricts_reading_to_its_box(ocr: OcrScorer) -> None:
    image = Image.new("RGB", (512, 256), "white")
    ImageDraw.Draw(image).text((30, 100), "HELLO", font=font(40), fill="black")
    ImageDraw.Draw(image).text((300, 100), "WORLD", font=font(40), fill="black")
    mask = np.zeros((256, 512, 1), np.uint8)
    mask[80:170, 280:500] = 255
    masked, unmasked = ocr.score([np.asarray(image)] * 2, ['"WORLD"'] * 2, [{"mask": mask}, {}])
    assert masked.details["recognized"] == "WORLD" and masked.score == pytest.approx(1.0)
    assert normalise_text(unmasked.details["recognized"]) == "helloworld"
    assert unmasked.score == pytest.approx(0.5)


# Bold text that PP-OCR misses when it touches the edges of the region read (0.0 before the border).
EDGE_CASES = [("Azir", 96), ("OPEN", 96), ("EXIT 24", 80), ("EXIT 24", 96)]


@pytest.mark.parametrize(("text", "font_size"), EDGE_CASES)
def test_ocr_reads_text_touching_every_edge_of_its_mask_and_of_the_image(
    ocr: OcrScorer, text: str, font_size: int
) -> None:
    canvas = render(text, size=(900, 300), font_size=font_size, bold=True)
    top, bottom, left, right = ink_box(canvas)
    tight = np.ascontiguousarray(canvas[top:bottom, left:right])  # the text touches all four image edges
    mask = np.zeros((*canvas.shape[:2], 1), np.uint8)
    mask[top:bottom, left:right] = 255  # ... and all four edges of this mask
    corner = np.full((tight.shape[0] + 100, tight.shape[1] + 100, 3), 255, np.uint8)
    corner[: tight.shape[0], : tight.shape[1]] = tight  # top-left: the mask's edges are the image's
    corner_mask = np.zeros((*corner.shape[:2], 1), np.uint8)
    corner_mask[: tight.shape[0], : tight.shape[1]] = 255
    outcomes = ocr.score([tight, canvas, corner], [f'a sign "{text}"'] * 3, [{}, {"mask": mask}, {"mask": corner_mask}])
    for outcome in outcomes:
        assert outcome.ok and outcome.score >= 0.9, outcome.details


def test_add_border_frames_the_image_in_its_background_colour() -> None:
    image = np.full((5, 7, 3), 200, np.uint8)
    image[1:4, 0:3] = 10  # "text" touching the left edge, a minority of the outer ring
    framed = add_border(image, 2)
    assert framed.shape == (9, 11, 3)
    np.testing.assert_array_equal(framed[2:7, 2:9], image)
    assert (framed[:2] == 200).all() and (framed[:, :2] == 200).all() and (framed[-2:] == 200).all()
    gray = add_border(np.zeros((4, 4, 1), np.uint8), MIN_BORDER_PX)
    assert gray.shape == (4 + 2 * MIN_BORDER_PX, 4 + 2 * MIN_BORDER_PX, 1) and not gray.any()


def test_ocr_reads_a_batch_as_it_reads_each_image(ocr: OcrScorer) -> None:
    """Recognition runs once over the text lines of all images: the same lines as one image at a time."""
    images = [
        render("Spring Collection 2024"),
        np.full((64, 64, 3), 255, np.uint8),
        render("HELLO WORLD", size=(384, 128), font_size=30),
        render("Step Goal Achieved", font_size=24),
    ]
    assert ocr._backend is not None
    batched = ocr._backend.read(images)
    for image, lines in zip(images, batched, strict=True):
        (alone,) = ocr._backend.read([image])
        assert [line.text for line in lines] == [line.text for line in alone]
        assert [line.confidence for line in lines] == pytest.approx([line.confidence for line in alone], abs=0.02)
    assert batched[1] == [] and " ".join(line.text for line in batched[2]) == "HELLO WORLD"


def test_ocr_flow_grpo_scores_with_its_formula(ocr: OcrScorer) -> None:
    flow = SCORERS["ocr_flow_grpo"]()
    flow.load()
    image = render("Spring Collection 2024")
    prompts = ['"Spring Collection 2024"', '"Collection"', '"Spring Collection 2025"']
    ours, theirs = ocr.score([image] * 3, prompts, [{}] * 3), flow.score([image] * 3, prompts, [{}] * 3)
    assert flow.name == "ocr_flow_grpo" and flow.version == ocr.version
    assert [o.score for o in theirs] == pytest.approx([1.0, 1.0, 1 - 1 / 20])  # the target inside: 1
    assert [o.score for o in ours] == pytest.approx([1.0, 1 - 10 / 20, 1 - 1 / 20])  # extra text costs


def test_ocr_failures_are_errors_not_zeros(ocr: OcrScorer) -> None:
    image = render("HELLO", size=(128, 64), font_size=24)
    outcomes = run_scorer(
        ocr,
        [image] * 3,
        ["a sign without quotes", '"HELLO"', '"HELLO"'],
        [{}, {"mask": np.zeros((64, 128, 1), np.uint8)}, {"mask": np.ones((10, 10, 1), np.uint8)}],
    )
    assert [o.error for o in outcomes] == [ErrorCode.PARSE, ErrorCode.BAD_INPUT, ErrorCode.BAD_INPUT]
    assert all(o.score is None for o in outcomes)


def test_ocr_blank_image_scores_zero_and_gray_images_work(ocr: OcrScorer) -> None:
    gray = render("OPEN", size=(128, 64), font_size=30).mean(axis=2, keepdims=True).astype(np.uint8)
    blank, read = ocr.score([np.full((64, 64, 3), 255, np.uint8), gray], ['"OPEN"'] * 2, [{}, {}])
    assert blank.score == 0.0 and blank.details["recognized"] == "" and blank.details["confidence"] is None
    assert read.score == pytest.approx(1.0)


def test_ocr_version_names_engine_models_and_checksum(ocr: OcrScorer) -> None:
    assert ocr.version.startswith("rapidocr-3.") and "PP-OCR" in ocr.version
    assert ocr.name == "ocr" and ocr.score_range == (0.0, 1.0)


def test_target_extraction_on_real_prompts(real_prompts: list[str]) -> None:
    assert len(real_prompts) > 1000
    for prompt in real_prompts:  # Flow-GRPO's rule: the text between the first two double quotes
        assert target_text(prompt, {}) == prompt.split('"')[1]
    assert target_text(real_prompts[0], {}) == "Spring Collection 2024"


@pytest.mark.parametrize(
    ("prompt", "metadata", "expected"),
    [
        ('a sign "OPEN" and "CLOSED"', {}, "OPEN"),
        ('a sign "OPEN"', {"text": "SALE"}, "SALE"),
        ('a sign "OPEN"', {"target_text": "SALE"}, "SALE"),
        ('a sign "OPEN"', {"text": "  "}, "OPEN"),
        ("a sign", {}, None),
        ('a sign ""', {}, None),
        ('a sign "unclosed', {}, None),
        ('a "" sign "OPEN"', {}, "OPEN"),  # the quoted spans are "" and "OPEN", never " sign "
        ('a "  " sign "OPEN" "SALE"', {}, "OPEN"),
        ('a "HOT" 12" pizza', {}, "HOT"),
        ('"A" and "B', {}, "A"),
    ],
)
def test_target_text(prompt: str, metadata: dict[str, Any], expected: str | None) -> None:
    assert target_text(prompt, metadata) == expected


def test_text_similarity_math() -> None:
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    assert normalise_text(" Hello\n World\t") == "helloworld"
    assert text_similarity("Hello World", "hello  world") == 1.0
    assert text_similarity("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert text_similarity("hello extra text", "hello") == pytest.approx(1 - 9 / 14)
    assert text_similarity("", "hello") == 0.0


def test_flow_grpo_similarity_math() -> None:
    """Hand-computed: 1 - min(levenshtein, len(target)) / len(target); 1 when the target is read inside."""
    assert flow_grpo_similarity("Delia", "Azir") == 0.0  # levenshtein("delia", "azir") = 4 = len(target)
    assert text_similarity("Delia", "Azir") == pytest.approx(1 - 4 / 5)  # ours: partial credit
    assert flow_grpo_similarity("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert flow_grpo_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert flow_grpo_similarity("sitting", "kitten") == pytest.approx(1 - 3 / 6)
    assert flow_grpo_similarity("hello extra text", "Hello") == 1.0  # inside: 1, where ours gives 1 - 9/14
    assert flow_grpo_similarity("Sale 50% today", "sale 50 %") == 1.0  # whitespace is removed first
    assert flow_grpo_similarity("xyzxyzxyz", "abc") == 0.0  # levenshtein 9, clipped at len(target) = 3
    assert flow_grpo_similarity("", "hello") == 0.0
    with pytest.raises(ValueError, match="unknown OCR similarity"):
        OcrScorer(similarity="cer")
    with pytest.raises(ValueError, match="unknown OCR reading"):
        OcrScorer(reading="raw")


def test_crop_to_mask_uses_the_bounding_box_of_set_pixels() -> None:
    image = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
    mask = np.zeros((6, 8), np.uint8)
    mask[1, 2] = mask[3, 5] = 1
    np.testing.assert_array_equal(crop_to_mask(image, mask), image[1:4, 2:6])


def test_paddle_result_lines_reads_the_documented_result_fields() -> None:
    """Only the parsing of PaddleOCR 3.x's ``predict`` result; the pipeline itself runs for real in
    tests/integration/test_ocr_paddle.py (under .venv-paddle)."""
    result = {"rec_texts": ["HELLO", " ", "WORLD"], "rec_scores": [0.99, 0.2, 0.97], "rec_polys": []}
    assert [(line.text, line.confidence) for line in paddle_result_lines(result)] == [
        ("HELLO", 0.99),
        ("WORLD", 0.97),
    ]


def test_ocr_paddle_needs_its_model_dirs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model-dir"):
        SCORERS["ocr_paddle"]().load()
    (tmp_path / "ocr_paddle" / "det").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="inference.yml"):
        SCORERS["ocr_paddle"](model_dir=tmp_path).load()
