"""Flow-GRPO's OCR reward (flow_grpo/ocr.py ``OcrScorer.__call__``) against ``ocr_flow_grpo`` and, with their
documented relation, ``ocr`` and ``ocr_paddle``: target extraction, text normalisation, the distance's
normalisation, and what the engine is handed.

PaddleOCR's models are not here, so the text lines an engine reads are drawn at random and handed to both
sides (after the engine's own confidence filter, 0.5 in PaddleOCR 2.x and RapidOCR alike).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transcribed import Source, transcribes

from reward_server.scorers import SCORERS
from reward_server.scorers.ocr import TextLine, flow_grpo_region, region_to_read, target_text

FLOW_GRPO_OCR = Source(
    "yifan123/flow_grpo", "ac4c86e8cae021841f1fde853d340e0db67690dd", "flow_grpo/ocr.py", "OcrScorer.__call__"
)
PROMPTS = (Path(__file__).resolve().parents[2] / "data/flow_grpo/ocr_test_prompts.txt").read_text().splitlines()


def _edit_distance(a: str, b: str) -> int:
    """``Levenshtein.distance`` (unit-cost insertions, deletions, substitutions), as a full table."""
    table = np.zeros((len(a) + 1, len(b) + 1), int)
    table[:, 0], table[0, :] = np.arange(len(a) + 1), np.arange(len(b) + 1)
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i, j] = min(table[i - 1, j] + 1, table[i, j - 1] + 1, table[i - 1, j - 1] + (a[i - 1] != b[j - 1]))
    return int(table[-1, -1])


def _flow_grpo_reward(lines: list[tuple[str, float]], prompt: str) -> float:
    """yifan123/flow_grpo@ac4c86e flow_grpo/ocr.py ``OcrScorer.__call__`` for one image, from the engine's
    lines: target = the text after the first double quote up to the next; lines with confidence > 0
    joined without separator; spaces removed, lower case; 0 distance when the target is inside; the
    distance clipped at len(target); 1 - distance / len(target) (an empty target divides by zero)."""
    target = prompt.split('"')[1]
    read = "".join(text if confidence > 0 else "" for text, confidence in lines)
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    distance = 0 if target in read else _edit_distance(read, target)
    return 1 - min(distance, len(target)) / len(target)


ALPHABET = list("abcdeXYZ0129 -%!")


def _random_case(rng: np.random.Generator, alphabet: list[str] = ALPHABET) -> tuple[list[tuple[str, float]], str]:
    """A prompt quoting a random target and what an engine might read of it: the target (case and spaces
    changed), the target among other text, an edited target, or unrelated text, in 1 to 3 lines."""
    target = str(rng.choice(list("abcXYZ019"))) + "".join(rng.choice(alphabet, int(rng.integers(1, 12))))
    kind = rng.integers(4)
    if kind == 0:
        read = "".join(c.upper() if rng.random() < 0.3 else c for c in target).replace(" ", "  ")
    elif kind == 1:
        read = "".join(rng.choice(alphabet, 3)) + target + "".join(rng.choice(alphabet, int(rng.integers(0, 6))))
    elif kind == 2:
        chars = list(target)
        for _ in range(rng.integers(1, 4)):
            position = int(rng.integers(0, len(chars) + 1))
            choice = rng.integers(3)
            if choice == 0:
                chars.insert(position, str(rng.choice(alphabet)))
            elif chars and position < len(chars):
                chars[position : position + 1] = [] if choice == 1 else [str(rng.choice(alphabet))]
        read = "".join(chars)
    else:
        read = "".join(rng.choice(alphabet, int(rng.integers(0, 20))))
    cuts = sorted(rng.integers(0, len(read) + 1, int(rng.integers(0, 3))).tolist())
    pieces = [read[a:b] for a, b in zip([0, *cuts], [*cuts, len(read)], strict=True)]
    lines = [(piece, float(rng.uniform(0.5, 1.0))) for piece in pieces if piece.strip()]
    return lines, f'a sign that says "{target}" on a wall'


@transcribes("scorer:ocr_flow_grpo", source=FLOW_GRPO_OCR)
def test_ocr_flow_grpo_scores_as_flow_grpo_on_random_readings() -> None:
    """Non-breaking spaces included: Flow-GRPO removes spaces only, so they count as characters there."""
    scorer = SCORERS["ocr_flow_grpo"]()
    rng = np.random.default_rng(0)
    scores = []
    for _ in range(3000):
        lines, prompt = _random_case(rng, [*ALPHABET, "\u00a0"])
        target = target_text(prompt, {})
        ours = scorer._outcome(target, [TextLine(text, confidence) for text, confidence in lines]).score
        assert ours == _flow_grpo_reward(lines, prompt), (lines, prompt)
        scores.append(ours)
    assert np.mean(np.array(scores) == 1.0) > 0.3 and np.mean(np.array(scores) == 0.0) > 0.05
    assert len(set(scores)) > 30


@transcribes("scorer:ocr_flow_grpo", "scorer:ocr", "scorer:ocr_paddle", source=FLOW_GRPO_OCR)
def test_target_is_flow_grpos_on_its_prompts_and_the_non_empty_span_where_it_crashes() -> None:
    assert len(PROMPTS) > 1000
    for prompt in PROMPTS:
        assert target_text(prompt, {}) == prompt.split('"')[1]
    rng = np.random.default_rng(1)
    for _ in range(500):
        words = ["".join(rng.choice(list("ab 1"), int(rng.integers(1, 6)))) for _ in range(3)]
        if words[1].strip():
            prompt = f'{words[0]}"{words[1]}"{words[2]}'
            assert target_text(prompt, {}) == prompt.split('"')[1]
    # Where the first span is empty Flow-GRPO divides by zero; ours takes the first non-empty span.
    with pytest.raises(ZeroDivisionError):
        _flow_grpo_reward([("OPEN", 0.9)], 'a "" sign "OPEN"')
    assert target_text('a "" sign "OPEN"', {}) == "OPEN"
    assert target_text('a " " sign "OPEN" and "SALE"', {}) == "OPEN"
    assert target_text('a 12" pizza', {}) is None  # Flow-GRPO reads " pizza" past the unpaired quote


@transcribes("scorer:ocr", "scorer:ocr_paddle", source=FLOW_GRPO_OCR)
def test_ocr_equals_flow_grpo_where_nothing_extra_is_read_and_charges_extra_text_elsewhere() -> None:
    """Ours divides by max(len(read), len(target)) and has no "inside" rule: equal to Flow-GRPO's whenever the
    text read is no longer than the target and does not contain it; below it when it contains the target."""
    ocr, paddle = SCORERS["ocr"](), SCORERS["ocr_paddle"]()
    rng = np.random.default_rng(2)
    equal = below = 0
    for _ in range(3000):
        lines, prompt = _random_case(rng)
        target = target_text(prompt, {})
        text_lines = [TextLine(text, confidence) for text, confidence in lines]
        ours, theirs = ocr._outcome(target, text_lines).score, _flow_grpo_reward(lines, prompt)
        assert paddle._outcome(target, text_lines).score == ours
        read = "".join(text for text, _ in lines).replace(" ", "").lower()
        target = target.replace(" ", "").lower()
        if target in read:
            assert ours == 1 - (len(read) - len(target)) / len(read) <= theirs == 1.0
            below += ours < theirs
        elif len(read) <= len(target):
            assert ours == theirs
            equal += 1
        else:
            assert ours == 1 - _edit_distance(read, target) / len(read)
    assert equal > 500 and below > 300


@transcribes("scorer:ocr_flow_grpo", "scorer:ocr", "scorer:ocr_paddle", source=FLOW_GRPO_OCR)
def test_what_the_engine_is_handed() -> None:
    """Flow-GRPO hands PaddleOCR its RGB array where BGR is expected; our backends flip RGB to BGR, so
    ``ocr_flow_grpo``'s region, flipped, must be the image itself. ``ocr`` reads it inside a border."""
    image = np.random.default_rng(3).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    np.testing.assert_array_equal(flow_grpo_region(image, None)[:, :, ::-1], image)
    framed = region_to_read(image, None)
    assert framed.shape == (40 + 32, 70 + 32, 3)
    np.testing.assert_array_equal(framed[16:-16, 16:-16], image)
