"""A tiny random HPSv3 checkpoint in the reference's layout (transformers 4.45 Qwen2-VL names, ``<|Reward|>`` added
to the vocabulary, a random ranknet ``rm_head``), its base model directory, and the project's conversion of it
into ``<model_dir>/hpsv3``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEST_PIXELS = 4 * 28 * 28
"""Images are resized to about this many pixels (HPSv3's 256 * 28 * 28 would make 256 image tokens)."""


def to_legacy_name(key: str) -> str:
    """transformers 5 -> 4.45 Qwen2-VL names, as HPSv3.safetensors has them."""
    if key.startswith("model.visual."):
        return key.removeprefix("model.")
    return key.replace("model.language_model.", "model.", 1)


def build_tiny_hpsv3_reference(root: Path) -> tuple[Path, Path]:
    """(HPSv3.safetensors, base directory): a tiny Qwen2-VL base and the reward model trained from it."""
    from fixtures_models import build_tiny_qwen_vl  # here: fixtures_models imports this module
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    base = build_tiny_qwen_vl(root / "base", variant="qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    model.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():  # sharper attention, so that positions (1-D vs M-RoPE, padding offsets) matter
        for name, parameter in model.named_parameters():
            if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(20.0)
    state = {to_legacy_name(key): value.contiguous() for key, value in model.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    hidden = model.config.get_text_config().hidden_size
    for index, (out, into) in {0: (1024, hidden), 3: (16, 1024), 5: (2, 16)}.items():
        state[f"rm_head.{index}.weight"] = torch.randn(out, into, generator=g) / into**0.5 * 2
        state[f"rm_head.{index}.bias"] = torch.randn(out, generator=g) * 0.1
    src = root / "HPSv3.safetensors"
    save_file(state, str(src))
    return src, base


def build_tiny_hpsv3(model_dir: Path) -> Path:
    """``<model_dir>/hpsv3`` converted from a tiny reference checkpoint, and ``hpsv3.json`` with TEST_PIXELS."""
    from reward_server.scorers.convert_hpsv3 import convert

    src, base = build_tiny_hpsv3_reference(model_dir / "hpsv3-reference")
    convert(src, base, model_dir / "hpsv3")
    (model_dir / "hpsv3.json").write_text(json.dumps({"image_pixels": TEST_PIXELS}))
    return model_dir
