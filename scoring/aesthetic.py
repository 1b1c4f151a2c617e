"""The ``aesthetic`` reward (LAION's improved aesthetic predictor): MLP(normalised CLIP ViT-L/14 image embedding).

One model, called two ways: the reward server feeds it CLIPImageProcessorPil's pixels of uint8 images; the trainer's
differentiable reward feeds it ``clip_pixels`` of decoded images, the same resize of the short side (bicubic),
centre crop and CLIP normalisation in torch, differentiable in the pixels (tests/unit/test_scoring.py checks it
against the PIL path: within 2 levels of 255 on smooth images; torch's bicubic kernel is a = -0.75, PIL's -0.5).
The MLP keeps LAION's layer indices (no activations; dropout off), so checkpoints load as-is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HEAD_FILES = ("head.safetensors", "head.pth")


class AestheticHead(nn.Module):
    """LAION's aesthetic MLP; ``layers`` keeps the original module indices so checkpoints load as-is."""

    def __init__(self, embed_dim: int = 768) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds_BD: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds_BD)


def load_head_state(path: Path) -> dict[str, torch.Tensor]:
    """The head's state dict from ``.safetensors`` or ``.pth``, with keys as :class:`AestheticHead` names
    them (``layers.N.weight``); bare ``N.weight`` keys get the prefix."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return {key if key.startswith("layers.") else f"layers.{key}": value for key, value in state.items()}


def clip_pixels(images_BCHW: torch.Tensor, processor: Any) -> torch.Tensor:
    """Images in [0, 1] [B, C, H, W] (1 or 3 channels) -> CLIP's input, as ``processor`` (a CLIPImageProcessor)
    makes it from their uint8 form: bicubic resize of the short side to ``size["shortest_edge"]`` (the long side
    int(size * long / short)), centre crop (offsets floored), (x - mean) / std; differentiable in ``images_BCHW``."""
    x = images_BCHW.float().expand(-1, 3, -1, -1) if images_BCHW.shape[1] == 1 else images_BCHW.float()
    height, width = x.shape[-2:]
    size = processor.size["shortest_edge"]
    short, long = min(height, width), max(height, width)
    new = (int(size * long / short), size) if width <= height else (size, int(size * long / short))
    if new != (height, width):
        x = F.interpolate(x, size=new, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)
    crop_h, crop_w = processor.crop_size["height"], processor.crop_size["width"]
    top, left = (new[0] - crop_h) // 2, (new[1] - crop_w) // 2
    x = x[:, :, top : top + crop_h, left : left + crop_w]
    mean = torch.tensor(processor.image_mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def load_aesthetic(root: Path) -> tuple[nn.Module, AestheticHead, Any, Path]:
    """The CLIP vision tower, the head, the image processor and the head's file from ``root`` (laid out as the
    reward server's ``<model_dir>/aesthetic``), in eval mode on the CPU."""
    from transformers import AutoConfig, CLIPVisionModelWithProjection
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from scoring.weights import load_strict

    clip_dir = root / "clip"
    if not (clip_dir / "config.json").is_file():
        raise FileNotFoundError(f"{clip_dir} is not a transformers CLIP checkpoint (no config.json)")
    head_path = next((root / name for name in HEAD_FILES if (root / name).is_file()), None)
    if head_path is None:
        raise FileNotFoundError(f"no aesthetic head in {root}: expected one of {HEAD_FILES}")
    config = AutoConfig.from_pretrained(clip_dir)
    if config.model_type == "clip":  # a full CLIPModel: its vision half, with the model's projection size
        vision_config = config.vision_config
        vision_config.projection_dim = config.projection_dim
    else:
        vision_config = config
    clip = load_strict(CLIPVisionModelWithProjection, clip_dir, "CLIP vision", config=vision_config).eval()
    head = AestheticHead(clip.config.projection_dim)
    head.load_state_dict(load_head_state(head_path))  # strict: a wrong or partial head fails here
    has_processor = (clip_dir / "preprocessor_config.json").is_file()
    processor = CLIPImageProcessorPil.from_pretrained(clip_dir) if has_processor else CLIPImageProcessorPil()
    return clip, head.eval(), processor, head_path


def aesthetic_of_pixels(clip: nn.Module, head: nn.Module, pixels_BCHW: torch.Tensor) -> torch.Tensor:
    """[B] scores of CLIP-preprocessed pixels: head(embedding / |embedding|), the server's and the trainer's."""
    embeds_BD = clip(pixel_values=pixels_BCHW).image_embeds.float()
    return head(embeds_BD / embeds_BD.norm(dim=-1, keepdim=True)).squeeze(-1)


class DifferentiableAesthetic(nn.Module):
    """The aesthetic score of images in [0, 1], differentiable in them (frozen weights from ``model_dir``)."""

    name = "aesthetic"

    def __init__(self, model_dir: str | Path) -> None:
        super().__init__()
        self.clip, self.head, self.processor, _ = load_aesthetic(Path(model_dir) / "aesthetic")

    def forward(self, images_BCHW: torch.Tensor, prompts: list[str], metadata: Any = None) -> torch.Tensor:
        return aesthetic_of_pixels(self.clip, self.head, clip_pixels(images_BCHW, self.processor))
