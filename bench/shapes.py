"""The benchmarks' model shapes: per registered adapter, the resolution and guidance bench/adapters.py runs it
at, and its denoiser's config changes for about 9 M parameters (``--denoiser 9m``) and for the published
architecture's widths, heads and depths (``--denoiser real``), applied to the tests' tiny model
(tests/tiny_models) by ``resize_denoiser``."""

from __future__ import annotations

import gc
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import tiny_models  # tests/tiny_models: the scripts put tests/ on the path
import torch

SD3_9M = dict(attention_head_dim=64, num_attention_heads=4, num_layers=4, caption_projection_dim=256)
"""About 9 M parameters."""
SD3_REAL = dict(
    attention_head_dim=64,
    num_attention_heads=24,
    num_layers=24,
    caption_projection_dim=1536,
    qk_norm="rms_norm",
    dual_attention_layers=list(range(13)),
)
"""SD3.5 Medium's widths, heads and depths (2.23 B parameters)."""
SD35_LARGE = dict(
    attention_head_dim=64,
    num_attention_heads=38,
    num_layers=38,
    caption_projection_dim=2432,
    qk_norm="rms_norm",
    dual_attention_layers=[],
)
"""SD3.5 Large's widths, heads and depths (8.1 B parameters published)."""
FLUX_9M = dict(
    attention_head_dim=64, num_attention_heads=4, num_layers=2, num_single_layers=4, axes_dims_rope=[16, 24, 24]
)
"""About 9 M parameters."""
FLUX_REAL = dict(
    attention_head_dim=128, num_attention_heads=24, num_layers=19, num_single_layers=38, axes_dims_rope=[16, 56, 56]
)
"""FLUX.1's widths, heads and depths (11.89 B parameters)."""
CHROMA_9M = dict(
    attention_head_dim=64,
    num_attention_heads=4,
    num_layers=2,
    num_single_layers=6,
    axes_dims_rope=[16, 24, 24],
    approximator_num_channels=64,
    approximator_hidden_dim=512,
    approximator_layers=2,
)
"""About 9 M parameters."""
CHROMA_REAL = dict(
    attention_head_dim=128,
    num_attention_heads=24,
    num_layers=19,
    num_single_layers=38,
    axes_dims_rope=[16, 56, 56],
    approximator_num_channels=64,
    approximator_hidden_dim=5120,
    approximator_layers=5,
)
"""Chroma1-HD's published widths, heads, depths and approximator (diffusers' defaults; 8.9 B parameters)."""
QWEN_9M = dict(attention_head_dim=64, num_attention_heads=4, num_layers=4, axes_dims_rope=[16, 24, 24])
"""About 9 M parameters."""
QWEN_REAL = dict(attention_head_dim=128, num_attention_heads=24, num_layers=60, axes_dims_rope=[16, 56, 56])
"""Qwen-Image's widths, heads and depths (20.42 B parameters)."""
QWEN21_9M = dict(attention_head_dim=64, num_attention_heads=4, num_layers=10, mlp_ratio=3, axes_dims_rope=[16, 24, 24])
"""About 9 M parameters (13 d^2 per single-stream block at width d = 256)."""
QWEN21_REAL = dict(
    attention_head_dim=128, num_attention_heads=32, num_layers=32, mlp_ratio=3, axes_dims_rope=[16, 56, 56]
)
"""Qwen-Image 2.1's widths, heads and depths (diffusers' defaults: 7 B parameters)."""
FLUX2_9M = dict(
    attention_head_dim=64, num_attention_heads=4, num_layers=2, num_single_layers=4, axes_dims_rope=(16, 16, 16, 16)
)
"""About 9 M parameters (FLUX.2 [dev] and Klein)."""
FLUX2_REAL = dict(
    attention_head_dim=128, num_attention_heads=48, num_layers=8, num_single_layers=48, axes_dims_rope=(32, 32, 32, 32)
)
"""FLUX.2 [dev]'s widths, heads and depths (diffusers' defaults; the text width stays the tiny encoder's)."""
KLEIN_REAL = dict(
    attention_head_dim=128, num_attention_heads=24, num_layers=5, num_single_layers=20, axes_dims_rope=(32, 32, 32, 32)
)
"""FLUX.2 [klein] 4B's widths, heads and depths (the text width stays the tiny encoder's)."""
SD15_REAL = dict(
    block_out_channels=[320, 640, 1280, 1280],
    attention_head_dim=8,
    norm_num_groups=32,
    down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
)
"""The SD1.5 UNet's widths and blocks (0.84 B parameters: its cross-attention reads the tiny text width)."""
Z_IMAGE_9M = dict(dim=256, n_layers=5, n_refiner_layers=2, n_heads=4, n_kv_heads=4, axes_dims=[16, 24, 24])
"""About 9 M parameters."""
Z_IMAGE_REAL = dict(
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    axes_dims=[32, 48, 48],
    axes_lens=[1024, 512, 512],
)
"""Z-Image's published widths, heads and depths (diffusers' defaults; the text width stays the tiny
encoder's instead of Qwen3-4B's 2560)."""


