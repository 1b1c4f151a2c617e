"""``imagereward``: a tiny checkpoint in the released layout, converted to transformers' BLIP, scores as a
plain-torch forward of that layout on the same weights; the reference's preprocessing; conversion refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_imagereward import TINY, build_tiny_imagereward, imagereward_raw, tiny_imagereward_state
from PIL import Image

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.convert_imagereward import blip_to_transformers, main
from reward_server.scorers.imagereward import MAX_TOKENS, REWARD_MEAN, REWARD_STD, imagereward_pixels

MEAN = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
STD = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("imagereward-models")
    _, state = build_tiny_imagereward(model_dir)
    scorer = SCORERS["imagereward"](model_dir=model_dir)
    scorer.load()
    return model_dir, state, scorer


def test_converted_checkpoint_scores_as_the_reference_layout(tiny) -> None:
    _, state, scorer = tiny
    assert scorer.version.startswith("imagereward+blip-32+") and scorer.score_range == (None, None)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(32, 32, 3), (48, 40, 3), (20, 30, 1)]]
    prompts = ["a red cup on a table", "digit 1", "a photo of a big dog " * 10]  # the last one is truncated
    outcomes = run_scorer(scorer, images, prompts, [{}] * 3)
    assert all(o.ok for o in outcomes), [o.message for o in outcomes]
    assert [o.details["truncated"] for o in outcomes] == [False, False, True]
    tokens = scorer._tokenizer(
        prompts, padding="max_length", truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
    )
    assert tokens["input_ids"].shape == (3, MAX_TOKENS) and tokens["input_ids"][0, 0] == scorer._tokenizer.cls_token_id
    pixels = torch.stack([imagereward_pixels(image, TINY["image"]) for image in images])
    with torch.no_grad():
        raw = imagereward_raw(state, pixels, tokens["input_ids"], tokens["attention_mask"])
    expected = (raw - REWARD_MEAN) / REWARD_STD
    scores = torch.tensor([o.score for o in outcomes])
    max_diff = (scores - expected).abs().max().item()
    print(f"imagereward converted vs reference layout: max |diff| = {max_diff:.2e} over scores {expected.tolist()}")
    assert max_diff < 1e-5
    assert expected.std() > 1e-2  # scores differ across items: the comparison is not vacuous
    assert outcomes[0].details["raw"] == pytest.approx(raw[0].item(), abs=1e-5)


def test_preprocessing_is_torchvision_resize_and_centre_crop_on_pil() -> None:
    # At the model size: ToTensor and Normalize only.
    square = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    expected = (torch.tensor(square, dtype=torch.float32).permute(2, 0, 1) / 255 - MEAN) / STD
    torch.testing.assert_close(imagereward_pixels(square, 32), expected, rtol=0, atol=1e-6)
    # 45 wide, 30 high -> short side 32, long int(32 * 45 / 30) = 48; crop left = round(16 / 2) = 8.
    wide = np.random.default_rng(2).integers(0, 256, (30, 45, 3), dtype=np.uint8)
    resized = np.asarray(Image.fromarray(wide).resize((48, 32), Image.BICUBIC))[:, 8:40]
    expected = (torch.tensor(resized, dtype=torch.float32).permute(2, 0, 1) / 255 - MEAN) / STD
    torch.testing.assert_close(imagereward_pixels(wide, 32), expected, rtol=0, atol=1e-6)
    # 33 x 32 (tall by one): no resize, crop top = int(round(0.5)) = 0 (Python rounds half to even).
    tall = np.random.default_rng(3).integers(0, 256, (33, 32, 1), dtype=np.uint8)
    expected = (torch.tensor(np.repeat(tall, 3, 2)[:32], dtype=torch.float32).permute(2, 0, 1) / 255 - MEAN) / STD
    torch.testing.assert_close(imagereward_pixels(tall, 32), expected, rtol=0, atol=1e-6)


def test_conversion_maps_the_blip_layout() -> None:
    state = tiny_imagereward_state(100)
    config, converted = blip_to_transformers(state, vision_heads=4, text_heads=2)
    assert (config.vision_config.num_attention_heads, config.text_config.num_attention_heads) == (4, 2)
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (32, 8)
    assert config.vision_config.layer_norm_eps == 1e-6 and config.text_config.layer_norm_eps == 1e-12
    assert config.text_config.encoder_hidden_size == 32 and config.text_config.vocab_size == 100
    assert not any(key.startswith(("blip.", "text_encoder.embeddings.position_ids")) for key in converted)
    torch.testing.assert_close(
        converted["vision_model.encoder.layers.1.self_attn.qkv.weight"],
        state["blip.visual_encoder.blocks.1.attn.qkv.weight"],
    )
    torch.testing.assert_close(
        converted["text_encoder.encoder.layer.0.crossattention.self.key.weight"],
        state["blip.text_encoder.encoder.layer.0.crossattention.self.key.weight"],
    )
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        blip_to_transformers({"visual.conv1.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="head width 64: pass the head count"):
        blip_to_transformers(state)


def test_command_line_and_load_refusals(tmp_path: Path, tiny) -> None:
    _, state, _ = tiny
    with pytest.raises(ValueError, match="imagereward needs --model-dir"):
        SCORERS["imagereward"]().load()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SCORERS["imagereward"](model_dir=tmp_path).load()
    partial = {key: value for key, value in state.items() if "layer.1.crossattention" not in key}
    torch.save({"state_dict": partial}, tmp_path / "partial.pt")
    main(
        [
            "--src",
            str(tmp_path / "partial.pt"),
            "--out",
            str(tmp_path / "imagereward"),
            "--vision-heads",
            "4",
            "--text-heads",
            "2",
        ]
    )
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json"):
        SCORERS["imagereward"](model_dir=tmp_path).load()
    (tmp_path / "imagereward" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="lacks or has unknown weights"):  # never run with random weights
        SCORERS["imagereward"](model_dir=tmp_path).load()
