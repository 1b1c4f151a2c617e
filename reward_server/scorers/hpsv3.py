"""``hpsv3``: HPSv3 (Qwen2-VL-7B fine-tuned with a reward head on human preference pairs), its mean preference mu.

HPSv3 is not a judge that answers: a 3-layer MLP (hidden -> 1024 -> 16 -> 2, ReLU) reads the last hidden state
at a ``<|Reward|>`` token placed after its training instruction, giving (mu, sigma) of a Gaussian preference;
the score is mu (unbounded), sigma is in ``details``. As the reference
(transformers 4.45) runs it: the chat text of Qwen2-VL with the default system turn, the image resized (PIL
bicubic) to about 256 * 28 * 28 pixels keeping its aspect ratio, and *sequential* 1-D positions (the reference
model calls the language model without Qwen2-VL's 3-D M-RoPE positions), counted from each row's first token.
Hidden states run in the backbone's dtype (bfloat16 on CUDA, as the reference), the head in float32. Departures:
none (left padding with positions from each row's first token gives the reference's right-padded positions).

Runs on transformers only (the local backend of :mod:`reward_server.scorers.qwenvl`): an OpenAI-compatible
chat server returns tokens, not the hidden state the head needs. Expected layout under ``--model-dir``::

    hpsv3/      the backbone (a Qwen2-VL save_pretrained directory whose tokenizer has <|Reward|>) and
                reward_head.safetensors, converted from the released HPSv3.safetensors by ``python -m
                reward_server.scorers.convert_hpsv3 --src HPSv3.safetensors --base <Qwen2-VL-7B-Instruct dir>
                --out <model_dir>/hpsv3``
    hpsv3.json  optional: {"image_pixels": 200704} (the reference's 256 * 28 * 28)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from reward_server.scorers.base import ScoreOutcome
from reward_server.scorers.judge import JudgeQuery, rgb
from reward_server.scorers.qwenvl import LocalQwenVL, converted_judge, read_options
from shared.protocol import ErrorCode

REWARD_TOKEN = "<|Reward|>"
IMAGE_PIXELS = 256 * 28 * 28
HEAD_FILE = "reward_head.safetensors"
# HPSv3's training instruction, verbatim (its trailing spaces included): the head was trained on this text.
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""  # noqa: W291 (the trailing spaces are part of the trained prompt)
REWARD_QUESTION = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def question(prompt: str) -> str:
    """The text HPSv3 reads after the image: its instruction with the prompt, then the reward token."""
    return INSTRUCTION.format(text_prompt=prompt) + REWARD_QUESTION


def fixed_area_size(height: int, width: int, pixels: int, factor: int = 28) -> tuple[int, int]:
    """Qwen-VL's smart resize with min = max = ``pixels``: (h, w), multiples of ``factor``, about ``pixels`` in area
    (rounded to the factor, then scaled down with floor or up with ceil when outside), the aspect ratio kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {height}x{width} is over 200")
    h_bar, w_bar = (max(factor, round(side / factor) * factor) for side in (height, width))
    if h_bar * w_bar > pixels:
        beta = math.sqrt(height * width / pixels)
        h_bar, w_bar = (math.floor(side / beta / factor) * factor for side in (height, width))
    elif h_bar * w_bar < pixels:
        beta = math.sqrt(pixels / (height * width))
        h_bar, w_bar = (math.ceil(side * beta / factor) * factor for side in (height, width))
    return h_bar, w_bar


def reward_head(state: dict[str, torch.Tensor]) -> nn.Sequential:
    """HPSv3's "ranknet" head (Linear, ReLU, Dropout, Linear, ReLU, Linear) with sizes read from ``state``."""
    shapes = [state[f"{index}.weight"].shape for index in (0, 3, 5) if f"{index}.weight" in state]
    if len(shapes) != 3 or len(state) != 6:
        raise ValueError(f"not an HPSv3 reward head: expected 0/3/5.weight and .bias, got {sorted(state)[:8]}")
    (first_out, hidden), (mid_out, _), (out, _) = shapes
    head = nn.Sequential(
        nn.Linear(hidden, first_out),
        nn.ReLU(),
        nn.Dropout(0.0),
        nn.Linear(first_out, mid_out),
        nn.ReLU(),
        nn.Linear(mid_out, out),
    )
    head.load_state_dict(state)
    return head.float().eval()


