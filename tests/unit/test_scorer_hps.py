"""``hpsv2``: a tiny OpenCLIP-layout checkpoint converted to transformers scores as a plain-torch OpenCLIP forward
on the same weights; HPSv2's validation transform; the converter's layout mapping and refusals."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fixtures_hps import (
    TINY,
    build_tiny_hps,
    openclip_image_features,
    openclip_text_features,
    tiny_openclip_state,
)

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.convert_hps import load_state, main, openclip_to_transformers
from reward_server.scorers.hps import OPENAI_MEAN, OPENAI_STD, hps_pixels

MEAN, STD = torch.tensor(OPENAI_MEAN).view(3, 1, 1), torch.tensor(OPENAI_STD).view(3, 1, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("hps-models")
    _, state = build_tiny_hps(model_dir)
    scorer = SCORERS["hpsv2"](model_dir=model_dir)
    scorer.load()
    return model_dir, state, scorer


def reference_pixels(image: np.ndarray, size: int) -> torch.Tensor:
    """HPSv2's preprocess_val written out: ToTensor, ResizeMaxSize (bicubic, zero fill), Normalize."""
    x = torch.tensor(image, dtype=torch.float32).permute(2, 0, 1) / 255
    h, w = x.shape[1:]
    if max(h, w) != size:
        nh, nw = round(h * size / max(h, w)), round(w * size / max(h, w))
        resized = F.interpolate(x[None], (nh, nw), mode="bicubic", antialias=True)[0]
        x = torch.zeros(3, size, size)
        top, left = (size - nh) // 2, (size - nw) // 2
        x[:, top : top + nh, left : left + nw] = resized
    return (x - MEAN) / STD


def test_converted_checkpoint_scores_as_the_openclip_reference(tiny) -> None:
    model_dir, state, scorer = tiny
    assert scorer.version.startswith("hpsv2+clip-32+") and scorer.score_range == (-1.0, 1.0)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(32, 32, 3), (48, 40, 3), (20, 30, 3)]]
    prompts = ["a red cup on a table", "digit 1", "a photo of a dog " * 20]  # the last one is truncated
    outcomes = run_scorer(scorer, images, prompts, [{}] * 3)
    assert all(o.ok for o in outcomes), [o.message for o in outcomes]
    assert [o.details["truncated"] for o in outcomes] == [False, False, True]

    tokenizer = scorer._tokenizer
    rows = [tokenizer(p, truncation=True, max_length=TINY["context"])["input_ids"] for p in prompts]
    tokens = torch.zeros(len(rows), TINY["context"], dtype=torch.long)  # OpenCLIP pads with 0 to the context
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    assert rows[2][-1] == tokenizer.eos_token_id and len(rows[2]) == TINY["context"]
    with torch.no_grad():
        image_BD = openclip_image_features(state, torch.stack([reference_pixels(im, TINY["image"]) for im in images]))
        text_BD = openclip_text_features(state, tokens, tokenizer.eos_token_id)
    expected = (F.normalize(image_BD, dim=-1) * F.normalize(text_BD, dim=-1)).sum(-1)
    scores = torch.tensor([o.score for o in outcomes])
    max_diff = (scores - expected).abs().max().item()
    print(f"hpsv2 converted vs OpenCLIP reference: max |diff| = {max_diff:.2e} over scores {expected.tolist()}")
    assert max_diff < 1e-5
    assert expected.std() > 1e-3  # the scores differ across items: the comparison is not vacuous


def test_preprocessing_is_hps_validation_transform() -> None:
    # Already at the model size: only ToTensor and Normalize.
    square = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    expected = (torch.tensor(square, dtype=torch.float32).permute(2, 0, 1) / 255 - MEAN) / STD
    torch.testing.assert_close(hps_pixels(square, 32), expected, rtol=0, atol=1e-6)
    # 64x32 constant -> 32x16 resized (still constant), centred, zero padding that becomes -mean/std.
    flat = np.full((64, 32, 3), 200, np.uint8)
    out = hps_pixels(flat, 32)
    assert out.shape == (3, 32, 32)
    torch.testing.assert_close(out[:, :, 8:24], ((200 / 255 - MEAN) / STD).expand(3, 32, 16), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, :, :8], (-MEAN / STD).expand(3, 32, 8), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, :, 24:], (-MEAN / STD).expand(3, 32, 8), rtol=0, atol=1e-6)
    # 20x30 -> 21x32 (Python rounding of 21.33): 11 rows of padding, 5 above and 6 below; grey becomes RGB.
    odd = hps_pixels(np.full((20, 30, 1), 200, np.uint8), 32)
    background = -MEAN / STD
    assert torch.allclose(odd[:, 4, 0], background[:, 0, 0]) and not torch.allclose(odd[:, 5, 0], background[:, 0, 0])
    assert torch.allclose(odd[:, 26, 0], background[:, 0, 0]) and not torch.allclose(odd[:, 25, 0], background[:, 0, 0])
    torch.testing.assert_close(odd, reference_pixels(np.full((20, 30, 3), 200, np.uint8), 32))


