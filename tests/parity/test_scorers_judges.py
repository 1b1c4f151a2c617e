"""The VLM judges against the authors' clients: UnifiedReward as Flow-GRPO asks it (``flow_grpo`` task) and as
UnifiedReward's own scripts ask it (``point``, ``acs``), and Flow-GRPO's Qwen2.5-VL aesthetic judge
(``qwenvl``'s ``flow_grpo`` task).

The judges need real weights, so what is compared is what each side sends (question text, system message,
image pixels, request body) and how each reads an answer (random answers through both parsers) into a score.
"""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image
from transcribed import Source, transcribes

from reward_server.scorers.judge import SYSTEM_PROMPT, JudgeAnswer, build_query, read_answer
from reward_server.scorers.qwenvl import chat_request, chat_text
from reward_server.scorers.unifiedreward import PROMPTS, UnifiedRewardScorer, read_rating
from shared.protocol import ErrorCode

FLOW_GRPO_UNIFIEDREWARD = Source(
    "yifan123/flow_grpo",
    "94e23ee5405ab7241fc1f75d30cac8147e2b1f53",
    "flow_grpo/rewards.py",
    "unifiedreward_score_sglang",
)
UNIFIEDREWARD_POINT = Source(
    "CodeGoat24/UnifiedReward",
    "ff6f520247a2d36e2aff7b2ba53a935afd437f66",
    "inference_qwen/image_generation/qwen_point_score_image_generation.py",
    "messages",
)
UNIFIEDREWARD_ACS = Source(
    "CodeGoat24/UnifiedReward",
    "ff6f520247a2d36e2aff7b2ba53a935afd437f66",
    "inference_qwen/UnifiedReward-2.0-inference/point_score_ACS_image_generation.py",
    "problem",
)
UNIFIEDREWARD_READER = Source(
    "CodeGoat24/UnifiedReward",
    "ff6f520247a2d36e2aff7b2ba53a935afd437f66",
    "sglang_llava/sglang_inference.py",
    "unifiedreward_score_sglang._extract_scores",
)
FLOW_GRPO_QWENVL = Source(
    "yifan123/flow_grpo",
    "ac4c86e8cae021841f1fde853d340e0db67690dd",
    "flow_grpo/qwenvl.py",
    "QwenVLScorer.__init__ (task), extract_scores",
)

CAPTIONS = ["a cat", 'a sign that says "OPEN" on a red door', "braces {like} [these]", ""]
_CRITERIA = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes as described in the "
    "caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\n"
)


# ---- transcriptions of the authors' clients -------------------------------------------------------------


def _flow_grpo_question(prompt: str) -> str:
    """yifan123/flow_grpo@94e23ee flow_grpo/rewards.py ``unifiedreward_score_sglang.evaluate_image``'s question."""
    return (
        f"<image>\n{_CRITERIA}Based on the above criteria, assign a score from 1 to 5 after 'Final Score:'.\n"
        f"Your task is provided as follows:\nText Caption: [{prompt}]"
    )


def _flow_grpo_messages(image: Image.Image, prompt: str) -> list[dict]:
    """The same function's chat messages: one user turn, the image (a PNG data URI) then the question; no
    system message. Sent with temperature 0."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": _flow_grpo_question(prompt)},
            ],
        }
    ]


def _flow_grpo_images(images: list[np.ndarray]) -> list[Image.Image]:
    """The same reward's ``_fn``: every image to PIL and resized to 512x512 with PIL's default filter."""
    return [Image.fromarray(image).resize((512, 512)) for image in images]


def _flow_grpo_unifiedreward_scores(texts: list[str]) -> list[float]:
    """The same reward's ``_extract_scores`` and scaling: the first "Final Score:" followed by a digit 1-5
    (decimals allowed), 0.0 when there is none; divided by 5. UnifiedReward's sglang client reads the same."""
    scores = []
    for text in texts:
        match = re.search(r"Final Score:\s*([1-5](?:\.\d+)?)", text)
        scores.append(float(match.group(1)) if match else 0.0)
    return [score / 5.0 for score in scores]


