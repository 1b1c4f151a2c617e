"""The FLUX.1 latent layout, which the FLUX.1 and Chroma families share: the VAE's latents shifted and scaled,
cut into 2x2 patches and packed to tokens [B, (h/2)(w/2), 4C], with the image tokens' position ids. The packing
is the pipelines' own (their static ``_pack_latents``, ``_unpack_latents``, ``_prepare_latent_image_ids``)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.samplers import standard_normal


class PackedLatents:
    """One adapter's FLUX.1-layout latents at ``resolution`` pixels, for its ``vae`` and ``pipeline_class``."""

    def __init__(self, vae: nn.Module, pipeline_class: type, resolution: int, device: torch.device, dtype):
        self.vae, self.pipeline_class, self.device, self.dtype = vae, pipeline_class, device, dtype
        self.vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)  # as the pipelines' vae_scale_factor
        if resolution <= 0 or resolution % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={resolution} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = resolution
        self.channels = vae.config.latent_channels
        self.tokens_side = resolution // self.vae_factor // 2
        self.shape = (self.tokens_side**2, 4 * self.channels)
        """One sample's packed latents: (tokens, 4C)."""
        side = self.tokens_side
        self.img_ids = pipeline_class._prepare_latent_image_ids(1, side, side, device, dtype)

    def noise(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, h, w] packed to tokens, drawn as the pipelines' ``prepare_latents`` draw it."""
        h = self.resolution // self.vae_factor
        noise = standard_normal((batch_size, self.channels, h, h), generator, self.device)
        return self.pipeline_class._pack_latents(noise, batch_size, self.channels, h, h)

    def vae_input(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the VAE's input: mapped to [-1, 1] in float32, then cast once."""
        return (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)

    @torch.no_grad()
    def vae_encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [B, 3, H, W] -> scaled, unpacked latents [B, C, H/f, W/f] (posterior mean)."""
        return self.scale(self.vae.encode(self.vae_input(images)).latent_dist.mode())

    def scale(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the shifted and scaled ones the transformer works in, float32."""
        return (latents.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, (h/2)(w/2), 4C] tokens."""
        b, c, h, w = latents.shape
        return self.pipeline_class._pack_latents(latents, b, c, h, w)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> packed latents (the inverse of ``decode``) for supervised targets."""
        return self.pack(self.vae_encode(images))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed latents -> images in [0, 1], float32, [B, 3, H, W]."""
        x = self.pipeline_class._unpack_latents(latents.float(), self.resolution, self.resolution, self.vae_factor)
        x = x / self.vae.config.scaling_factor + self.vae.config.shift_factor
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """True where to repaint, per packed latent entry (``fold_mask``; Chroma's inpainting)."""
        side = self.resolution // self.vae_factor
        return fold_mask(mask, side, self.channels, self.pipeline_class._pack_latents, self.device)


def fold_mask(mask: torch.Tensor, side: int, channels: int, pack, device: torch.device) -> torch.Tensor:
    """True where to repaint, per packed latent entry: ``mask`` [B, 1, H, W] binarised at 0.5 and folded to the
    ``side`` x ``side`` latent grid of ``channels`` channels, then packed by ``pack`` (a pipeline's
    ``_pack_latents``), as the Qwen-Image and FLUX-layout (Chroma) pipelines' ``prepare_mask_latents`` do."""
    grid = nn.functional.interpolate((mask.to(device, torch.float32) >= 0.5).float(), size=(side, side))
    return pack(grid.repeat(1, channels, 1, 1), mask.shape[0], channels, side, side) > 0.5
