"""The embedded video model: the real Wan architecture (WanTransformer3DModel, a UMT5 text encoder) in pixel space,
at a size that trains on two CPU cores.

``build_tiny_wan`` writes random components (a word-level T5 tokenizer built locally, no hub) as a diffusers
directory without a ``vae``: the Wan adapter then works on the frames themselves, [1, F, 16, 16] in [-1, 1]. Model
``tiny_wan`` is the Wan adapter with ``TinyWanConfig`` (registry data), built on first use like ``tiny``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch

from trainer.config.fields import LocalPath, NonNegativeFloat, PositiveInt
from trainer.models.common import DiffusersModelConfig
from trainer.models.tiny import built_model_problem
from trainer.models.tokenizers import t5_word_tokenizer

DEFAULT_TINY_WAN_PATH = os.path.join(".cache", "rewardflow", "tiny-wan-digits")

TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 4, 4),
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=1,
    out_channels=1,
    text_dim=32,
    freq_dim=64,
    ffn_dim=128,
    num_layers=4,
    rope_max_seq_len=32,
)
"""16x16 one-channel frames in 4x4 patches: 16 tokens a frame, 80 a clip; 4 blocks of 4 heads of 16 (rope: 8/4/4
over frames, rows, columns). 2x2 patches (320 tokens a clip) made a train step 2.8x slower on 2 cores."""

TINY_UMT5 = dict(
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)

WORDS = "a handwritten digit moving left right up down".split() + list("0123456789")
"""The tokenizer's whole-word pieces: every word of the moving digits prompts is one token."""


def build_tiny_wan(path: str | os.PathLike, seed: int = 0, text_max_length: int = 16) -> Path:
    """Write a random pixel-space tiny Wan (transformer, UMT5 encoder, tokenizer, Euler scheduler) to ``path``;
    atomic."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    torch.manual_seed(seed)
    WanTransformer3DModel(**TINY_WAN_TRANSFORMER).eval().save_pretrained(tmp / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(tmp / "scheduler")
    t5_word_tokenizer(tmp / "tokenizer", WORDS, text_max_length)
    tok = T5Tokenizer.from_pretrained(tmp / "tokenizer")
    config = UMT5Config(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, decoder_start_token_id=0
    )
    config.update(TINY_UMT5)
    UMT5EncoderModel(config).eval().save_pretrained(tmp / "text_encoder")
    index = {
        "_class_name": "WanPipeline",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "vae": [None, None],
    }
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
    try:
        os.rename(tmp, path)
    except OSError:
        if not (path / "transformer" / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process (rank) finished building first; keep its copy
    return path


@dataclass
class TinyWanConfig(DiffusersModelConfig):
    """The embedded video model (the Wan adapter's settings, in pixel space): clips of ``frames`` 16x16 frames;
    built at ``path`` on first use. The moving digits task makes 5-frame clips."""

    name: str = "tiny_wan"
    path: LocalPath = DEFAULT_TINY_WAN_PATH
    """Where the random tiny Wan lives; built there when missing at the default place or with
    ``build_if_missing``; any other missing path is refused."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    frames: PositiveInt = 5
    """Frames per clip (no VAE: any count)."""
    height: PositiveInt = 16
    """Frame height in pixels: a multiple of the 4x4 patches."""
    width: PositiveInt = 16
    """Frame width in pixels."""
    fps: PositiveInt = 4
    """Frames per second the clips play at (GIFs, reward metadata)."""
    max_sequence_length: PositiveInt = 8
    """UMT5 tokens per prompt (the longest prompt is 7 with its end token)."""
    flow_shift: NonNegativeFloat = 0.0
    """The schedule's shift; 0 reads the folder's scheduler (shift 1, as the tiny SD3's)."""
    build_if_missing: bool = False
    """Build a random tiny Wan at a ``path`` other than the default one when nothing is there (off: a mistyped
    path is an error, not a new random model)."""

    two_experts: ClassVar[bool] = False


def build_missing(config: TinyWanConfig) -> None:
    """Build the tiny Wan at ``model.path`` when it is not there yet; a ValueError where none may be built."""
    if (problem := path_problem(config)) is not None:
        raise ValueError(problem)
    if not (Path(config.path) / "transformer" / "config.json").is_file():
        build_tiny_wan(config.path)


def path_problem(config: TinyWanConfig) -> str | None:
    """Why ``model.path`` holds no tiny Wan and none may be built there, or None (the run's pre-flight)."""
    return built_model_problem(config, DEFAULT_TINY_WAN_PATH)
