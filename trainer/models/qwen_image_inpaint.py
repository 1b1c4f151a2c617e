"""Qwen-Image inpainting (``QwenImageInpaintPipeline``): the Qwen-Image weights, repainting where the mask is 1.

Qwen-Image's transformer reads no mask: the pipeline keeps the known region on the noised source latents by
blending after every step, x <- (1 - m) (sigma' eps + (1 - sigma') z) + m x, with eps the initial noise and z
the source's latents. Here the same trajectory comes from the prediction alone: in the known region the
velocity is replaced by (x - z) / sigma, the one whose clean estimate x - sigma v is z, so an Euler step from
sigma eps + (1 - sigma) z lands on sigma' eps + (1 - sigma') z. The rollout equals the pipeline (strength 1)
up to rounding, and the known region's log-prob terms do not depend on the policy (no gradient, ratio 1).
Its mask is binary, so the velocity needs no trajectory (``flow.inpaint_velocity`` without the initial noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.flow import inpaint_velocity
from trainer.models.inputs import reject_image_inputs, require_image_input
from trainer.models.qwen_image import QwenImageAdapter, QwenImageConfig


@dataclass
class QwenImageInpaintConfig(QwenImageConfig):
    """Qwen-Image weights (the inpainting pipeline has no weights of its own); same settings as Qwen-Image."""

    name: str = "qwen_image_inpaint"
    """Registry name of the adapter."""


class QwenImageInpaintAdapter(QwenImageAdapter):
    """ModelAdapter for Qwen-Image inpainting: needs ``ImageInputs.image`` and ``.mask`` (1 = repaint)."""

    config_class = QwenImageInpaintConfig
    pipeline_class = Imported("diffusers:QwenImageInpaintPipeline")
    model_name = "qwen_image_inpaint"
    encodes_image_inputs = True
    loads_pipelines = ("QwenImagePipeline",)
    """Saved pipelines whose weights are this adapter's own (Qwen-Image's directory; no model-path warning)."""

    @torch.no_grad()
    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the source's normalised, packed latents (posterior mean; read from ``model.image_latents``
        when it holds them), float32; ``mask``: True where to repaint, per packed latent entry, as the
        pipeline's ``prepare_mask_latents`` folds the binarised mask to the latent grid."""
        reject_image_inputs(self.model_name, inputs, allowed=("image", "mask"))
        size = (self.resolution, self.resolution)
        image = require_image_input(self.model_name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(self.model_name, inputs, "mask", batch_size, 1, size)
        x = (image.to(self.device, torch.float32) * 2 - 1).to(self.dtype)[:, :, None]
        latents = self.image_latents(x).mode().float()
        latents = (latents - self.latents_mean) * (1 / self.latents_std)  # the pipeline's rounding
        b, c, _, h, w = latents.shape
        return {"image": self.pipeline._pack_latents(latents, b, c, h, w), "mask": packed_mask(self, mask)}

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Qwen-Image's velocity where the mask is set; (x - z) / sigma elsewhere (see the module docstring)."""
        if cond.image is None or cond.mask is None:
            raise ValueError("qwen_image_inpaint needs Conditioning.image and .mask: encode prompts with ImageInputs")
        v = super().predict(net, latents, sigma, cond, guidance_scale)
        return inpaint_velocity(v, latents, sigma, cond.image, cond.mask)


def packed_mask(adapter, mask: torch.Tensor) -> torch.Tensor:
    """True where to repaint, per packed latent entry: ``mask`` [B, 1, H, W] binarised at 0.5 and folded to the
    latent grid as the Qwen-Image and FLUX-layout (Chroma) pipelines' ``prepare_mask_latents`` do."""
    side, c = adapter.resolution // adapter.vae_factor, adapter.latent_channels
    grid = nn.functional.interpolate((mask.to(adapter.device, torch.float32) >= 0.5).float(), size=(side, side))
    return adapter.pipeline._pack_latents(grid.repeat(1, c, 1, 1), mask.shape[0], c, side, side) > 0.5
