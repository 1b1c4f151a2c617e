"""``unifiedreward`` and ``unifiedreward_api``: UnifiedReward's pointwise rating of a generated image, 1 to 5.

UnifiedReward (Qwen2.5-VL fine-tunes, also served as LLaVA-OneVision) answers in words and ends with its
rating; the score is that rating, unscaled (1..5; Flow-GRPO divides it by 5, which only rescales weights).
Prompts (``task``), each the text its authors query the model with:
    ``point`` (default): UnifiedReward-qwen's pointwise prompt: list the caption's key elements as
        ``element (type): 0/1``, then ``Final Score: x``.
    ``flow_grpo``: Flow-GRPO's reward (flow_grpo/rewards.py ``unifiedreward_score_sglang``, also
        UnifiedReward's sglang_llava client): the shorter prompt it sends UnifiedReward-7b-v1.5 (LLaVA style,
        ``<image>`` placeholder in the text), no system message, the image resized to 512x512 (PIL
        bicubic) first; its rating is the *first* ``Final Score:`` followed by a digit 1-5 (and decimals).
    ``acs``: UnifiedReward-2.0's Alignment / Coherence / Style scores (``X Score (1-5): v`` each); the
        score is their mean, each one is in ``details``.
``point`` reads the last ``Final Score:`` of the answer. No rating (or one outside 1..5) is a PARSE error,
never 0. Departures from Flow-GRPO (docs/departures.md, Scorers): the rating unscaled (theirs / 5: weight
0.2 gives their numbers) and a PARSE error where they score 0.

Backends: those of :mod:`reward_server.scorers.qwenvl`. ``unifiedreward`` loads ``<model_dir>/unifiedreward/``
(a Qwen2-VL / Qwen2.5-VL ``save_pretrained`` directory) with transformers, options in
``<model_dir>/unifiedreward.json`` (``task``, ``max_new_tokens``: 512); ``unifiedreward_api`` asks an
OpenAI-compatible server (vLLM, SGLang) named in ``<model_dir>/unifiedreward_api.json`` (``base_url``,
``model`` and the other server keys of qwenvl_api). Decoding is greedy in both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.judge import JudgeQuery, rgb
from reward_server.scorers.qwenvl import JudgeBackend, open_backend, read_options
from shared.protocol import ErrorCode

_CRITERIA = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this "
    "image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with the "
    "provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as described "
    "in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including clarity, detail "
    "preservation, color accuracy, and overall aesthetic appeal.\n"
)
_TASK_LINE = "Your task is provided as follows:\nText Caption: [{prompt}]"
PROMPTS: dict[str, str] = {
    "point": _CRITERIA
    + (
        "Extract key elements from the provided text caption, evaluate their presence in the generated image using "
        "the format: 'element (type): value' (where value=0 means not generated, and value=1 means generated), and "
        "assign a score from 1 to 5 after 'Final Score:'.\n"
    )
    + _TASK_LINE,
    "flow_grpo": "<image>\n" + _CRITERIA + "Based on the above criteria, assign a score from 1 to 5 after "
    "'Final Score:'.\n" + _TASK_LINE,
    "acs": (
        "You are presented with a generated image and its associated text caption. Your task is to analyze the image "
        "across multiple dimensions in relation to the caption. Specifically:\nProvide overall assessments for the "
        "image along the following axes (each rated from 1 to 5):\n- Alignment Score: How well the image matches the "
        "caption in terms of content.\n- Coherence Score: How logically consistent the image is (absence of visual "
        "glitches, object distortions, etc.).\n- Style Score: How aesthetically appealing the image looks, regardless "
        "of caption accuracy.\n\nOutput your evaluation using the format below:\n\nAlignment Score (1-5): X\n"
        "Coherence Score (1-5): Y\nStyle Score (1-5): Z\n\n"
    )
    + _TASK_LINE,
}
ACS_AXES = ("Alignment", "Coherence", "Style")
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_FINAL = re.compile(r"Final Score:\s*" + _NUMBER)
_FLOW_GRPO_FINAL = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")  # Flow-GRPO's pattern, first match read
FLOW_GRPO_SIZE = (512, 512)  # Flow-GRPO resizes every image to this before asking
_AXIS = {axis: re.compile(axis + r" Score \(1-5\):\s*" + _NUMBER) for axis in ACS_AXES}


def read_rating(text: str, task: str) -> ScoreOutcome:
    """The rating in an answer to ``PROMPTS[task]``, or a PARSE failure (the answer kept in ``details``)."""
    if task == "acs":
        found = {axis: _AXIS[axis].findall(text)[-1:] for axis in ACS_AXES}
    elif task == "flow_grpo":
        found = {"final": _FLOW_GRPO_FINAL.findall(text)[:1]}
    else:
        found = {"final": _FINAL.findall(text)[-1:]}
    ratings = {axis: float(values[0]) for axis, values in found.items() if values}
    if len(ratings) != len(found) or not all(1.0 <= value <= 5.0 for value in ratings.values()):
        wanted = "'<Axis> Score (1-5): x' for Alignment, Coherence and Style" if task == "acs" else "'Final Score: x'"
        return ScoreOutcome.failure(
            ErrorCode.PARSE, f"no {wanted} with x in 1..5 in the answer {text[-200:]!r}", {"answer": text}
        )
    if task != "acs":
        return ScoreOutcome(score=ratings["final"], details={"answer": text})
    details = {axis.lower(): value for axis, value in ratings.items()}
    return ScoreOutcome(score=sum(ratings.values()) / len(ratings), details={**details, "answer": text})


class UnifiedRewardScorer:
    """UnifiedReward's 1..5 rating of each image for its prompt, read from its generated answer."""

    score_range = (1.0, 5.0)

    def __init__(
        self,
        backend: str = "local",
        model_dir: Path | None = None,
        *,
        task: str = "point",
        max_new_tokens: int = 512,
        device: str | None = None,
    ) -> None:
        """Args:
        backend: ``"local"`` (registry name ``unifiedreward``) or ``"api"`` (``unifiedreward_api``).
        model_dir: the server's ``--model-dir`` (layout in the module docstring).
        task: which of :data:`PROMPTS`; overridden by ``"task"`` in the options file.
        max_new_tokens: the answer's length limit; overridden by the options file.
        device: local backend's torch device (default CUDA when available, else CPU).
        """
        if backend not in ("local", "api"):
            raise ValueError(f"unknown unifiedreward backend {backend!r}; use 'local' or 'api'")
        self.name = "unifiedreward" if backend == "local" else "unifiedreward_api"
        self.description = f"UnifiedReward ({backend}): its 1-5 rating of image quality and prompt alignment"
        self._api = backend == "api"
        self._model_dir = None if model_dir is None else Path(model_dir)
        self.task, self.max_new_tokens, self._device = task, max_new_tokens, device
        self._backend: JudgeBackend | None = None
        self._check_task()

    @property
    def version(self) -> str:
        return "unloaded" if self._backend is None else f"unifiedreward+{self._backend.version}+{self.task}"

    def load(self) -> None:
        if self._model_dir is None:
            raise ModelFilesMissing(f"{self.name} needs --model-dir (see reward_server/scorers/unifiedreward.py)")
        options = read_options(self._model_dir, self.name, api=self._api, keys={"task", "max_new_tokens"})
        self.task = options.get("task", self.task)
        self.max_new_tokens = int(options.get("max_new_tokens", self.max_new_tokens))
        self._check_task()
        self._backend = open_backend(
            self._model_dir / "unifiedreward",
            options,
            api=self._api,
            device=self._device,
            max_new_tokens=self.max_new_tokens,
        )
        self._backend.answer([self._query(np.zeros((28, 28, 3), np.uint8), "")], "generate")

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._backend is not None, "load() must be called before score()"
        queries = [self._query(image, prompt) for image, prompt in zip(images, prompts, strict=True)]
        answers = self._backend.answer(queries, "generate")
        return [
            answer if isinstance(answer, ScoreOutcome) else read_rating(answer.text, self.task) for answer in answers
        ]

    def _query(self, image: np.ndarray, prompt: str) -> JudgeQuery:
        question = PROMPTS[self.task].format(prompt=prompt)
        if self.task != "flow_grpo":
            return JudgeQuery([rgb(image)], question)
        resized = Image.fromarray(rgb(image)).resize(FLOW_GRPO_SIZE, Image.Resampling.BICUBIC)
        return JudgeQuery([np.asarray(resized)], question, system=None)

    def _check_task(self) -> None:
        if self.task not in PROMPTS:
            raise ValueError(f"unknown unifiedreward task {self.task!r}; one of {sorted(PROMPTS)}")