def test_conversion_splits_in_proj_and_transposes_projections() -> None:
    state = tiny_openclip_state(100)
    config, converted = openclip_to_transformers(state, vision_heads=4, text_heads=2)
    assert config.vision_config.num_attention_heads == 4 and config.text_config.num_attention_heads == 2
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (32, 8)
    assert (config.text_config.vocab_size, config.text_config.max_position_embeddings) == (100, 77)
    assert config.projection_dim == 24 and config.vision_config.hidden_act == "gelu"
    fused = state["visual.transformer.resblocks.1.attn.in_proj_weight"]
    for i, name in enumerate("qkv"):
        torch.testing.assert_close(
            converted[f"vision_model.encoder.layers.1.self_attn.{name}_proj.weight"], fused[32 * i : 32 * (i + 1)]
        )
    torch.testing.assert_close(converted["text_projection.weight"], state["text_projection"].T)
    torch.testing.assert_close(converted["visual_projection.weight"], state["visual.proj"].T)
    assert converted["logit_scale"].shape == ()
    with pytest.raises(ValueError, match="head width 64: pass the head count"):
        openclip_to_transformers({**state, "visual.conv1.weight": torch.zeros(48, 3, 8, 8)})
    with pytest.raises(ValueError, match="only OpenCLIP's built-in ViT towers"):
        openclip_to_transformers({"text.transformer.x": torch.zeros(1)})
    del state["transformer.resblocks.1.ln_1.weight"]
    with pytest.raises(KeyError):
        openclip_to_transformers(state, vision_heads=4, text_heads=2)


class Payload:
    """Anything but tensors and containers: weights_only loading must refuse it."""


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    torch.save({"state_dict": {"module.logit_scale": torch.ones(())}}, tmp_path / "ok.pt")
    assert set(load_state(tmp_path / "ok.pt")) == {"logit_scale"}
    torch.save({"state_dict": {"logit_scale": torch.ones(())}, "extra": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_state(tmp_path / "evil.pt")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        load_state(tmp_path / "list.pt")


def test_command_line_and_load_refusals(tmp_path: Path, tiny) -> None:
    model_dir, state, _ = tiny
    with pytest.raises(ValueError, match="hpsv2 needs --model-dir"):
        SCORERS["hpsv2"]().load()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SCORERS["hpsv2"](model_dir=tmp_path).load()
    # The command line without --tokenizer writes weights and config only: the scorer asks for a tokenizer.
    from safetensors.torch import save_file

    save_file({key: value.contiguous() for key, value in state.items()}, str(tmp_path / "src.safetensors"))
    main(
        [
            "--src",
            str(tmp_path / "src.safetensors"),
            "--out",
            str(tmp_path / "hpsv2"),
            "--vision-heads",
            "4",
            "--text-heads",
            "2",
        ]
    )
    assert (tmp_path / "hpsv2" / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="no tokenizer_config.json"):
        SCORERS["hpsv2"](model_dir=tmp_path).load()
    # A partial checkpoint is refused, never run with random weights.
    from safetensors.torch import load_file

    for name in ("tokenizer_config.json", "tokenizer.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        if (model_dir / "hpsv2" / name).is_file():
            (tmp_path / "hpsv2" / name).write_bytes((model_dir / "hpsv2" / name).read_bytes())
    weights = load_file(str(tmp_path / "hpsv2" / "model.safetensors"))
    del weights["text_projection.weight"]
    save_file(weights, str(tmp_path / "hpsv2" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks or mis-shapes"):
        SCORERS["hpsv2"](model_dir=tmp_path).load()
