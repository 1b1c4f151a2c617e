"""What the Qwen-VL judge is asked and how its answer becomes a score, whatever the backend.

One question template per task, chosen per item by ``metadata["judge_task"]`` (default: the scorer's
``task``): ``aesthetics``, ``alignment`` (with the prompt), ``text`` (the target text, taken as the
``ocr`` scorer takes it) and ``edit`` (instruction following: the prompt is the instruction and
``metadata["reference_image"]`` the original, an array or a wire image ``{"format", "data"[, "shape"]}``)
are ours. ``flow_grpo`` is Flow-GRPO's Qwen2.5-VL aesthetic judge (flow_grpo/qwenvl.py ``QwenVLScorer``):
its question word for word (it asks for a <Thought> analysis, then <Score>), read as it reads it: the
first ``<Score>digits</Score>``, score = rating / 5. It needs the ``generate`` readout; Flow-GRPO lets it
write up to 2048 tokens (``max_new_tokens``).

Two readouts for our tasks, both mapped linearly from 1..5 onto the score range [0, 1]:
    ``probs`` (default): the question asks for a single digit; the score is the expected value of the
        first answer token's distribution over "1".."5", renormalised over those five (smooth, where a
        sampled digit would quantise it to five levels). Under ``min_answer_mass`` on them: PARSE error.
    ``generate``: the question asks for a short reasoning and ``<Score>x</Score>``; the last tag is read;
        no tag (or x outside 1..5) is a PARSE error.
Departures from Flow-GRPO (docs/departures.md, Scorers): a ``flow_grpo`` answer without a tag, or with a
rating outside 1..5, is a PARSE error, where Flow-GRPO scores it 0 (or rating / 5).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from reward_server.scorers.base import ScoreOutcome
from reward_server.scorers.ocr import target_text
from shared.imagecodec import DecodeError, decode_image
from shared.protocol import ErrorCode

DIGITS = ("1", "2", "3", "4", "5")
TASKS: dict[str, str] = {
    "aesthetics": (
        "How aesthetically pleasing is this image (composition, lighting, colour, detail)? "
        "Rate it from 1 (very poor) to 5 (excellent)."
    ),
    "alignment": (
        'How well does this image match the description "{prompt}"? '
        "Rate it from 1 (not at all) to 5 (perfectly, in every detail)."
    ),
    "text": (
        'The image should show the text "{text}". How correctly is exactly that text rendered '
        "(spelling, completeness, legibility)? Rate it from 1 (missing or wrong) to 5 (exactly right)."
    ),
    "edit": (
        'The first image is an original and the second an edit of it for the instruction "{prompt}". '
        "How well does the edit follow the instruction while keeping everything else unchanged? "
        "Rate it from 1 (not at all) to 5 (perfectly)."
    ),
}
# Flow-GRPO's question (flow_grpo/qwenvl.py, QwenVLScorer.task), newlines and all; it carries its answer format.
TASKS["flow_grpo"] = (
    "\nYour role is to evaluate the aesthetic quality score of given images.\n"
    "1. Bad: Extremely blurry, underexposed with significant noise, indiscernible\n"
    "subjects, and chaotic composition.\n"
    "2. Poor: Noticeable blur, poor lighting, washed-out colors, and awkward\n"
    "composition with cut-off subjects.\n"
    "3. Fair: In focus with adequate lighting, dull colors, decent composition but\n"
    "lacks creativity.\n"
    "4. Good: Sharp, good exposure, vibrant colors, thoughtful composition with\n"
    "a clear focal point.\n"
    "5. Excellent: Exceptional clarity, perfect exposure, rich colors, masterful\n"
    "composition with emotional impact.\n\n"
    "Please first provide a detailed analysis of the evaluation process, including the criteria for judging "
    "aesthetic quality, within the <Thought> tag. Then, give a final score from 1 to 5 within the <Score> tag.\n"
    "<Thought>\n[Analyze the evaluation process in detail here]\n</Thought>\n<Score>X</Score>\n"
)
OWN_FORMAT_TASKS = {"flow_grpo"}  # questions that state their own answer format (generate readout only)
ANSWER_FORMATS: dict[str, str] = {
    "probs": " Answer with a single digit from 1 to 5.",
    "generate": " Explain briefly, then give your rating as <Score>x</Score> with x from 1 to 5.",
}
SYSTEM_PROMPT = "You are a helpful assistant."
_SCORE_TAG = re.compile(r"<Score>\s*([0-9]+(?:\.[0-9]+)?)\s*</Score>", re.IGNORECASE)
_FLOW_GRPO_TAG = re.compile(r"<Score>(\d+)</Score>")


@dataclass(frozen=True)
class JudgeQuery:
    """What the judge is shown: RGB uint8 images in order, then the question text."""

    images: list[np.ndarray]
    question: str
    system: str | None = SYSTEM_PROMPT
    """The system message; None sends none (an API server's chat template then decides; a local Qwen-VL
    gets Qwen's default, which is :data:`SYSTEM_PROMPT`)."""


@dataclass(frozen=True)
class JudgeAnswer:
    """The judge's answer text and, where known, the log-probabilities of "1".."5" as first token."""

    text: str
    digit_logprobs: dict[int, float] | None


def build_query(
    task: str, image: np.ndarray, prompt: str, metadata: dict[str, Any], readout: str
) -> JudgeQuery | ScoreOutcome:
    """The question for one item, or the failure that prevents asking it."""
    if task not in TASKS:
        return ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"unknown judge_task {task!r}; one of {sorted(TASKS)}")
    if task in OWN_FORMAT_TASKS and readout != "generate":
        return ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"judge_task {task!r} needs the 'generate' readout")
    images = [rgb(image)]
    fields = {"prompt": prompt, "text": ""}
    if task == "text":
        text = target_text(prompt, metadata)
        if text is None:
            return ScoreOutcome.failure(
                ErrorCode.PARSE,
                "no target text: set metadata 'text' or 'target_text', or quote it in the prompt",
            )
        fields["text"] = text
    if task == "edit":
        reference = metadata.get("reference_image")
        if reference is None:
            return ScoreOutcome.failure(ErrorCode.PARSE, "the edit task needs metadata['reference_image']")
        try:
            images.insert(0, rgb(_as_array(reference)))
        except (DecodeError, TypeError, ValueError) as exc:
            return ScoreOutcome.failure(ErrorCode.DECODE, f"reference_image: {exc}")
    if task in OWN_FORMAT_TASKS:
        return JudgeQuery(images, TASKS[task])
    return JudgeQuery(images, TASKS[task].format(**fields) + ANSWER_FORMATS[readout])


