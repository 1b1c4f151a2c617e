"""``aesthetic``: the LAION "improved aesthetic predictor" (the aesthetic reward of DDPO and Flow-GRPO).

A CLIP ViT-L/14 image embedding, L2-normalised, goes through a small MLP trained on human ratings
(SAC + LOGOS + AVA, 1..10 scale; the score is unbounded in principle, typically 3..8 for generated
images). The MLP is LAION's ``Linear(768, 1024) - Dropout - Linear(1024, 128) - Dropout - Linear(128, 64) -
Dropout - Linear(64, 16) - Linear(16, 1)``: no activations, as in the original (dropout is off at
inference), so its checkpoint's keys are ``layers.{0,2,4,6,7}.{weight,bias}``.

Expected layout under the server's ``--model-dir``::

    aesthetic/clip/         a transformers CLIP checkpoint: the full CLIPModel (e.g. a save of
                            openai/clip-vit-large-patch14) or a CLIPVisionModelWithProjection, with its
                            preprocessor_config.json (OpenAI CLIP preprocessing if absent)
    aesthetic/head.pth      LAION's sac+logos+ava1-l14-linearMSE.pth as released (a state dict),
      or head.safetensors   the same tensors; keys with or without the ``layers.`` prefix

Preprocessing is CLIPImageProcessorPil (PIL and numpy: bicubic resize of the short side, centre crop,
CLIP mean/std), the same steps as the ``clip`` package's preprocess that LAION used, and the CLIPProcessor of
DDPO's and Flow-GRPO's scorers. The model, its loading and the score of preprocessed pixels live in
``scoring.aesthetic``, whose differentiable preprocessing the trainer's refl / draft / drtune use. Departures: none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from reward_server.scorers.base import ModelFilesMissing
from reward_server.scorers.local_model import fingerprint, pick_device, weights_dir
from scoring.aesthetic import HEAD_FILES, AestheticHead, aesthetic_of_pixels, load_aesthetic, load_head_state

__all__ = ["HEAD_FILES", "AestheticHead", "AestheticScorer", "load_head_state"]


class AestheticScorer:
    """LAION improved aesthetic predictor: MLP(normalised CLIP ViT-L/14 image embedding)."""

    name = "aesthetic"
    description = "LAION improved aesthetic predictor (CLIP ViT-L/14 embedding -> MLP), ~1..10 scale"
    score_range = (None, None)

    def __init__(self, model_dir: Path | None = None, device: str | None = None) -> None:
        """Args:
        model_dir: the server's ``--model-dir``; weights are read from ``<model_dir>/aesthetic``.
        device: torch device; default CUDA when available, else CPU.
        """
        self._root = weights_dir(model_dir, "aesthetic")
        self._device = pick_device(device)
        self._clip: Any = None
        self._processor: Any = None
        self._head: AestheticHead | None = None
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        if self._root is None:
            raise ModelFilesMissing("aesthetic needs --model-dir with aesthetic/clip and aesthetic/head.pth")
        clip, head, self._processor, head_path = load_aesthetic(self._root)
        self._clip, self._head = clip.to(self._device), head.to(self._device)
        self._version = (
            f"laion-aesthetic-mlp+clip-{clip.config.model_type}+{fingerprint(self._root / 'clip', [head_path])}"
        )
        self.score([np.zeros((64, 64, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        assert self._clip is not None and self._head is not None, "load() must be called before score()"
        rgb = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
        pixels_BCHW = self._processor(images=rgb, return_tensors="pt")["pixel_values"].to(self._device)
        return [float(value) for value in aesthetic_of_pixels(self._clip, self._head, pixels_BCHW).cpu().tolist()]
