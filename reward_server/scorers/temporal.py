"""``temporal_consistency``: how alike a video's consecutive frames look to CLIP, a reward against flicker.

The score is the mean cosine similarity of consecutive frames' CLIP image embeddings (1: frames look the same; a
cut or flicker lowers it), with the image tower and preprocessing of the ``clipscore`` scorer's weights
(``<model-dir>/clipscore/``: OpenAI CLIP ViT-L/14, CLIPImageProcessorPil). Every frame of the clip is embedded, in
chunks. An own metric (no published reference computes exactly this), in the spirit of VBench's "subject
consistency" and CLIP-based frame consistency scores; it rewards a still clip too, so pair it with a motion or
quality reward. Details: each consecutive pair's similarity and the lowest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from reward_server.scorers.base import ScoreOutcome
from reward_server.scorers.clip_score import clip_image_processor, load_clip
from reward_server.scorers.local_model import fingerprint, pick_device, weights_dir
from shared.protocol import ErrorCode

EMBED_CHUNK = 32
"""Frames per forward pass of the image tower."""


class TemporalConsistencyScorer:
    """Mean cosine similarity of consecutive frames' CLIP image embeddings (``[-1, 1]``), per video."""

    name = "temporal_consistency"
    description = "mean cosine similarity of consecutive video frames' CLIP image embeddings (clipscore/ weights)"
    score_range = (-1.0, 1.0)
    modality = "video"

    def __init__(self, model_dir: Path | None = None, device: str | None = None, folder: str = "clipscore") -> None:
        self._folder = folder
        self._root = weights_dir(model_dir, folder)
        self._device = pick_device(device)
        self._model: Any = None
        self._processor: Any = None
        self._version = "unloaded"

    @property
    def version(self) -> str:
        return self._version

    def load(self) -> None:
        hint = "save the CLIP model's image processor there"
        model, processor_dir = load_clip(self.name, self._root, self._folder, ("preprocessor_config.json",), hint)
        self._model = model.eval().to(self._device)
        self._processor = clip_image_processor(processor_dir)
        self._version = f"{self.name}+clip-{model.config.vision_config.hidden_size}+{fingerprint(self._root)}"
        self.score([np.zeros((2, 64, 64, 3), np.uint8)], [""], [{}])

    @torch.no_grad()
    def embed(self, frames: np.ndarray) -> torch.Tensor:
        """L2-normalised CLIP image embeddings of uint8 frames ``[F, H, W, C]`` -> float32 ``[F, D]``."""
        rgb = np.repeat(frames, 3, axis=3) if frames.shape[3] == 1 else frames
        chunks = []
        for start in range(0, len(rgb), EMBED_CHUNK):
            pixels = self._processor(images=list(rgb[start : start + EMBED_CHUNK]), return_tensors="pt")
            pooled = self._model.vision_model(pixel_values=pixels["pixel_values"].to(self._device)).pooler_output
            chunks.append(self._model.visual_projection(pooled).float())  # CLIPModel's image_embeds, unnormalised
        embeds_FD = torch.cat(chunks)
        return embeds_FD / embeds_FD.norm(dim=-1, keepdim=True)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[ScoreOutcome]:
        assert self._model is not None, "load() must be called before score()"
        outcomes = []
        for video in images:
            if len(video) < 2:
                outcomes.append(ScoreOutcome.failure(ErrorCode.BAD_INPUT, "temporal consistency needs >= 2 frames"))
                continue
            outcomes.append(self.outcome(self.embed(video)))
        return outcomes

    @staticmethod
    def outcome(embeds_FD: torch.Tensor) -> ScoreOutcome:
        """The score of one clip from its frames' normalised embeddings."""
        pairs = (embeds_FD[1:] * embeds_FD[:-1]).sum(-1).clamp(-1.0, 1.0).tolist()
        return ScoreOutcome(score=float(np.mean(pairs)), details={"pair_similarities": pairs, "min": min(pairs)})
