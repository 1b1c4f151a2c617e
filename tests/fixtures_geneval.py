"""A tiny random ``geneval`` model directory: Mask2Former (1-block-per-stage Swin, 10 queries) and CLIP,
saved with ``save_pretrained`` in the layout the scorer documents. Random weights: plumbing only."""

from __future__ import annotations

from pathlib import Path

import torch

# The COCO spellings transformers' Mask2Former checkpoints use for three of GenEval's classes.
DETECTOR_SPELLINGS = {"computer mouse": "mouse", "tv remote": "remote", "computer keyboard": "keyboard"}


def build_tiny_geneval(model_dir: Path, *, favour: str | None = None) -> Path:
    """``<model_dir>/geneval/{detector,clip}/``. ``favour``: a class every query predicts with
    probability ~1 (the class head's bias rigged), so that detections and colour checks happen."""
    from tiny_models import clip_tokenizer
    from transformers import (
        CLIPConfig,
        CLIPModel,
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        SwinConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.mask2former.image_processing_pil_mask2former import Mask2FormerImageProcessorPil

    from reward_server.scorers.geneval_rules import OBJECT_NAMES

    root = model_dir / "geneval"
    labels = {i: DETECTOR_SPELLINGS.get(name, name) for i, name in enumerate(OBJECT_NAMES)}
    torch.manual_seed(2)
    swin = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=swin,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        num_queries=10,
        id2label=labels,
        label2id={name: i for i, name in labels.items()},
    )
    detector = Mask2FormerForUniversalSegmentation(config).eval()
    if favour is not None:
        with torch.no_grad():
            detector.class_predictor.weight.zero_()
            detector.class_predictor.bias.zero_()
            detector.class_predictor.bias[OBJECT_NAMES.index(favour)] = 20.0
    detector.save_pretrained(root / "detector")
    Mask2FormerImageProcessorPil(size={"shortest_edge": 64, "longest_edge": 128}).save_pretrained(root / "detector")

    tokenizer = clip_tokenizer(root / "clip", max_length=77)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    clip_config = CLIPConfig(
        vision_config={**small, "image_size": 32, "patch_size": 8},
        text_config={
            **small,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        projection_dim=24,
    )
    CLIPModel(clip_config).eval().save_pretrained(root / "clip")
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(
        root / "clip"
    )
    return model_dir
