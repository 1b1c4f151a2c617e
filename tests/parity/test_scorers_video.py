"""Parity of the video scorer ``temporal_consistency`` with a plain computation of its definition (our own metric)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transcribed import transcribes

from reward_server.scorers import SCORERS, run_scorer


def _plain_consistency(clip_dir: Path, video: np.ndarray) -> float:
    """The definition, written plainly: CLIPModel's own ``image_embeds`` of each frame (CLIPProcessor's
    preprocessing), then the mean over t of ``cosine_similarity(e_t, e_t+1)``."""
    from transformers import CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(clip_dir, dtype=torch.float32).eval()
    processor = CLIPImageProcessorPil.from_pretrained(clip_dir)
    pixels = processor(images=list(video), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        embeds = model(pixel_values=pixels, input_ids=torch.zeros(len(video), 2, dtype=torch.long)).image_embeds
    return torch.nn.functional.cosine_similarity(embeds[1:], embeds[:-1], dim=-1).mean().item()


@transcribes(
    "scorer:temporal_consistency",
    own="our metric (mean CLIP cosine of consecutive frames, like VBench's subject consistency but on CLIP's image "
    "embeddings of every frame); no reference code computes exactly this",
)
def test_temporal_consistency_is_the_mean_consecutive_clip_cosine(tmp_path: Path) -> None:
    from fixtures_models import build_tiny_clip_score

    clip_dir = build_tiny_clip_score(tmp_path, "clipscore", processor_subfolder=False)
    scorer = SCORERS["temporal_consistency"](model_dir=tmp_path)
    scorer.load()
    rng = np.random.default_rng(3)
    moving = rng.integers(0, 256, (5, 20, 28, 3), dtype=np.uint8)
    still = np.repeat(moving[:1], 4, axis=0)
    outcomes = run_scorer(scorer, [moving, still], ["", ""], [{}, {}])
    assert outcomes[0].score == pytest.approx(_plain_consistency(clip_dir, moving), abs=1e-5)
    assert outcomes[1].score == pytest.approx(1.0, abs=1e-5)
    assert len(outcomes[0].details["pair_similarities"]) == 4