def _unifiedreward_point_question(prompt: str) -> str:
    """CodeGoat24/UnifiedReward@ff6f520 qwen_point_score_image_generation.py's text (UnifiedReward-qwen)."""
    return (
        f"{_CRITERIA}Extract key elements from the provided text caption, evaluate their presence in the "
        "generated image using the format: 'element (type): value' (where value=0 means not generated, and "
        "value=1 means generated), and assign a score from 1 to 5 after 'Final Score:'.\n"
        f"Your task is provided as follows:\nText Caption: [{prompt}]"
    )


def _unifiedreward_acs_question(prompt: str) -> str:
    """CodeGoat24/UnifiedReward@ff6f520 UnifiedReward-2.0-inference/point_score_ACS_image_generation.py."""
    return (
        "You are presented with a generated image and its associated text caption. Your task is to analyze "
        "the image across multiple dimensions in relation to the caption. Specifically:\nProvide overall "
        "assessments for the image along the following axes (each rated from 1 to 5):\n- Alignment Score: How "
        "well the image matches the caption in terms of content.\n- Coherence Score: How logically consistent "
        "the image is (absence of visual glitches, object distortions, etc.).\n- Style Score: How "
        "aesthetically appealing the image looks, regardless of caption accuracy.\n\nOutput your evaluation "
        "using the format below:\n\nAlignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z"
        f"\n\nYour task is provided as follows:\nText Caption: [{prompt}]"
    )


FLOW_GRPO_AESTHETIC_TASK = """
Your role is to evaluate the aesthetic quality score of given images.
1. Bad: Extremely blurry, underexposed with significant noise, indiscernible
subjects, and chaotic composition.
2. Poor: Noticeable blur, poor lighting, washed-out colors, and awkward
composition with cut-off subjects.
3. Fair: In focus with adequate lighting, dull colors, decent composition but
lacks creativity.
4. Good: Sharp, good exposure, vibrant colors, thoughtful composition with
a clear focal point.
5. Excellent: Exceptional clarity, perfect exposure, rich colors, masterful
composition with emotional impact.

Please first provide a detailed analysis of the evaluation process, including the criteria for judging aesthetic \
quality, within the <Thought> tag. Then, give a final score from 1 to 5 within the <Score> tag.
<Thought>
[Analyze the evaluation process in detail here]
</Thought>
<Score>X</Score>
"""
"""yifan123/flow_grpo@ac4c86e flow_grpo/qwenvl.py ``QwenVLScorer.__init__``'s ``self.task`` (one user turn,
image then this text; Qwen's chat template adds its default system message)."""


def _flow_grpo_qwenvl_scores(texts: list[str]) -> list[float]:
    """yifan123/flow_grpo@ac4c86e flow_grpo/qwenvl.py ``extract_scores``: first <Score>digits</Score> / 5, else 0."""
    out = []
    for text in texts:
        match = re.search(r"<Score>(\d+)</Score>", text)
        out.append(float(match.group(1)) / 5 if match else 0)
    return out


# ---- random answers --------------------------------------------------------------------------------------


def _answers(rng: np.random.Generator, label: str, values: list[str], n: int = 2000) -> list[str]:
    """Answers with 0 to 3 ratings in assorted spellings (spacing, decimals, out of range) among other text."""
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.integers(0, 4)):
            parts.append(str(rng.choice(["cat (object): 1\n", "The image is sharp. ", "", "4 out of 5. "])))
            spelling = str(rng.choice([label, label.lower(), label.replace(" ", "")]))
            parts.append(spelling.format(str(rng.choice(values))))
        parts.append(str(rng.choice(["", "\nDone.", " (final)"])))
        texts.append("".join(parts))
    return texts


