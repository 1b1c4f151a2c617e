"""FLUX.1 Fill (inpainting/outpainting): FLUX.1-dev whose transformer also reads the masked image and mask.

The masked image (pixels where mask >= 0.5 zeroed, as ``FluxFillPipeline`` does) is VAE-encoded with the
posterior mean and packed; the mask is folded to the latent grid and packed by the pipeline's own
``prepare_mask_latents``. Both are concatenated to the packed latents along channels at every forward:
[latents | masked-image latents | mask] -> the 20-channel (tiny) or 384-channel (real) input.
The pipeline samples the posterior instead of taking its mean; everything after that is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.flux import FluxAdapter, FluxConfig
from trainer.models.inputs import reject_image_inputs, require_image_input


@dataclass
class FluxFillConfig(FluxConfig):
    """FLUX.1 Fill weights; same settings as FLUX.1-dev."""

    name: str = "flux_fill"
    """Registry name of the adapter."""


class FluxFillAdapter(FluxAdapter):
    """ModelAdapter for FLUX.1 Fill: needs ``ImageInputs.image`` and ``.mask`` (1 = repaint) per prompt."""

    config_class = FluxFillConfig
    pipeline_class = Imported("diffusers:FluxFillPipeline")
    model_name = "flux_fill"
    encodes_image_inputs = True

    def _extra_input_channels(self) -> int:
        # Packed 2x2: the masked image's latents, and the mask folded from vae_factor^2 pixels per latent.
        return 4 * self.latent_channels + 4 * self.vae_factor**2

    @torch.no_grad()
    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: packed masked-image latents; ``mask``: the packed mask, as the pipeline makes them. The
        masked image's posterior is read from ``model.image_latents`` when it holds it."""
        reject_image_inputs(self.model_name, inputs, allowed=("image", "mask"))
        size = (self.resolution, self.resolution)
        image = require_image_input(self.model_name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(self.model_name, inputs, "mask", batch_size, 1, size)
        mask = (mask.to(self.device, torch.float32) >= 0.5).float()
        masked = (image.to(self.device, torch.float32) * 2 - 1) * (1 - mask)
        latents = self.image_latents(masked.to(self.dtype)).mode()
        mask_tokens, image_tokens = self.pipeline.prepare_mask_latents(
            mask,
            latents,
            batch_size,
            self.latent_channels,
            1,
            self.resolution,
            self.resolution,
            self.dtype,
            self.device,
            None,
        )
        return {"image": image_tokens, "mask": mask_tokens}

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        if cond.image is None or cond.mask is None:
            raise ValueError("flux_fill needs Conditioning.image and .mask: encode prompts with ImageInputs")
        return torch.cat([x, cond.image.to(x.dtype), cond.mask.to(x.dtype)], dim=2), self.img_ids
