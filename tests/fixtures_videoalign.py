"""A tiny random VideoReward checkpoint in the authors' layout (``model_config.json`` and ``checkpoint-<step>/`` with
PEFT's ``adapter_model.safetensors``, ``adapter_config.json`` and ``non_lora_state_dict.pth`` under transformers
4.45's Qwen2-VL names), its base model directory, and the project's conversion of it into ``<model_dir>/videoalign``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from reward_server.scorers.videoalign import SPECIAL_TOKENS

TEST_MAX_PIXELS = 160 * 28 * 28
"""Frames are resized to at most this many pixels (and, as the authors' rule has it, at least 128 * 28 * 28)."""
INFERENCE_CONFIG = {"VQ_mean": 0.3, "VQ_std": 1.7, "MQ_mean": -0.2, "MQ_std": 0.8, "TA_mean": 0.05, "TA_std": 2.5}
LORA_RANK, LORA_ALPHA = 4, 8


def to_legacy_name(key: str) -> str:
    """transformers 5 -> 4.45 Qwen2-VL names, under PEFT's prefix, as the authors' files hold them."""
    legacy = (
        key.removeprefix("model.")
        if key.startswith("model.visual.")
        else key.replace("model.language_model.", "model.", 1)
    )
    return "base_model.model." + legacy


def model_config(max_pixels: int) -> dict:
    """The authors' model_config.json as their training writes it (the fields the scorer and converter read)."""
    return {
        "data_config": {
            "meta_data": "train.csv",
            "data_dir": "videos",
            "max_frame_pixels": max_pixels,
            "num_frames": None,
            "fps": 2.0,
            "eval_dim": ["VQ", "MQ", "TA"],
            "prompt_template_type": "detailed_special",
            "sample_type": "uniform",
        },
        "model_config": {"output_dim": 3, "use_special_tokens": True, "reward_token": "special"},
        "peft_lora_config": {"lora_enable": True, "lora_r": LORA_RANK, "lora_alpha": LORA_ALPHA},
        "inference_config": INFERENCE_CONFIG,
    }


def build_tiny_videoalign_reference(root: Path, max_pixels: int = TEST_MAX_PIXELS) -> tuple[Path, Path]:
    """(VideoReward folder, base directory): a tiny Qwen2-VL base and a LoRA run trained from it."""
    from fixtures_models import build_tiny_qwen_vl  # here: fixtures_models imports this module
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    base = build_tiny_qwen_vl(root / "base", variant="qwen2_vl")
    Qwen2VLImageProcessorPil().save_pretrained(base)  # Qwen2-VL's own pixel bounds: they hold the authors' frames
    model = AutoModelForImageTextToText.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    model.resize_token_embeddings(len(tokenizer))
    g = torch.Generator().manual_seed(11)
    hidden = model.config.get_text_config().hidden_size
    non_lora = {"base_model.model.rm_head.weight": torch.randn(3, hidden, generator=g)}
    lora = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key.startswith("model.visual.") or key == "model.language_model.embed_tokens.weight":
                non_lora[to_legacy_name(key)] = value + 0.05 * torch.randn(value.shape, generator=g)
            elif key.startswith("model.language_model.layers.") and key.endswith("proj.weight"):
                module = to_legacy_name(key).removesuffix(".weight")
                lora[f"{module}.lora_A.weight"] = torch.randn(LORA_RANK, value.shape[1], generator=g) * 0.3
                lora[f"{module}.lora_B.weight"] = torch.randn(value.shape[0], LORA_RANK, generator=g) * 0.3
    src = root / "VideoReward"
    checkpoint = src / "checkpoint-12"
    checkpoint.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in lora.items()}, str(checkpoint / "adapter_model.safetensors"))
    torch.save(non_lora, checkpoint / "non_lora_state_dict.pth")
    adapter = {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "use_rslora": False, "peft_type": "LORA"}
    (checkpoint / "adapter_config.json").write_text(json.dumps(adapter))
    (src / "checkpoint-3").mkdir()  # an older step, left alone: the latest is taken
    (src / "model_config.json").write_text(json.dumps(model_config(max_pixels), indent=4))
    return src, base


def build_tiny_videoalign(model_dir: Path) -> Path:
    """``<model_dir>/videoalign`` converted from a tiny reference checkpoint."""
    from reward_server.scorers.convert_videoalign import convert

    src, base = build_tiny_videoalign_reference(model_dir / "videoalign-reference")
    convert(src, base, model_dir / "videoalign")
    return model_dir
