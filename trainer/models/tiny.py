"""The embedded default model: the real SD3 architecture at a size that trains on two CPU cores.

``build_tiny_sd3`` creates random components from configs (as diffusers' own tests do), with CLIP BPE
tokenizers trained locally with ``tokenizers``, and saves them with ``save_pretrained`` as a diffusers
directory. Model ``tiny`` is the SD3 adapter with ``TinyConfig`` (registry data): it loads that directory, built
first (``build_missing``) when it is missing at the default place (or ``model.build_if_missing``), so the embedded
job exercises exactly the loading and sampling code users run on real SD3 weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.config.fields import LocalPath, PositiveInt
from trainer.models.common import DiffusersModelConfig
from trainer.models.tokenizers import clip_bpe_tokenizer

DEFAULT_TINY_PATH = os.path.join(".cache", "rewardflow", "tiny-sd3-digits")

TINY_TRANSFORMER = dict(
    sample_size=16,
    patch_size=2,
    in_channels=1,
    out_channels=1,
    num_layers=4,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=64,
    pooled_projection_dim=64,
    pos_embed_max_size=16,
)
"""0.6 M parameters; 16x16 one-channel pixels in 2x2 patches = 64 image tokens."""

TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    projection_dim=32,
    max_position_embeddings=77,
    hidden_act="gelu",
)


def build_tiny_sd3(path: str | os.PathLike, seed: int = 0, text_max_length: int = 16) -> Path:
    """Write a random tiny SD3 model (pixel space, two CLIP encoders, no T5) to ``path``; atomic."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    torch.manual_seed(seed)
    SD3Transformer2DModel(**TINY_TRANSFORMER).eval().save_pretrained(tmp / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(tmp / "scheduler")
    for suffix in ("", "_2"):
        clip_bpe_tokenizer(tmp / f"tokenizer{suffix}", text_max_length)
        tok = CLIPTokenizer.from_pretrained(tmp / f"tokenizer{suffix}")
        config = CLIPTextConfig(
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            **TINY_CLIP,
        )
        CLIPTextModelWithProjection(config).eval().save_pretrained(tmp / f"text_encoder{suffix}")
    (tmp / "model_index.json").write_text(
        json.dumps(
            {
                "_class_name": "StableDiffusion3Pipeline",
                "transformer": ["diffusers", "SD3Transformer2DModel"],
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
                "tokenizer": ["transformers", "CLIPTokenizer"],
                "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
                "tokenizer_2": ["transformers", "CLIPTokenizer"],
                "text_encoder_3": [None, None],
                "tokenizer_3": [None, None],
                "vae": [None, None],
            },
            indent=2,
        )
    )
    try:
        os.rename(tmp, path)
    except OSError:
        if not (path / "transformer" / "config.json").is_file():
            raise
        # Another process (rank) finished building first; keep its copy.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


@dataclass
class TinyConfig(DiffusersModelConfig):
    """The embedded SD3-architecture model (the SD3 adapter's settings); built at ``path`` on first use."""

    name: str = "tiny"
    """Registry name of the adapter."""
    path: LocalPath = DEFAULT_TINY_PATH
    """Where the random tiny model lives; built there (atomically) when missing at the default place (a
    ``.cache/rewardflow/tiny-sd3-digits`` folder) or with ``build_if_missing``; any other missing path is refused."""
    max_sequence_length: PositiveInt = 8
    """Zero 'T5' tokens appended like the SD3 pipeline does without T5; kept short for speed."""
    build_if_missing: bool = False
    """Build a random tiny model at a ``path`` other than the default one when nothing is there: off, so that a
    mistyped path is an error, not a new random model that a later run could load as trained weights."""


def build_missing(config: TinyConfig) -> None:
    """Build the tiny model at ``model.path`` when it is not there yet; a ValueError when none may be built there
    (``path_problem``)."""
    if (problem := path_problem(config)) is not None:
        raise ValueError(problem)
    if not (Path(config.path) / "transformer" / "config.json").is_file():
        build_tiny_sd3(config.path)


def path_problem(config: TinyConfig) -> str | None:
    """Why ``model.path`` holds no tiny model and none may be built there, or None (checked by the run's
    pre-flight, before anything loads): a folder of other files, or a missing path that is neither the
    default one nor allowed by ``build_if_missing``."""
    return built_model_problem(config, DEFAULT_TINY_PATH)


def built_model_problem(config, default_path: str) -> str | None:
    """``path_problem`` of an embedded model built on first use whose default folder is ``default_path`` (the
    tiny SD3's, the tiny Wan's)."""
    path = Path(config.path)
    if (path / "transformer" / "config.json").is_file():
        return None
    if path.is_dir() and any(path.iterdir()):
        return (
            f"model.path={config.path!r} holds files but not the tiny model (no transformer/config.json): "
            "point model.path at a new directory, where the tiny model is built, or at one it was built in"
        )
    if config.build_if_missing or is_default_tiny_path(path, default_path):
        return None
    return (
        f"model.path={config.path!r}: no such folder: fix the path, leave model.path unset for the default "
        f"tiny model ({default_path}), or set model.build_if_missing=true to build a new random tiny "
        "model there"
    )


def is_default_tiny_path(path: str | os.PathLike, default_path: str = DEFAULT_TINY_PATH) -> bool:
    """Whether ``path`` is the tiny model's default folder, as given (relative) or as a run's saved config holds it
    (absolute, from the folder that run started in): a resume builds it again where it was removed."""
    return Path(path).parts[-3:] == Path(default_path).parts
