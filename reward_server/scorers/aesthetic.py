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
DDPO's and Flow-GRPO's scorers. Departures: none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from reward_server.scorers.base import ModelFilesMissing
from reward_server.scorers.local_model import fingerprint, load_strict, pick_device, weights_dir

HEAD_FILES = ("head.safetensors", "head.pth")


class AestheticHead(nn.Module):
    """LAION's aesthetic MLP; ``layers`` keeps the original module indices so checkpoints load as-is."""

    def __init__(self, embed_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds_BD: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds_BD)


def load_head_state(path: Path) -> dict[str, torch.Tensor]:
    """The head's state dict from ``.safetensors`` or ``.pth``, with keys as :class:`AestheticHead` names
    them (``layers.N.weight``); bare ``N.weight`` keys get the prefix."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return {key if key.startswith("layers.") else f"layers.{key}": value for key, value in state.items()}


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
        from transformers import AutoConfig, CLIPVisionModelWithProjection
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        if self._root is None:
            raise ModelFilesMissing("aesthetic needs --model-dir with aesthetic/clip and aesthetic/head.pth")
        clip_dir = self._root / "clip"
        if not (clip_dir / "config.json").is_file():
            raise FileNotFoundError(f"{clip_dir} is not a transformers CLIP checkpoint (no config.json)")
        head_path = next((self._root / name for name in HEAD_FILES if (self._root / name).is_file()), None)
        if head_path is None:
            raise FileNotFoundError(f"no aesthetic head in {self._root}: expected one of {HEAD_FILES}")

        config = AutoConfig.from_pretrained(clip_dir)
        if config.model_type == "clip":  # a full CLIPModel: its vision half, with the model's projection size
            vision_config = config.vision_config
            vision_config.projection_dim = config.projection_dim
        else:
            vision_config = config
        # a full CLIPModel's text weights are left unused here
        clip = load_strict(CLIPVisionModelWithProjection, clip_dir, "CLIP vision", config=vision_config)
        clip = clip.eval().to(self._device)
        head = AestheticHead(clip.config.projection_dim)
        head.load_state_dict(load_head_state(head_path))  # strict: a wrong or partial head fails here
        has_processor = (clip_dir / "preprocessor_config.json").is_file()
        self._processor = CLIPImageProcessorPil.from_pretrained(clip_dir) if has_processor else CLIPImageProcessorPil()
        self._clip, self._head = clip, head.eval().to(self._device)
        self._version = f"laion-aesthetic-mlp+clip-{clip.config.model_type}+{fingerprint(clip_dir, [head_path])}"
        self.score([np.zeros((64, 64, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        assert self._clip is not None and self._head is not None, "load() must be called before score()"
        rgb = [np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image for image in images]
        pixels_BCHW = self._processor(images=rgb, return_tensors="pt")["pixel_values"].to(self._device)
        embeds_BD = self._clip(pixel_values=pixels_BCHW).image_embeds.float()
        embeds_BD = embeds_BD / embeds_BD.norm(dim=-1, keepdim=True)
        return [float(value) for value in self._head(embeds_BD).squeeze(-1).cpu().tolist()]
