"""``aesthetic``: the LAION head on a tiny random CLIP vision tower, checked against a manual computation.

The tiny model's scores mean nothing; what is checked is the loading (full CLIPModel checkpoint, LAION key
names, safetensors or pth), the preprocessing and the math.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_models import build_tiny_aesthetic
from PIL import Image
from transformers import CLIPModel

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.aesthetic import AestheticScorer

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])


@pytest.fixture(scope="module")
def aesthetic(tiny_aesthetic_model_dir: Path) -> AestheticScorer:
    scorer = SCORERS["aesthetic"](model_dir=tiny_aesthetic_model_dir)
    scorer.load()
    return scorer


def _manual_score(image: np.ndarray, model_dir: Path) -> float:
    """Through the full CLIPModel (not the scorer's vision-only load): OpenAI CLIP preprocessing by hand (PIL bicubic
    short side to 32, centre crop 32, mean/std), the
    projected embedding, L2 normalisation, then the five linear layers of the LAION head one by one."""
    pil = Image.fromarray(image)
    scale = 32 / min(pil.size)
    pil = pil.resize((round(pil.width * scale), round(pil.height * scale)), Image.Resampling.BICUBIC)
    left, top = (pil.width - 32) // 2, (pil.height - 32) // 2
    pixels = (np.asarray(pil.crop((left, top, left + 32, top + 32))) / 255.0 - CLIP_MEAN) / CLIP_STD
    pixels_BCHW = torch.tensor(pixels.transpose(2, 0, 1)[None], dtype=torch.float32)
    clip = CLIPModel.from_pretrained(model_dir / "aesthetic" / "clip").eval()
    with torch.no_grad():
        pooled = clip.vision_model(pixel_values=pixels_BCHW).pooler_output
        x = clip.visual_projection(pooled)[0].double()
    x = x / x.norm()
    head = torch.load(model_dir / "aesthetic" / "head.pth", weights_only=True)
    for index in (0, 2, 4, 6, 7):
        x = head[f"layers.{index}.weight"].double() @ x + head[f"layers.{index}.bias"].double()
    return float(x.item())


def test_aesthetic_matches_the_manual_computation(aesthetic: AestheticScorer, tiny_aesthetic_model_dir: Path) -> None:
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (48, 40, 3), dtype=np.uint8),
        rng.integers(0, 256, (32, 64, 3), dtype=np.uint8),
    ]
    scores = aesthetic.score(images, ["", ""], [{}, {}])
    for image, score in zip(images, scores, strict=True):
        assert score == pytest.approx(_manual_score(image, tiny_aesthetic_model_dir), rel=1e-4)
    assert scores[0] != pytest.approx(scores[1])


def test_aesthetic_is_batch_invariant_and_takes_gray(aesthetic: AestheticScorer) -> None:
    rng = np.random.default_rng(1)
    gray = rng.integers(0, 256, (40, 40, 1), dtype=np.uint8)
    color = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
    batch = run_scorer(aesthetic, [gray, color], ["", ""], [{}, {}])
    single = aesthetic.score([color], [""], [{}])
    assert all(outcome.ok for outcome in batch)
    assert batch[1].score == pytest.approx(single[0], abs=1e-5)
    assert batch[0].score == pytest.approx(aesthetic.score([np.repeat(gray, 3, axis=2)], [""], [{}])[0], abs=1e-5)


def test_aesthetic_loads_a_safetensors_head_without_the_layers_prefix(
    aesthetic: AestheticScorer, tmp_path: Path
) -> None:
    build_tiny_aesthetic(tmp_path, head_format="safetensors")  # same seed: same CLIP and head weights
    scorer = AestheticScorer(model_dir=tmp_path)
    scorer.load()
    image = np.random.default_rng(2).integers(0, 256, (36, 36, 3), dtype=np.uint8)
    assert scorer.score([image], [""], [{}]) == pytest.approx(aesthetic.score([image], [""], [{}]), abs=1e-6)
    assert scorer.version.split("+")[:2] == aesthetic.version.split("+")[:2]
    assert scorer.version != aesthetic.version  # the head file differs: so does the fingerprint


def test_aesthetic_version_fingerprints_the_weights(aesthetic: AestheticScorer) -> None:
    assert aesthetic.version.startswith("laion-aesthetic-mlp+clip-")
    assert len(aesthetic.version.rsplit("+", 1)[1]) == 12


def test_aesthetic_load_errors_name_the_missing_piece(tmp_path: Path, tiny_aesthetic_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--model-dir"):
        AestheticScorer().load()
    with pytest.raises(FileNotFoundError, match="CLIP checkpoint"):
        AestheticScorer(model_dir=tmp_path).load()
    build_tiny_aesthetic(tmp_path)
    torch.save({"layers.0.weight": torch.zeros(1024, 768)}, tmp_path / "aesthetic" / "head.pth")
    with pytest.raises(RuntimeError, match="Missing key"):
        AestheticScorer(model_dir=tmp_path).load()
