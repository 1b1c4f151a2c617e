"""Tiny random models for the model-based scorers, saved with ``save_pretrained`` into a ``--model-dir``
layout and loaded back through the scorers' own loading code. Random weights: their scores mean nothing;
tests check plumbing and math, never quality. Fixtures built from these live in tests/conftest.py and
tests/unit/conftest.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from fixtures_geneval import build_tiny_geneval
from fixtures_hps import build_tiny_hps
from fixtures_hpsv3 import build_tiny_hpsv3
from fixtures_imagereward import build_tiny_imagereward
from fixtures_videoalign import build_tiny_videoalign

QWEN_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def build_tiny_aesthetic(model_dir: Path, *, head_format: str = "pth") -> Path:
    """``<model_dir>/aesthetic/{clip/, head.<format>}``: a full tiny CLIPModel (projection 768, as ViT-L/14's)
    and a random LAION head saved under the original key names (``layers.N.*``)."""
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from reward_server.scorers.aesthetic import AestheticHead

    torch.manual_seed(0)
    root = model_dir / "aesthetic"
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        vision_config={**small, "image_size": 32, "patch_size": 8},
        text_config={**small, "vocab_size": 64},
        projection_dim=768,
    )
    CLIPModel(config).save_pretrained(root / "clip")
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        root / "clip"
    )
    # Weights x4 so that a unit-norm embedding gives scores of order 1, not 1e-3: tight math checks.
    state = {
        key: value * 4 if key.endswith("weight") else value for key, value in AestheticHead(768).state_dict().items()
    }
    if head_format == "pth":
        torch.save(state, root / "head.pth")
    else:
        from safetensors.torch import save_file

        save_file({key.removeprefix("layers."): value for key, value in state.items()}, root / "head.safetensors")
    return model_dir


def build_tiny_clip_score(model_dir: Path, name: str, *, processor_subfolder: bool) -> Path:
    """``<model_dir>/<name>/``: a full tiny CLIPModel (text context 16 tokens) with a locally built CLIP
    tokenizer (model_max_length 77, as the real ones) and a PIL image processor, in ``processor/`` (as
    PickScore's, which come from another repository) or beside the weights."""
    from tiny_models import clip_tokenizer
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(1)
    root = model_dir / name
    processor_dir = root / "processor" if processor_subfolder else root
    tokenizer = clip_tokenizer(processor_dir, max_length=77)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = CLIPConfig(
        vision_config={**small, "image_size": 32, "patch_size": 8},
        text_config={
            **small,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 16,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        projection_dim=24,
    )
    CLIPModel(config).save_pretrained(root)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        processor_dir
    )
    return root


def build_tiny_qwen_vl(path: Path, *, variant: str = "qwen2_5_vl") -> Path:
    """A random 1-layer Qwen2-VL or Qwen2.5-VL (hidden 32, 1-block vision tower) with a byte-level
    Qwen2Tokenizer (256 byte tokens, no merges, Qwen's chat and vision special tokens) and a PIL image
    processor config, all saved with ``save_pretrained`` into ``path``."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vocab = {"<|endoftext|>": 0}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], additional_special_tokens=list(QWEN_SPECIAL_TOKENS))
    ids = dict(zip(QWEN_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(QWEN_SPECIAL_TOKENS)), strict=True))
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = {"depth": 1, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    special = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    torch.manual_seed(0)
    if variant == "qwen2_5_vl":
        vision.update(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=32,
            window_size=56,
            fullatt_block_indexes=[0],
        )
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special))
    elif variant == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=32, mlp_ratio=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **special))
    else:
        raise ValueError(f"unknown variant {variant!r}")
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # At most 112x112 pixels: 16 image tokens per image after the 2x2 merge, so tests stay fast.
    Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}).save_pretrained(path)
    return path


def rig_digits(model_dir: Path, weights: dict[str, float]) -> Path:
    """Rewrite the model so that the first answer token's logits are ``weight * c`` for the given digits
    and 0 for every other token (c > 0 the same for all): every token embedding gets a large first
    coordinate, which dominates the last hidden state, and the output head reads only that coordinate."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 40.0
        head = model.get_output_embeddings().weight
        head.zero_()
        for digit, weight in weights.items():
            (token_id,) = tokenizer.encode(digit, add_special_tokens=False)
            head[token_id, 0] = weight
    model.save_pretrained(model_dir)
    return model_dir


def rig_answer(model_dir: Path, answer: str) -> Path:
    """Rewrite the model so that its greedy answer to any question is ``answer`` then ``<|im_end|>``: attention
    and MLP outputs are zeroed, so each position's logits depend on its own token alone, and the embeddings and
    output head form a lookup table from each token to the next ("\n", the prompt's last token, to the first).
    The answer's characters must be distinct single byte tokens (at most hidden size - 1 of them)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chain = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize("\n" + answer)] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    assert len(chain) == len(set(chain)) == len(answer) + 2, "the answer needs distinct one-byte characters"
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")) and ".visual." not in name:
                parameter.zero_()
        embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embeddings.zero_()
        head.zero_()
        for slot, (token, following) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
            embeddings[token, slot] = 1.0
            head[following, slot] = 10.0
    model.save_pretrained(model_dir)
    return model_dir


# For the registry-wide conformance test: what each model-based scorer needs to score random images.
CONFORMANCE_METADATA: dict[str, dict[str, Any]] = {
    "ocr": {"text": "digit"},
    "ocr_flow_grpo": {"text": "digit"},
    "motion": {"direction": "up"},
}
CONFORMANCE_METADATA["videoalign"] = {"fps": 8.0}  # a video's fps, which the server puts in every video item
for _name in ("geneval", "geneval_partial", "geneval_flow_grpo"):
    CONFORMANCE_METADATA[_name] = {"tag": "single_object", "include": [{"class": "bowl", "count": 1}]}
CONFORMANCE_SKIP: dict[str, str] = {
    "ocr_paddle": "runs under .venv-paddle (PaddleOCR pins its own numpy and OpenCV): "
    "tests/integration/test_ocr_paddle.py",
    "qwenvl_api": "needs a judge server (tested in test_scorer_qwenvl.py against a local one)",
    "unifiedreward_api": "needs a judge server (tested in test_scorer_unifiedreward.py against a local one)",
}


def build_conformance_model_dir(model_dir: Path) -> Path:
    """One ``--model-dir`` serving every model-based scorer that can run offline: a tiny aesthetic
    predictor, tiny PickScore and CLIP score models, and tiny Qwen2.5-VLs rigged to answer "4" and
    "Final Score:4" (a random judge's answers are PARSE errors), and tiny HPSv3 and VideoReward checkpoints."""
    build_tiny_aesthetic(model_dir)
    build_tiny_clip_score(model_dir, "pickscore", processor_subfolder=True)
    build_tiny_clip_score(model_dir, "clipscore", processor_subfolder=False)
    rig_digits(build_tiny_qwen_vl(model_dir / "qwenvl"), {"4": 5.0})
    rig_answer(build_tiny_qwen_vl(model_dir / "unifiedreward"), "Final Score:4")
    build_tiny_geneval(model_dir)
    build_tiny_hps(model_dir)
    build_tiny_imagereward(model_dir)
    build_tiny_hpsv3(model_dir)
    build_tiny_videoalign(model_dir)
    return model_dir