WAN_9M = dict(attention_head_dim=64, num_attention_heads=4, num_layers=8, ffn_dim=1024, freq_dim=256)
"""About 9 M parameters (9.05 M; Wan 2.2 A14B: per expert)."""
WAN_REAL = dict(
    attention_head_dim=128, num_attention_heads=12, num_layers=30, ffn_dim=8960, freq_dim=256, rope_max_seq_len=1024
)
"""Wan 2.1 T2V 1.3B's widths, heads and depths (huggingface/diffusers scripts/convert_wan_to_diffusers.py,
Wan-T2V-1.3B): 1.41 B parameters here, 1.3 B published (1.42 B at its 4096-wide text input)."""
WAN_14B = dict(WAN_REAL, num_attention_heads=40, num_layers=40, ffn_dim=13824)
"""Wan 2.1 T2V 14B's, and each Wan 2.2 A14B expert's (same script: Wan-T2V-14B, Wan2.2-T2V-A14B,
Wan2.2-I2V-14B-720p): 14.27 B parameters per transformer here, 14 B published."""
WAN_I2V_9M = dict(WAN_9M, num_layers=7, added_kv_proj_dim=256)
"""About 9 M parameters (8.94 M): the image tokens' own key and value projections at the model width."""
WAN_I2V_REAL = dict(WAN_14B, added_kv_proj_dim=5120)
"""Wan 2.1 I2V 14B's (same script: Wan-I2V-14B-480p; CLIP's 1280-wide image input stays the tiny tower's):
16.37 B parameters here, published as 14 B."""
WAN_TI2V_REAL = dict(WAN_REAL, num_attention_heads=24, ffn_dim=14336)
"""Wan 2.2 TI2V-5B's (same script: Wan2.2-TI2V-5B; its 48 latent channels stay the tiny VAE's): 4.99 B
parameters here, 5 B published."""
HUNYUAN_VIDEO15_9M = dict(
    attention_head_dim=64, num_attention_heads=3, num_layers=4, num_refiner_layers=1, rope_axes_dim=(16, 24, 24)
)
"""About 9 M parameters (9.63 M)."""
HUNYUAN_VIDEO15_REAL = dict(
    attention_head_dim=128, num_attention_heads=16, num_layers=54, num_refiner_layers=2, rope_axes_dim=(16, 56, 56)
)
"""HunyuanVideo 1.5's widths, heads and depths (diffusers' HunyuanVideo15Transformer3DModel defaults, which
huggingface/diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py builds every checkpoint from): 8.31 B
parameters here, 8.3 B published."""
LTX2_9M = dict(
    attention_head_dim=64,
    num_attention_heads=4,
    cross_attention_dim=256,
    audio_attention_head_dim=32,
    audio_num_attention_heads=4,
    audio_cross_attention_dim=128,
    num_layers=5,
)
"""About 9 M parameters (9.14 M): a 256-wide video stream and a 128-wide audio stream."""
LTX2_REAL = dict(
    attention_head_dim=128,
    num_attention_heads=32,
    cross_attention_dim=4096,
    audio_attention_head_dim=64,
    audio_num_attention_heads=32,
    audio_cross_attention_dim=2048,
    num_layers=48,
)
"""LTX-2's: a 4096-wide video stream and a 2048-wide audio stream, 48 blocks (huggingface/diffusers
scripts/convert_ltx2_to_diffusers.py, version 2.0; the 3840-wide caption input stays the tiny connectors'):
18.85 B parameters here, 19 B published."""


