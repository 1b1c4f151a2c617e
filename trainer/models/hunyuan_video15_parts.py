"""HunyuanVideo 1.5's image-to-video conditioning (registry data, ``ModelSpec.parts``): the first frame VAE-encoded
as condition channels with their mask, and its SigLIP tokens as the transformer's image embeddings, as
``HunyuanVideo15ImageToVideoPipeline`` builds them (trainer/models/hunyuan_video15.py is the adapter)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.models.base import ImageInputs
from trainer.models.inputs import require_image_input


def as_8bit(image: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3] on the host: the pictures a user hands the pipeline."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


@dataclass(frozen=True)
class FirstFrame:
    """The first frame (``ImageInputs.image`` [B, 3, H, W] at the video's size) as the image-to-video pipeline
    conditions on it, taken as the 8-bit picture the pipeline is given: its VAE latents (posterior mean times the
    scaling factor) on the first latent frame of C condition channels, zeros after it, and a mask channel that is 1
    there, concatenated to the latents at every forward; and SigLIP's last hidden states of the picture as
    ``image_embeds``, which every text token sequence of the transformer attends to."""

    fields = ("image",)
    encodes_text = False
    reads_trajectory = False

    def components(self, path: Path, dtype: torch.dtype, device: torch.device) -> dict:
        """The pipeline's ``image_encoder`` (SiglipVisionModel, frozen) and ``feature_extractor``."""
        from transformers import SiglipImageProcessor, SiglipVisionModel

        encoder = SiglipVisionModel.from_pretrained(path, subfolder="image_encoder", torch_dtype=dtype).to(device)
        processor = SiglipImageProcessor.from_pretrained(path, subfolder="feature_extractor")
        return {"image_encoder": encoder.requires_grad_(False).eval(), "feature_extractor": processor}

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the first frame's latents [B, C, 1, h, w], float32 (the VAE's dtype's values); ``image_embeds``
        (an entry of ``Conditioning.embeds``): its SigLIP tokens [B, N, D] in the weights' dtype."""
        size = (adapter.height, adapter.width)
        because = "it generates the video from that first frame"
        fix = "(model.height, model.width): set both to data.image_size (the data's images are square)"
        image = require_image_input(
            adapter.config.name, inputs, "image", batch_size, 3, size, because=because, size_fix=fix
        )
        pictures = as_8bit(image)
        pixels = (pictures.to(adapter.device, torch.float32) / 255.0).permute(0, 3, 1, 2) * 2.0 - 1.0
        posterior = adapter.image_latents(pixels.to(adapter.vae.dtype)[:, :, None])
        latents = (posterior.mode() * adapter.vae.config.scaling_factor).float()
        return {"image": latents, "image_embeds": siglip_tokens(adapter.pipeline, pictures, adapter.device)}

    def join(self, adapter, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition channels [B, C + 1, F, h, w] and image embeddings [B, N, D], in the weights' dtype."""
        if cond.image is None:
            raise ValueError(f"{adapter.config.name} needs Conditioning.image: encode prompts with ImageInputs.image")
        first = cond.image.to(adapter.dtype)
        n, channels, _, h, w = first.shape
        frames = adapter.latent_shape[1]
        condition = torch.cat([first, first.new_zeros(n, channels, frames - 1, h, w)], dim=2)
        mask = first.new_zeros(n, 1, frames, h, w)
        mask[:, :, 0] = 1
        return torch.cat([condition, mask], dim=1), cond.embeds["image_embeds"].to(adapter.dtype)


def siglip_tokens(pipeline, pictures: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``HunyuanVideo15ImageToVideoPipeline._get_image_embeds`` of each picture (uint8 [B, H, W, 3]): SigLIP's last
    hidden states [B, N, D] in the weights' dtype, one forward per distinct picture, so that a row's tokens do not
    depend on its batch-mates (batched matmuls round differently)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline as Pipeline
    from PIL import Image

    from trainer.models.latents import vae_input_key

    dtype = pipeline.transformer.dtype
    seen: dict[str, torch.Tensor] = {}
    rows = []
    for picture in pictures:
        key = vae_input_key(picture)
        if key not in seen:
            picture = Image.fromarray(picture.numpy())
            seen[key] = Pipeline._get_image_embeds(pipeline.image_encoder, pipeline.feature_extractor, picture, device)
        rows.append(seen[key].to(dtype))
    return torch.cat(rows)


FIRST_FRAME = FirstFrame()
"""HunyuanVideo 1.5 I2V (480p, 720p): the first frame as condition channels and SigLIP tokens."""
