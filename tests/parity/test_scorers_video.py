"""Parity of the video scorers ``temporal_consistency`` and ``motion`` with plain computations of their definitions
(our own metrics)."""

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


def _plain_motion(video: np.ndarray, direction: str) -> float:
    """The definition, written plainly with torch: centroid of grey ink per frame, steps, margin along the direction
    less the size across it, a quarter of the steps' spread about their mean and half a pixel; over 0.25, squashed."""
    ink = torch.from_numpy(video).double().mean(-1) / 255
    ys, xs = torch.meshgrid(torch.arange(ink.shape[1]).double(), torch.arange(ink.shape[2]).double(), indexing="ij")
    path = torch.stack([(ink * xs).sum((1, 2)) / ink.sum((1, 2)), (ink * ys).sum((1, 2)) / ink.sum((1, 2))], 1)
    steps = path[1:] - path[:-1]
    mean = steps.mean(0)
    unit = torch.tensor({"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]).double()
    across = torch.tensor([-unit[1], unit[0]])
    margin = mean @ unit - (mean @ across).abs()
    spread = (steps - mean).norm(dim=1).mean()
    return torch.sigmoid((margin - spread / 4 - 0.5) / 0.25).item()


@transcribes(
    "scorer:motion",
    own="our metric for the embedded video task (the ink centroid moves the prompt's way at a pixel a frame, "
    "steadily); no published reward scores a direction of motion",
)
def test_motion_is_the_centroid_margin_less_wobble_squashed() -> None:
    rng = np.random.default_rng(5)
    videos = [rng.integers(1, 256, (5, 16, 16, c), dtype=np.uint8) for c in (1, 3, 1, 1)]
    prompts = ["a digit 7 moving right", "moving up", "a handwritten digit 2 moving left", "a digit 1 moving down"]
    outcomes = run_scorer(SCORERS["motion"](), videos, prompts, [{}] * 4)
    for outcome, video, prompt in zip(outcomes, videos, prompts, strict=True):
        assert outcome.score == pytest.approx(_plain_motion(video, prompt.rsplit(" ", 1)[1]), abs=1e-12)