@dataclass(frozen=True)
class BenchShape:
    """One adapter's benchmark sizes."""

    resolution: int | None
    """``model.resolution``: 256 image tokens (latent positions for the UNet) per sample; None keeps the tiny
    model's own (the video models': their frames, height and width; they refuse ``model.resolution``)."""
    guidance: float
    """The guidance scale of the benchmark's rollouts."""
    denoiser_9m: dict[str, Any]
    """Denoiser config changes for about 9 M parameters."""
    denoiser_real: dict[str, Any]
    """Denoiser config changes to the published widths, heads and depths."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Other published sizes of the same architecture by name, as ``denoiser_real`` (case ``name@variant``)."""


_SD3 = BenchShape(16, 4.5, SD3_9M, SD3_REAL, {"large": SD35_LARGE})
_FLUX = BenchShape(32, 3.5, FLUX_9M, FLUX_REAL)
_CHROMA = BenchShape(32, 4.0, CHROMA_9M, CHROMA_REAL)
_QWEN = BenchShape(128, 4.5, QWEN_9M, QWEN_REAL)
_KLEIN = BenchShape(32, 4.0, FLUX2_9M, KLEIN_REAL)
_HUNYUAN_VIDEO15 = BenchShape(None, 6.0, HUNYUAN_VIDEO15_9M, HUNYUAN_VIDEO15_REAL)
SHAPES: dict[str, BenchShape] = {
    "tiny": BenchShape(None, 4.5, SD3_9M, SD3_REAL, {"large": SD35_LARGE}),
    "sd3": _SD3,
    "flux": _FLUX,
    "flux_fill": _FLUX,
    "flux_kontext": _FLUX,
    "chroma": _CHROMA,
    "chroma_inpaint": _CHROMA,
    "sd15_inpaint": BenchShape(32, 4.5, dict(block_out_channels=[96, 192]), SD15_REAL),
    "qwen_image": _QWEN,
    "z_image": BenchShape(32, 4.0, Z_IMAGE_9M, Z_IMAGE_REAL),
    "qwen_image21": BenchShape(256, 1.0, QWEN21_9M, QWEN21_REAL),
    "qwen_image_edit": _QWEN,
    "qwen_image_edit_plus": _QWEN,
    "qwen_image_inpaint": _QWEN,
    "qwen_image_edit_inpaint": _QWEN,
    "flux2": BenchShape(32, 4.0, FLUX2_9M, FLUX2_REAL),
    "flux2_klein": _KLEIN,
    "flux2_klein_inpaint": _KLEIN,
    "tiny_wan": BenchShape(None, 5.0, WAN_9M, WAN_REAL, {"14b": WAN_14B}),
    "wan": BenchShape(None, 5.0, WAN_9M, WAN_REAL, {"14b": WAN_14B}),
    "wan22": BenchShape(None, 5.0, WAN_9M, WAN_14B),
    "wan_i2v": BenchShape(None, 5.0, WAN_I2V_9M, WAN_I2V_REAL),
    "wan22_i2v": BenchShape(None, 5.0, WAN_9M, WAN_14B),
    "wan_ti2v": BenchShape(None, 5.0, WAN_9M, WAN_TI2V_REAL),
    "hunyuan_video15": _HUNYUAN_VIDEO15,
    "hunyuan_video15_i2v": _HUNYUAN_VIDEO15,  # SigLIP's 1152-wide image input stays the tiny tower's
    "ltx2": BenchShape(None, 3.0, LTX2_9M, LTX2_REAL),
}
"""Registered model name -> its benchmark sizes."""


