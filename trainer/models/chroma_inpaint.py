"""Chroma inpainting (``ChromaInpaintPipeline``): the Chroma weights, repainting where the mask is 1.

Chroma's transformer reads no mask: the pipeline keeps the known region on the noised source latents by blending
after every step, x <- (1 - m) (sigma' eps + (1 - sigma') z) + m x, with eps the initial noise, z the source's
latents and m the binarised mask folded to the latent grid, as ``FluxInpaintPipeline`` does. Here the same
trajectory comes from the prediction alone (``flow.inpaint_velocity`` without the initial noise, as for
Qwen-Image inpainting): the rollout equals the pipeline (strength 1) up to rounding, and the known region's
log-prob terms do not depend on the policy (no gradient, ratio 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.chroma import ChromaAdapter, ChromaConfig
from trainer.models.common import Imported
from trainer.models.flow import inpaint_velocity
from trainer.models.inputs import reject_image_inputs, require_image_input
from trainer.models.qwen_image_inpaint import packed_mask


@dataclass
class ChromaInpaintConfig(ChromaConfig):
    """Chroma weights (the inpainting pipeline has no weights of its own); same settings as Chroma."""

    name: str = "chroma_inpaint"
    """Registry name of the adapter."""


class ChromaInpaintAdapter(ChromaAdapter):
    """ModelAdapter for Chroma inpainting: needs ``ImageInputs.image`` and ``.mask`` (1 = repaint)."""

    config_class = ChromaInpaintConfig
    pipeline_class = Imported("diffusers:ChromaInpaintPipeline")
    model_name = "chroma_inpaint"
    encodes_image_inputs = True
    loads_pipelines = ("ChromaPipeline",)
    """Saved pipelines whose weights are this adapter's own (Chroma's directory; no model-path warning)."""

    @torch.no_grad()
    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the source's shifted, scaled and packed latents (posterior mean; read from
        ``model.image_latents`` when it holds them), float32; ``mask``: True where to repaint, per packed latent
        entry, as the pipeline's ``prepare_mask_latents`` folds the binarised mask to the latent grid."""
        reject_image_inputs(self.model_name, inputs, allowed=("image", "mask"))
        size = (self.resolution, self.resolution)
        image = require_image_input(self.model_name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(self.model_name, inputs, "mask", batch_size, 1, size)
        x = (image.to(self.device, torch.float32) * 2 - 1).to(self.dtype)
        latents = self.image_latents(x).mode()
        # The pipeline shifts and scales in the model dtype.
        latents = ((latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor).float()
        return {"image": self.pack(latents), "mask": packed_mask(self, mask)}

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Chroma's velocity where the mask is set; (x - z) / sigma elsewhere (see the module docstring)."""
        if cond.image is None or cond.mask is None:
            raise ValueError("chroma_inpaint needs Conditioning.image and .mask: encode prompts with ImageInputs")
        v = super().predict(net, latents, sigma, cond, guidance_scale)
        return inpaint_velocity(v, latents, sigma, cond.image, cond.mask)
