"""``pickscore`` and ``clipscore``: prompt-image agreement from a CLIP model (the rewards of Flow-GRPO).

Both compute ``logit_scale * cos(text embedding, image embedding) / divisor`` with a transformers
``CLIPModel``; they differ in weights and divisor, which follow Flow-GRPO's scorers so that its reward
curves and hyper-parameters carry over:

- ``pickscore``: PickScore_v1 (a CLIP ViT-H/14 fine-tuned on Pick-a-Pic human preferences), divisor 26,
  which puts typical scores near 0.8-0.9.
- ``clipscore``: OpenAI CLIP ViT-L/14, divisor 30.

Expected layout under the server's ``--model-dir``::

    pickscore/              a transformers CLIPModel (e.g. a save of yuvalkirstain/PickScore_v1)
    pickscore/processor/    its processor: tokenizer files and preprocessor_config.json (PickScore_v1
                            ships none; it uses laion/CLIP-ViT-H-14-laion2B-s32B-b79K's). May instead lie
                            in pickscore/ itself.
    clipscore/              the same for clipscore (openai/clip-vit-large-patch14 ships its processor).

Prompts longer than the text tower's context (77 tokens) are truncated, as in the reference scorers;
``details.truncated`` says when. Preprocessing is CLIPImageProcessorPil (bicubic resize of the short side,
centre crop, CLIP mean/std), as CLIPProcessor's and so PickScore's and the LAION/OpenAI CLIP models' own.
Departures: Flow-GRPO's clip scorer resizes with torchvision's bilinear tensor resize instead (and rounds the
crop offsets where CLIPProcessor floors them); registry name
``clipscore_flow_grpo`` (the ``clipscore/`` weights, ``preprocess="flow_grpo"``) does the same
(docs/departures.md, "Scorers").
"""

from __future__ import annotations

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

PREPROCESSING = ("clip", "flow_grpo")


def flow_grpo_pixels(image: np.ndarray, processor: Any) -> torch.Tensor:
    """Flow-GRPO's clip scorer transform of one uint8 ``[H, W, C]`` image: on [0, 1] floats, torchvision's
    Resize(shortest edge, bilinear, antialiased), CenterCrop (offsets rounded half to even) and Normalize, with the
    sizes, mean and std of ``processor`` -> float ``[3, crop_h, crop_w]``."""
    rgb = np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image[:, :, :3]
    pixels = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).float() / 255.0
    height, width = pixels.shape[1:]
    size, crop_h, crop_w = processor.size["shortest_edge"], processor.crop_size["height"], processor.crop_size["width"]
    short, long = min(height, width), max(height, width)
    new_h, new_w = (int(size * long / short), size) if width <= height else (size, int(size * long / short))
    if (new_h, new_w) != (height, width):
        pixels = F.interpolate(pixels[None], size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)[
            0
        ]
    top, left = int(round((new_h - crop_h) / 2.0)), int(round((new_w - crop_w) / 2.0))
    pixels = pixels[:, top : top + crop_h, left : left + crop_w]
    mean, std = (
        torch.tensor(values, dtype=torch.float32).view(3, 1, 1)
        for values in (processor.image_mean, processor.image_std)
    )
    return (pixels - mean) / std


def load_clip(scorer: str, root: Path | None, folder: str, files: tuple[str, ...], hint: str) -> tuple[Any, Path]:
    """A transformers CLIPModel from ``root`` (``<model-dir>/<folder>``), checked strictly, and the folder of its
    processor files (``root/processor`` when there, else ``root``): the loading of every CLIP-based scorer."""
    from transformers import CLIPModel

    if root is None:
        raise ModelFilesMissing(f"{scorer} needs --model-dir with a CLIPModel in {folder}/")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} is not a transformers CLIPModel checkpoint (no config.json)")
    processor_dir = root / "processor" if (root / "processor").is_dir() else root
    require_files(processor_dir, files, hint)
    return load_strict(CLIPModel, root, "CLIPModel"), processor_dir


def clip_image_processor(folder: Path) -> Any:
    """CLIP's PIL image processor (the reference's resize and crop, without torchvision's C ops)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(folder)


class ClipScoreScorer:
    """``logit_scale * cos(text, image) / divisor`` of a CLIPModel read from ``<model_dir>/<folder>``."""

    score_range = (None, None)

    def __init__(
        self,
        name: str,
        divisor: float,
        description: str,
        model_dir: Path | None = None,
        device: str | None = None,
        folder: str | None = None,
        preprocess: str = "clip",
    ) -> None:
        """Args:
        name: registry name.
        divisor: what the scaled cosine is divided by (the reference scorer's normalisation).
        description: the one-line ``/info`` description.
        model_dir: the server's ``--model-dir``.
        device: torch device; default CUDA when available, else CPU.
        folder: the folder under ``model_dir`` the weights are read from; default ``name``.
        preprocess: ``"clip"`` (CLIPProcessor's PIL bicubic resize) or ``"flow_grpo"`` (Flow-GRPO's clip
            scorer: :func:`flow_grpo_pixels`).
        """
        if preprocess not in PREPROCESSING:
            raise ValueError(f"preprocess={preprocess!r} is not one of {PREPROCESSING}")
        self.name, self.description, self._divisor, self._preprocess = name, description, divisor, preprocess
        self._folder = folder or name
        self._root = weights_dir(model_dir, self._folder)
        self._device = pick_device(device)
        self._model: Any = None
        self._tokenizer: Any = None
        self._processor: Any = None
        self._max_tokens = 0
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        from transformers import AutoTokenizer

        files = ("preprocessor_config.json", "tokenizer_config.json")
        hint = f"save the model's CLIP processor (tokenizer and image processor) there or in {self._root}/processor"
        model, processor_dir = load_clip(self.name, self._root, self._folder, files, hint)
        self._model = model.eval().to(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(processor_dir)
        self._processor = clip_image_processor(processor_dir)
        self._max_tokens = min(self._tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
        self._version = f"{self.name}+clip-{model.config.vision_config.hidden_size}+{fingerprint(self._root)}"
        self.score([np.zeros((64, 64, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._model is not None, "load() must be called before score()"
        if self._preprocess == "flow_grpo":
            pixels_BCHW = torch.stack([flow_grpo_pixels(image, self._processor) for image in images]).to(self._device)
        else:
            rgb = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
            pixels_BCHW = self._processor(images=rgb, return_tensors="pt")["pixel_values"].to(self._device)
        tokens, truncated = tokenize(self._tokenizer, prompts, self._max_tokens, self._device)
        out = self._model(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], pixel_values=pixels_BCHW
        )
        cosine_B = (out.image_embeds.float() * out.text_embeds.float()).sum(-1)  # both L2-normalised
        scores_B = self._model.logit_scale.exp().float() * cosine_B / self._divisor
        return [
            ScoreOutcome(score=float(score), details={"cosine": float(cosine), "truncated": cut})
            for score, cosine, cut in zip(scores_B.tolist(), cosine_B.tolist(), truncated, strict=True)
        ]