class Hpsv3Scorer:
    """HPSv3's mu for each image and prompt, from ``<model_dir>/hpsv3``."""

    name = "hpsv3"
    description = "HPSv3 human preference (Qwen2-VL-7B + reward head): mean preference mu, unbounded"
    score_range = (None, None)

    def __init__(self, model_dir: Path | None = None, device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir`` (layout in the module docstring).
        device: torch device; default CUDA when available, else CPU.
        """
        self._model_dir = None if model_dir is None else Path(model_dir)
        self._device = device
        self._judge: LocalQwenVL | None = None
        self._head: nn.Sequential | None = None
        self._reward_id = -1
        self.image_pixels = IMAGE_PIXELS

    @property
    def version(self) -> str:
        return "unloaded" if self._judge is None else f"hpsv3+{self._judge.version}"

    def load(self) -> None:
        from safetensors.torch import load_file

        if self._model_dir is not None:  # the options first: a wrong key fails before the model loads
            options = read_options(self._model_dir, "hpsv3", api=False, keys={"image_pixels"})
            self.image_pixels = int(options.get("image_pixels", IMAGE_PIXELS))
        root, judge, (self._reward_id,) = converted_judge(
            "hpsv3", self._model_dir, (HEAD_FILE,), (REWARD_TOKEN,), self._device
        )
        self._head = reward_head(load_file(str(root / HEAD_FILE))).to(judge.model.device)
        self._judge = judge
        self.score([np.zeros((64, 48, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._judge is not None and self._head is not None, "load() must be called before score()"
        outcomes: list[ScoreOutcome | None] = [None] * len(images)
        rows, queries = [], []
        for row, (image, prompt) in enumerate(zip(images, prompts, strict=True)):
            if REWARD_TOKEN in prompt:
                outcomes[row] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, f"the prompt contains {REWARD_TOKEN}")
                continue
            try:
                queries.append(self.query(image, prompt))
            except ValueError as exc:
                outcomes[row] = ScoreOutcome.failure(ErrorCode.BAD_INPUT, str(exc))
                continue
            rows.append(row)
        if queries:
            mu_sigma = self.forward(queries)
            for row, (mu, sigma) in zip(rows, mu_sigma.tolist(), strict=True):
                outcomes[row] = ScoreOutcome(score=mu, details={"sigma": sigma})
        return outcomes  # type: ignore[return-value]

    @torch.no_grad()
    def forward(self, queries: list[JudgeQuery]) -> torch.Tensor:
        """(mu, sigma) ``[B, 2]`` (float32) for a batch of already resized queries."""
        assert self._judge is not None and self._head is not None
        inputs = self._judge.encode(queries, do_resize=False)
        positions = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # sequential from each row's start
        hidden_BLD = self._judge.model.model(**inputs, position_ids=positions).last_hidden_state
        at_reward = inputs["input_ids"] == self._reward_id
        assert bool((at_reward.sum(-1) == 1).all()), "one reward token per row"
        return self._head(hidden_BLD[at_reward].float()).cpu()

    def query(self, image: np.ndarray, prompt: str) -> JudgeQuery:
        """The image resized to about ``image_pixels`` (PIL bicubic, as the reference) and HPSv3's question."""
        image = rgb(image)
        height, width = fixed_area_size(image.shape[0], image.shape[1], self.image_pixels)
        if (height, width) != image.shape[:2]:
            image = np.asarray(Image.fromarray(image).resize((width, height), Image.BICUBIC))
        return JudgeQuery([image], question(prompt))