def denoiser_shape(name: str, denoiser: str, variant: str = "") -> dict[str, Any] | None:
    """The config changes of ``name``'s denoiser for ``--denoiser`` (a DENOISER_SIZES key) and a published
    ``variant`` (``--denoiser real`` only); None for the tiny model as it is."""
    shape = SHAPES[name]
    if variant:
        if denoiser != "real" or variant not in shape.variants:
            raise ValueError(f"{name}@{variant}: a variant needs --denoiser real and one of {sorted(shape.variants)}")
        return shape.variants[variant]
    return getattr(shape, DENOISER_SIZES[denoiser]) if DENOISER_SIZES[denoiser] else None


DENOISER_SIZES = {"tiny": None, "9m": "denoiser_9m", "real": "denoiser_real"}
"""``--denoiser`` -> the ``BenchShape`` field with the denoiser's config changes. 9m: 9.0-9.7 M parameters (the
UNet 12.6 M: its widths step by 32). real: the published architectures' widths, heads and depths; the widths
that face the tiny text encoders and VAEs (joint / pooled / cross-attention input widths, latent channels,
patch sizes) stay the tiny ones, a few projections' worth of difference."""
DENOISER_FOLDERS = ("transformer", "transformer_2", "unet")
"""A model folder's denoisers that ``resize_denoiser`` resizes: Wan 2.2 A14B's second expert as its first."""
DEPTH_KEYS = ("num_layers", "num_single_layers", "n_layers", "n_refiner_layers")
"""Config fields that ``--layers`` caps (transformers; the UNet's depth stays)."""


def storage_dtype(cls: type, config: dict, dtype: str, folder: Path, store: str = "auto") -> str:
    """The dtype ``resize_denoiser`` saves a denoiser of ``config`` in: ``dtype``, or float8_e5m2 (``store``, or
    ``auto`` when the ``dtype`` copy would leave under a tenth of ``folder``'s disk free: FLUX.2 [dev]'s 32 B
    parameters take 64 GB in bfloat16). The adapter loads it back in ``dtype``: the same kernels and shapes,
    on random weights rounded to two mantissa bits."""
    if store != "auto":
        return store
    with torch.device("meta"):
        size = sum(p.numel() for p in cls.from_config(config).parameters()) * getattr(torch, dtype).itemsize
    free = shutil.disk_usage(folder).free
    if size <= 0.9 * free:
        return dtype
    print(
        f"note: {size / 1e9:.1f} GB of {dtype} weights, {free / 1e9:.1f} GB free on disk: saved in float8_e5m2 "
        f"and loaded back in {dtype}",
        file=sys.stderr,
        flush=True,
    )
    return "float8_e5m2"


def resize_denoiser(
    root: str,
    name: str,
    overrides: dict,
    max_layers: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    store: str = "auto",
) -> None:
    """Build the tiny model of ``name`` under ``root`` and replace its denoiser (each of Wan 2.2's two experts)
    by one with ``overrides`` applied to its config (random weights), at most ``max_layers`` blocks per stack
    when given. The weights are drawn on ``device`` in ``dtype`` and saved so (``storage_dtype``: float8 where
    they would not fit the disk): a real-size one in float32 on the CPU would take 82 GB for Qwen-Image."""
    tiny_models.tiny_config(name, root)
    for folder in (Path(root) / name / f for f in DENOISER_FOLDERS):
        if folder.is_dir():
            _resize(folder, overrides, max_layers, device, dtype, store)


def _resize(folder: Path, overrides: dict, max_layers: int | None, device: str, dtype: str, store: str) -> None:
    """``resize_denoiser`` for the denoiser saved in ``folder``."""
    config = {**json.loads((folder / "config.json").read_text()), **overrides}
    if max_layers is not None:
        config.update({k: min(config[k], max_layers) for k in DEPTH_KEYS if k in config})
        if "dual_attention_layers" in config:
            config["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < config["num_layers"]]
    cls = getattr(diffusers, config["_class_name"])
    saved = storage_dtype(cls, config, dtype, folder, store)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = cls.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval().to(getattr(torch, saved)).save_pretrained(folder)
    del model
    gc.collect()  # a real-size denoiser's weights leave the GPU before the adapter loads its copy
