"""``hpsv3`` on a tiny random HPSv3 checkpoint in the reference's layout, converted by ``convert_hpsv3``.

The converted scorer (batched, left-padded) must give what a direct computation on the unconverted weights gives:
a fresh Qwen2-VL loaded under the 4.45 -> 5 renaming done here by hand, one item at a time with no padding, the
image features placed by hand, the language model run with its default sequential positions (as the reference's
forward does), the hidden state at ``<|Reward|>`` read by index and the ranknet head in plain tensor code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_hpsv3 import TEST_PIXELS, build_tiny_hpsv3_reference

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.convert_hpsv3 import convert
from reward_server.scorers.hpsv3 import REWARD_TOKEN, fixed_area_size, question
from shared.protocol import ErrorCode

RNG = np.random.default_rng(0)
IMAGES = [RNG.integers(0, 256, (40, 60, 3), dtype=np.uint8), RNG.integers(0, 256, (64, 48, 1), dtype=np.uint8)]
PROMPTS = ["a cat", "a red bicycle leaning on a blue wall at sunset"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model_dir with hpsv3/ and hpsv3.json, the reference checkpoint, its base directory)."""
    root = tmp_path_factory.mktemp("hpsv3")
    src, base = build_tiny_hpsv3_reference(root / "reference")
    convert(src, base, root / "hpsv3")
    (root / "hpsv3.json").write_text(f'{{"image_pixels": {TEST_PIXELS}}}')
    return root, src, base


@pytest.fixture(scope="module")
def scorer(converted):
    loaded = SCORERS["hpsv3"](model_dir=converted[0])
    loaded.load()
    return loaded


def direct_mu_sigma(src: Path, base: Path, images: list[np.ndarray], prompts: list[str]) -> torch.Tensor:
    """(mu, sigma) ``[B, 2]`` computed item by item from the reference-layout checkpoint without the project's code
    paths."""
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    state = load_file(str(src))
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = state["model.embed_tokens.weight"].shape[0]
    model = Qwen2VLForConditionalGeneration(config).eval()
    renamed = {
        ("model." + key if key.startswith("visual.") else key.replace("model.", "model.language_model.", 1)): value
        for key, value in state.items()
        if not key.startswith("rm_head.")
    }
    model.load_state_dict(renamed, strict=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    processor = Qwen2VLImageProcessorPil.from_pretrained(base)
    rows = []
    for image, prompt in zip(images, prompts, strict=True):
        height, width = fixed_area_size(*image.shape[:2], TEST_PIXELS)
        pil = Image.fromarray(np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image)
        vision = processor(images=[pil.resize((width, height), Image.BICUBIC)], return_tensors="pt", do_resize=False)
        num_tokens = int(vision["image_grid_thw"].prod()) // 4
        text = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            + "<|image_pad|>" * num_tokens
            + "<|vision_end|>"
            + question(prompt)
            + "<|im_end|>\n<|im_start|>assistant\n"
        )
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            embeds = model.model.language_model.embed_tokens(ids)
            features = model.model.visual(vision["pixel_values"], grid_thw=vision["image_grid_thw"]).pooler_output
            embeds[ids == config.image_token_id] = features
            hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state[0]
        (at,) = (ids[0] == tokenizer.convert_tokens_to_ids(REWARD_TOKEN)).nonzero()[0]
        h = hidden[at].float()
        for index in (0, 3, 5):
            h = h @ state[f"rm_head.{index}.weight"].T + state[f"rm_head.{index}.bias"]
            h = torch.relu(h) if index != 5 else h
        rows.append(h)
    return torch.stack(rows)


def test_converted_checkpoint_scores_as_the_direct_computation(converted, scorer) -> None:
    _, src, base = converted
    outcomes = run_scorer(scorer, IMAGES, PROMPTS, [{}, {}])
    expected = direct_mu_sigma(src, base, IMAGES, PROMPTS)
    got = torch.tensor([[o.score, o.details["sigma"]] for o in outcomes])
    max_diff = float((got - expected).abs().max())
    print(f"hpsv3 converted vs direct: max |diff| = {max_diff:.2e} over {expected.numel()} values")
    assert max_diff < 1e-4 and float(expected[:, 0].std()) > 10 * max_diff  # items differ, conversion does not
    assert scorer.version.startswith("hpsv3+qwen2_vl+") and scorer.score_range == (None, None)


def test_sequential_positions_are_what_the_head_was_trained_on(scorer) -> None:
    """Qwen2-VL's own 3-D M-RoPE positions (what the model's forward would use) give another reward."""
    queries = [scorer.query(IMAGES[0], PROMPTS[0])]
    inputs = scorer._judge.encode(queries, do_resize=False)
    with torch.no_grad():
        hidden = scorer._judge.model.model(**inputs).last_hidden_state
        mrope = scorer._head(hidden[inputs["input_ids"] == scorer._reward_id])
    assert float((mrope - scorer.forward(queries)).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((512, 512), (448, 448)),  # 504 x 504 rounded is over 256 * 28 * 28: scaled down, floored to 28
        ((1024, 768), (504, 364)),  # beta = sqrt(1024 * 768 / 200704) = 1.979: 517.3 -> 504, 388.0 -> 364
        ((64, 48), (532, 392)),  # under: beta = sqrt(200704 / 3072) = 8.083: 517.3 -> 532, 388.0 -> 392
        ((448, 448), (448, 448)),
    ],
)
def test_images_are_resized_to_the_reference_area(size: tuple[int, int], expected: tuple[int, int]) -> None:
    assert fixed_area_size(*size, 256 * 28 * 28) == expected


def test_prompt_with_the_reward_token_and_bad_inputs(converted, scorer, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    model_dir, src, base = converted
    outcomes = run_scorer(
        scorer,
        [IMAGES[0], IMAGES[0], np.zeros((2, 500, 3), np.uint8)],
        [f"a {REWARD_TOKEN} cat", "a cat", "a line"],
        [{}, {}, {}],
    )
    assert [o.error for o in outcomes] == [ErrorCode.BAD_INPUT, None, ErrorCode.BAD_INPUT]
    with pytest.raises(ValueError, match="--model-dir"):
        SCORERS["hpsv3"]().load()
    with pytest.raises(FileNotFoundError, match="reward_head.safetensors"):
        SCORERS["hpsv3"](model_dir=tmp_path).load()
    wrong_base = tmp_path / "wrong-base"  # a tokenizer one token longer than the checkpoint's vocabulary
    shutil.copytree(base, wrong_base)
    tokenizer = AutoTokenizer.from_pretrained(wrong_base)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tokenizer.save_pretrained(wrong_base)
    with pytest.raises(ValueError, match="token embeddings"):
        convert(src, wrong_base, tmp_path / "out")
    with pytest.raises(ValueError, match="not an HPSv3 checkpoint"):
        convert(model_dir / "hpsv3" / "reward_head.safetensors", base, tmp_path / "not-hpsv3")
