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
centre crop, CLIP mean/std), as CLIPProcessor's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from reward_server.scorers.base import ModelFilesMissing, ScoreOutcome
from reward_server.scorers.local_model import (
    fingerprint,
    load_strict,
    pick_device,
    require_files,
    tokenize,
    weights_dir,
)


class ClipScoreScorer:
    """``logit_scale * cos(text, image) / divisor`` of a CLIPModel read from ``<model_dir>/<name>``."""

    score_range = (None, None)

    def __init__(self, name: str, divisor: float, description: str, model_dir: Path | None = None,
                 device: str | None = None) -> None:
        """Args:
        name: registry name, also the folder under ``model_dir`` the weights are read from.
        divisor: what the scaled cosine is divided by (the reference scorer's normalisation).
        description: the one-line ``/info`` description.
        model_dir: the server's ``--model-dir``.
        device: torch device; default CUDA when available, else CPU.
        """
        self.name, self.description, self._divisor = name, description, divisor
        self._root = weights_dir(model_dir, name)
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
        from transformers import AutoTokenizer, CLIPModel
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        if self._root is None:
            raise ModelFilesMissing(f"{self.name} needs --model-dir with a CLIPModel in {self.name}/")
        if not (self._root / "config.json").is_file():
            raise FileNotFoundError(f"{self._root} is not a transformers CLIPModel checkpoint (no config.json)")
        processor_dir = self._root / "processor" if (self._root / "processor").is_dir() else self._root
        require_files(processor_dir, ("preprocessor_config.json", "tokenizer_config.json"),
                      f"save the model's CLIP processor (tokenizer and image processor) there or in "
                      f"{self._root / 'processor'}")
        model = load_strict(CLIPModel, self._root, "CLIPModel")
        self._model = model.eval().to(self._device)
        self._tokenizer = AutoTokenizer.from_pretrained(processor_dir)
        self._processor = CLIPImageProcessorPil.from_pretrained(processor_dir)
        self._max_tokens = min(self._tokenizer.model_max_length, model.config.text_config.max_position_embeddings)
        self._version = f"{self.name}+clip-{model.config.vision_config.hidden_size}+{fingerprint(self._root)}"
        self.score([np.zeros((64, 64, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._model is not None, "load() must be called before score()"
        rgb = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
        pixels_BCHW = self._processor(images=rgb, return_tensors="pt")["pixel_values"].to(self._device)
        tokens, truncated = tokenize(self._tokenizer, prompts, self._max_tokens, self._device)
        out = self._model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                          pixel_values=pixels_BCHW)
        cosine_B = (out.image_embeds.float() * out.text_embeds.float()).sum(-1)  # both L2-normalised
        scores_B = self._model.logit_scale.exp().float() * cosine_B / self._divisor
        return [ScoreOutcome(score=float(score), details={"cosine": float(cosine), "truncated": cut})
                for score, cosine, cut in zip(scores_B.tolist(), cosine_B.tolist(), truncated, strict=True)]