def read_flow_grpo(text: str) -> ScoreOutcome:
    """Flow-GRPO's reading of its judge's answer: the first ``<Score>digits</Score>``, score = rating / 5
    (1..5 only; anything else is a PARSE error)."""
    match = _FLOW_GRPO_TAG.search(text)
    if match is None or not 1 <= int(match.group(1)) <= 5:
        return ScoreOutcome.failure(
            ErrorCode.PARSE, f"no <Score>1..5</Score> in the answer {text[:200]!r}", {"answer": text}
        )
    rating = float(match.group(1))
    return ScoreOutcome(score=rating / 5.0, details={"rating": rating, "answer": text})


def read_answer(answer: JudgeAnswer, readout: str, min_answer_mass: float, task: str = "") -> ScoreOutcome:
    """Turn an answer into a score in [0, 1] (1..5 mapped linearly; ``flow_grpo``: :func:`read_flow_grpo`),
    or a PARSE failure."""
    if task in OWN_FORMAT_TASKS:
        return read_flow_grpo(answer.text)
    if readout == "generate":
        matches = _SCORE_TAG.findall(answer.text)
        value = float(matches[-1]) if matches else None
        if value is None or not 1.0 <= value <= 5.0:
            return ScoreOutcome.failure(
                ErrorCode.PARSE,
                f"no <Score>1..5</Score> in the answer {answer.text[:200]!r}",
                {"answer": answer.text},
            )
        return ScoreOutcome(score=(value - 1.0) / 4.0, details={"rating": value, "answer": answer.text})
    if answer.digit_logprobs is None:  # an API server without logprobs: read the one-digit answer
        text = answer.text.strip()
        if text not in DIGITS:
            return ScoreOutcome.failure(ErrorCode.PARSE, f"answer {text[:200]!r} is not a digit 1-5")
        return ScoreOutcome(score=(int(text) - 1) / 4.0, details={"rating": float(text), "readout": "text"})
    probs = {digit: math.exp(logprob) for digit, logprob in answer.digit_logprobs.items()}
    mass = sum(probs.values())
    if mass < min_answer_mass:
        return ScoreOutcome.failure(
            ErrorCode.PARSE,
            f"only {mass:.3f} of the first answer token's probability is on '1'..'5' (< {min_answer_mass}); "
            f"the most likely answer is {answer.text[:50]!r}",
            {"answer_mass": mass, "answer": answer.text},
        )
    expected = sum(digit * p for digit, p in probs.items()) / mass
    return ScoreOutcome(
        score=(expected - 1.0) / 4.0,
        details={
            "rating": expected,
            "answer_mass": mass,
            "probs": {str(digit): probs.get(digit, 0.0) / mass for digit in range(1, 6)},
        },
    )


def rgb(image: np.ndarray) -> np.ndarray:
    if image.ndim != 3 or image.shape[2] not in (1, 3) or image.dtype != np.uint8:
        raise ValueError(f"expected a uint8 [H, W, 1 or 3] image, got {image.dtype} {image.shape}")
    return np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image


def _as_array(reference: Any) -> np.ndarray:
    """A reference image given as an array, or as a wire image ``{"format", "data"[, "shape"]}``."""
    if isinstance(reference, np.ndarray):
        return reference
    if isinstance(reference, dict) and {"format", "data"} <= set(reference):
        return decode_image(reference["format"], reference["data"], reference.get("shape"))
    raise TypeError("expected an array or {'format', 'data'[, 'shape']}")
