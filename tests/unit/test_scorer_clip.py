"""``pickscore`` and ``clipscore`` on tiny random CLIP models, checked against a manual computation.

The tiny models' scores mean nothing; what is checked is the loading (processor beside the weights or in
``processor/``), the tokenization (padding, truncation to the text tower's context), the preprocessing and
the math: ``logit_scale * cos(text, image) / divisor`` per item.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_models import build_tiny_clip_score
from PIL import Image
from transformers import CLIPModel, CLIPTokenizer

from reward_server.scorers import SCORERS, run_scorer

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711])
DIVISORS = {"pickscore": 26.0, "clipscore": 30.0}
PROMPTS = ["a red cat", "a photo of the handwritten digit seven", "dog"]


@pytest.fixture(scope="module", params=sorted(DIVISORS))
def loaded(request, conformance_model_dir: Path):
    scorer = SCORERS[request.param](model_dir=conformance_model_dir)
    scorer.load()
    return scorer, conformance_model_dir / request.param


def _manual_score(image: np.ndarray, prompt: str, root: Path, divisor: float) -> float:
    """Each item alone through the CLIPModel's towers: OpenAI CLIP preprocessing by hand (PIL bicubic short
    side to 32, centre crop 32, mean/std), the prompt's own token ids (no padding), both projections, the
    cosine, the model's logit scale."""
    pil = Image.fromarray(image.squeeze(-1) if image.shape[2] == 1 else image).convert("RGB")
    scale = 32 / min(pil.size)
    pil = pil.resize((round(pil.width * scale), round(pil.height * scale)), Image.Resampling.BICUBIC)
    left, top = (pil.width - 32) // 2, (pil.height - 32) // 2
    pixels = (np.asarray(pil.crop((left, top, left + 32, top + 32))) / 255.0 - CLIP_MEAN) / CLIP_STD
    processor_dir = root / "processor" if (root / "processor").is_dir() else root
    ids = CLIPTokenizer.from_pretrained(processor_dir)(prompt, truncation=True, max_length=16)["input_ids"]
    clip = CLIPModel.from_pretrained(root).eval()
    with torch.no_grad():
        image_D = clip.visual_projection(
            clip.vision_model(
                pixel_values=torch.tensor(pixels.transpose(2, 0, 1)[None], dtype=torch.float32)
            ).pooler_output
        )[0].double()
        text_D = clip.text_projection(clip.text_model(input_ids=torch.tensor([ids])).pooler_output)[0].double()
        cosine = image_D @ text_D / (image_D.norm() * text_D.norm())
        return float(clip.logit_scale.exp().double() * cosine / divisor)


def test_each_item_matches_the_manual_computation_whatever_its_batch(loaded) -> None:
    scorer, root = loaded
    rng = np.random.default_rng(0)
    images = [
        rng.integers(0, 256, (48, 40, 3), dtype=np.uint8),
        rng.integers(0, 256, (32, 64, 1), dtype=np.uint8),
        rng.integers(0, 256, (40, 40, 3), dtype=np.uint8),
    ]
    outcomes = run_scorer(scorer, images, PROMPTS, [{}] * 3)
    assert all(outcome.ok for outcome in outcomes)
    for image, prompt, outcome in zip(images, PROMPTS, outcomes, strict=True):
        assert outcome.score == pytest.approx(_manual_score(image, prompt, root, DIVISORS[scorer.name]), rel=1e-4)
        assert outcome.details["truncated"] is False
        assert -1 <= outcome.details["cosine"] <= 1
    assert len({round(outcome.score, 6) for outcome in outcomes}) == 3
    alone = run_scorer(scorer, images[1:2], PROMPTS[1:2], [{}])[0]
    assert alone.score == pytest.approx(outcomes[1].score, abs=1e-5)


def test_a_prompt_longer_than_the_text_context_is_truncated_and_flagged(loaded) -> None:
    scorer, root = loaded
    long_prompt = " ".join(["a big red cat"] * 8)
    image = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    outcome = run_scorer(scorer, [image], [long_prompt], [{}])[0]
    assert outcome.ok, outcome.message
    assert outcome.details["truncated"] is True
    assert outcome.score == pytest.approx(_manual_score(image, long_prompt, root, DIVISORS[scorer.name]), rel=1e-4)


def test_the_two_scorers_fingerprint_their_own_weights(conformance_model_dir: Path) -> None:
    versions = set()
    for name in DIVISORS:
        scorer = SCORERS[name](model_dir=conformance_model_dir)
        scorer.load()
        versions.add(scorer.version)
        assert scorer.version.startswith(f"{name}+clip-32+")
    assert len(versions) == 2


def test_missing_or_partial_weights_are_refused_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pickscore needs --model-dir"):
        SCORERS["pickscore"]().load()
    with pytest.raises(FileNotFoundError, match=r"pickscore is not a transformers CLIPModel checkpoint"):
        SCORERS["pickscore"](model_dir=tmp_path).load()
    root = build_tiny_clip_score(tmp_path, "pickscore", processor_subfolder=True)
    shutil.rmtree(root / "processor")
    with pytest.raises(
        FileNotFoundError, match=r"no preprocessor_config.json in .*pickscore: save the model's CLIP processor"
    ):
        SCORERS["pickscore"](model_dir=tmp_path).load()
    vision_only = build_tiny_clip_score(tmp_path / "other", "clipscore", processor_subfolder=False)
    model = CLIPModel.from_pretrained(vision_only)
    model.vision_model.save_pretrained(tmp_path / "vision")
    shutil.copy(tmp_path / "vision" / "model.safetensors", vision_only / "model.safetensors")
    with pytest.raises(ValueError, match="lacks or mis-shapes CLIPModel weights"):
        SCORERS["clipscore"](model_dir=tmp_path / "other").load()