FINAL_VALUES = ["1", "2", "3", "4", "5", "0", "6", "10", "3.5", "4.25", "5.5", "2.", " 4", "\n3", "x"]


@transcribes("scorer:unifiedreward", "scorer:unifiedreward_api", source=FLOW_GRPO_UNIFIEDREWARD)
def test_flow_grpo_task_reads_as_flow_grpo() -> None:
    """The first rating is read, with Flow-GRPO's pattern; ours is the rating itself (theirs / 5), and an
    answer they score 0 (no rating) or above 1 (a rating such as 5.5) is a PARSE error for us."""
    answers = _answers(np.random.default_rng(0), "Final Score:{}", FINAL_VALUES)
    theirs = _flow_grpo_unifiedreward_scores(answers)
    parsed = 0
    for text, their_score in zip(answers, theirs, strict=True):
        ours = read_rating(text, "flow_grpo")
        if 0.2 <= their_score <= 1.0:
            assert ours.ok and ours.score / 5.0 == their_score, text
            parsed += 1
        else:
            assert ours.error == ErrorCode.PARSE and ours.score is None, text
    assert 600 < parsed < 1900
    assert read_rating("Final Score: 2\nFinal Score: 5", "flow_grpo").score == 2.0  # the first, as theirs
    assert read_rating("Final Score: 10", "flow_grpo").score == 1.0  # their pattern takes the leading 1


@transcribes("scorer:unifiedreward", "scorer:unifiedreward_api", source=FLOW_GRPO_UNIFIEDREWARD)
def test_flow_grpo_task_sends_what_flow_grpo_sends() -> None:
    """Same question, no system message, the image resized to 512x512 as theirs, then (API) a lossless PNG
    in a single user turn before the text, greedy."""
    rng = np.random.default_rng(1)
    images = [
        rng.integers(0, 256, shape, dtype=np.uint8)
        for shape in [(64, 48, 3), (700, 300, 3), (512, 512, 3), (40, 40, 3)]
    ]
    scorer = UnifiedRewardScorer(backend="api", task="flow_grpo")
    for image, caption, theirs in zip(images, CAPTIONS, _flow_grpo_images(images), strict=True):
        query = scorer._query(image, caption)
        assert query.question == _flow_grpo_question(caption) and query.system is None
        np.testing.assert_array_equal(query.images[0], np.asarray(theirs))
        body = chat_request(query, "UnifiedReward-7b-v1.5", "generate", 512)
        (their_turn,) = _flow_grpo_messages(theirs, caption)
        (our_turn,) = body["messages"]
        assert body["temperature"] == 0 and our_turn["role"] == their_turn["role"] == "user"
        assert [part["type"] for part in our_turn["content"]] == [part["type"] for part in their_turn["content"]]
        assert our_turn["content"][1] == their_turn["content"][1]
        pixels = [
            np.asarray(
                Image.open(io.BytesIO(base64.b64decode(turn["content"][0]["image_url"]["url"].split(",", 1)[1])))
            )
            for turn in (our_turn, their_turn)
        ]
        np.testing.assert_array_equal(*pixels)


@transcribes("scorer:unifiedreward", "scorer:unifiedreward_api", source=UNIFIEDREWARD_POINT)
def test_point_prompt_is_unifiedreward_qwens() -> None:
    for caption in CAPTIONS:
        assert PROMPTS["point"].format(prompt=caption) == _unifiedreward_point_question(caption)
        query = UnifiedRewardScorer(task="point")._query(np.zeros((8, 8, 3), np.uint8), caption)
        assert query.question == _unifiedreward_point_question(caption) and query.system == SYSTEM_PROMPT


@transcribes("scorer:unifiedreward", "scorer:unifiedreward_api", source=UNIFIEDREWARD_ACS)
def test_acs_prompt_is_unifiedreward_2s() -> None:
    for caption in CAPTIONS:
        assert PROMPTS["acs"].format(prompt=caption) == _unifiedreward_acs_question(caption)


