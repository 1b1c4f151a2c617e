"""``hpsv2``: Human Preference Score v2 / v2.1 (an OpenCLIP ViT-H/14 fine-tuned on human preference pairs).

The score is HPSv2's own readout: the cosine of the L2-normalised image and text embeddings (no logit
scale), typically ~0.2-0.35 for generated images. Preprocessing is HPSv2's validation transform (its
``light_augmentation`` path): pixels to [0, 1], the longer side resized to the model's image size (bicubic,
antialiased, Python-rounded sizes), zero padding centred to a square, then OpenAI CLIP mean/std. Prompts
are cleaned as OpenCLIP's tokenizer does (HTML entities unescaped twice, whitespace runs collapsed, lower case),
tokenised by a CLIP tokenizer and truncated to the context (77 tokens); ``details.truncated`` says when.
Departures: OpenCLIP also runs ``ftfy.fix_text`` (not applied here; it changes only non-ASCII text such as
curly quotes), and float32 instead of fp16 autocast (docs/departures.md, "Scorers").

Expected layout under the server's ``--model-dir``::

    hpsv2/      a transformers CLIPModel with its CLIP tokenizer, converted from the released OpenCLIP
                checkpoint by ``python -m reward_server.scorers.convert_hps --src HPS_v2.1_compressed.pt
                --tokenizer <CLIP tokenizer dir> --out <model_dir>/hpsv2``

Runs in float32, a half-precision checkpoint upcast (the reference uses fp16 autocast on GPU: expect differences
around 1e-3).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.local_model import (
    fingerprint,
    load_strict,
    pick_device,
    require_files,
    tokenize,
    weights_dir,
)

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def hps_pixels(image: np.ndarray, size: int) -> torch.Tensor:
    """HPSv2's validation transform of one uint8 ``[H, W, C]`` image -> float ``[3, size, size]``."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image[:, :, :3]
    pixels = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).float() / 255.0
    height, width = pixels.shape[1:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        new_h, new_w = round(height * scale), round(width * scale)
        pixels = F.interpolate(pixels[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[
            0
        ]
        pad_h, pad_w = size - new_h, size - new_w
        pixels = F.pad(pixels, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    mean = torch.tensor(OPENAI_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_STD).view(3, 1, 1)
    return (pixels - mean) / std


def hps_prompt(prompt: str) -> str:
    """OpenCLIP's prompt cleaning before BPE (``basic_clean``, ``whitespace_clean``, lower case), less ftfy."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(prompt)).strip()).strip().lower()


class HpsScorer:
    """HPS v2.x: cos(image, text) of a CLIPModel read from ``<model_dir>/hpsv2``."""

    name = "hpsv2"
    description = "HPS v2.1 human preference score (OpenCLIP ViT-H/14 fine-tune): cos(image, prompt), ~0.2-0.35"
    score_range = (-1.0, 1.0)

    def __init__(self, model_dir: Path | None = None, device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir``; weights are read from ``<model_dir>/hpsv2``.
        device: torch device; default CUDA when available, else CPU.
        """
        self._root = weights_dir(model_dir, "hpsv2")
        self._device = pick_device(device)
        self._model: Any = None
        self._tokenizer: Any = None
        self._max_tokens = 0
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        from transformers import AutoTokenizer, CLIPModel

        if self._root is None:
            raise ModelFilesMissing(
                "hpsv2 needs --model-dir with hpsv2/ (see python -m reward_server.scorers.convert_hps)"
            )
        require_files(
            self._root,
            ("config.json", "tokenizer_config.json"),
            "convert the HPS checkpoint there with python -m reward_server.scorers.convert_hps --tokenizer ...",
        )
        model = load_strict(CLIPModel, self._root, "CLIPModel", unexpected_ok=False)
        self._model = model.eval().to(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(self._root)
        self._max_tokens = min(self._tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
        self._version = f"hpsv2+clip-{model.config.vision_config.hidden_size}+{fingerprint(self._root)}"
        self.score([np.zeros((64, 48, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._model is not None, "load() must be called before score()"
        size = self._model.config.vision_config.image_size
        pixels_BCHW = torch.stack([hps_pixels(image, size) for image in images]).to(self._device)
        tokens, truncated = tokenize(self._tokenizer, [hps_prompt(p) for p in prompts], self._max_tokens, self._device)
        image_BD = self._model.get_image_features(pixel_values=pixels_BCHW)
        text_BD = self._model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        image_BD, text_BD = (_embeds(x).float() for x in (image_BD, text_BD))
        cosine_B = (F.normalize(image_BD, dim=-1) * F.normalize(text_BD, dim=-1)).sum(-1)
        return [
            ScoreOutcome(score=float(value), details={"truncated": cut})
            for value, cut in zip(cosine_B.tolist(), truncated, strict=True)
        ]


def _embeds(output: Any) -> torch.Tensor:
    """transformers 5 returns a model output from get_*_features; 4.x a tensor."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