@transcribes("scorer:unifiedreward", "scorer:unifiedreward_api", source=UNIFIEDREWARD_READER)
def test_point_reads_the_last_rating_where_unifiedrewards_reader_reads_the_first() -> None:
    """UnifiedReward's own reader takes the first "Final Score: [1-5]..."; ``point`` takes the last rating of
    any spelling: equal on answers with one rating in 1..5 (the point prompt asks for one)."""
    answers = _answers(np.random.default_rng(2), "Final Score: {}", FINAL_VALUES)
    same = 0
    for text, theirs in zip(answers, _flow_grpo_unifiedreward_scores(answers), strict=True):
        ours = read_rating(text, "point")
        ratings = re.findall(r"Final Score:\s*([0-9]+(?:\.[0-9]+)?)", text)
        if len(ratings) == 1 and 0.2 <= theirs and 1 <= float(ratings[0]) <= 5:
            assert ours.score / 5.0 == theirs, text
            same += 1
        elif ratings and 1 <= float(ratings[-1]) <= 5:
            assert ours.score == float(ratings[-1]), text
        else:
            assert ours.error == ErrorCode.PARSE, text
    assert same > 300


@transcribes("scorer:qwenvl", "scorer:qwenvl_api", source=FLOW_GRPO_QWENVL)
def test_qwenvl_flow_grpo_task_asks_and_reads_as_flow_grpo() -> None:
    """``judge_task: flow_grpo``: Flow-GRPO's question word for word, Qwen's default system message, and its
    reading (first <Score>digits</Score>, / 5); answers it scores 0 or above 1 are PARSE errors for us."""
    image = np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    query = build_query("flow_grpo", image, "ignored: the aesthetic question has no caption", {}, "generate")
    assert query.question == FLOW_GRPO_AESTHETIC_TASK and query.system == SYSTEM_PROMPT
    assert chat_text(query.question, 1, query.system).startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>")
    assert build_query("flow_grpo", image, "", {}, "probs").error == ErrorCode.BAD_INPUT
    answers = _answers(
        np.random.default_rng(4),
        "<Score>{}</Score>",
        ["1", "2", "3", "4", "5", "0", "6", "10", "3.5", " 4", "04", "x"],
    )
    parsed = 0
    for text, theirs in zip(answers, _flow_grpo_qwenvl_scores(answers), strict=True):
        ours = read_answer(JudgeAnswer(text, None), "generate", 0.5, "flow_grpo")
        if 0.2 <= theirs <= 1.0:
            assert ours.ok and ours.score == theirs, text
            parsed += 1
        else:
            assert ours.error == ErrorCode.PARSE, text
    assert 600 < parsed < 1900


@pytest.mark.parametrize("task", ["aesthetics", "alignment"])
@transcribes("scorer:qwenvl", "scorer:qwenvl_api", source=FLOW_GRPO_QWENVL)
def test_our_generate_readout_keeps_flow_grpos_tag_but_reads_the_last_on_1_to_5(task: str) -> None:
    """Our own tasks' ``generate`` readout: the last <Score>x</Score> (spacing, case and decimals allowed),
    (x - 1) / 4; on an answer with a single integer tag in 1..5 that is (5 * theirs - 1) / 4."""
    answers = _answers(np.random.default_rng(5), "<Score>{}</Score>", ["1", "2", "3", "4", "5", "0", "7"])
    for text, theirs in zip(answers, _flow_grpo_qwenvl_scores(answers), strict=True):
        ours = read_answer(JudgeAnswer(text, None), "generate", 0.5, task)
        if len(re.findall(r"<Score>", text, re.IGNORECASE)) == 1 and 0.2 <= theirs <= 1.0:
            assert ours.score == pytest.approx((5 * theirs - 1) / 4), text
