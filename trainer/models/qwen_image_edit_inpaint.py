"""Qwen-Image-Edit inpainting (``QwenImageEditInpaintPipeline``): Qwen-Image-Edit's weights editing the source
image as the instruction says, inside the mask only.

The source is Qwen-Image-Edit's image to edit (its text encoder reads it with the instruction, its transformer
attends to its latents), and the known region comes from the prediction as in ``qwen_image_inpaint``: where the
mask is 0 the velocity is (x - z) / sigma, z the source's latents, so a rollout at noise level 0 equals the
pipeline's blend (strength 1) and that region adds nothing to the ratio, KL or gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.flow import inpaint_velocity
from trainer.models.inputs import reject_image_inputs, require_image_input
from trainer.models.qwen_image_edit import QwenImageEditAdapter, QwenImageEditConfig
from trainer.models.qwen_image_inpaint import packed_mask


@dataclass
class QwenImageEditInpaintConfig(QwenImageEditConfig):
    """Qwen-Image-Edit weights (the inpainting pipeline has none of its own); the settings of Qwen-Image-Edit."""

    name: str = "qwen_image_edit_inpaint"
    """Registry name of the adapter."""


class QwenImageEditInpaintAdapter(QwenImageEditAdapter):
    """ModelAdapter for Qwen-Image-Edit inpainting: needs ``ImageInputs.image`` (to edit) and ``.mask``
    (1 = repaint)."""

    config_class = QwenImageEditInpaintConfig
    pipeline_class = Imported("diffusers:QwenImageEditInpaintPipeline")
    model_name = "qwen_image_edit_inpaint"
    loads_pipelines = ("QwenImageEditPipeline",)
    """Saved pipelines whose weights are this adapter's own (Qwen-Image-Edit's directory; no model-path warning)."""

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Qwen-Image-Edit's conditioning with the source as its image to edit, plus ``image``: the source's
        packed latents (its reference tokens) and ``mask`` (``qwen_image_inpaint.packed_mask``)."""
        reject_image_inputs(self.model_name, inputs, allowed=("image", "mask"))
        size = (self.resolution, self.resolution)
        image = require_image_input(self.model_name, inputs, "image", len(prompts), 3, size)
        mask = require_image_input(self.model_name, inputs, "mask", len(prompts), 1, size)
        cond = super().encode_prompts(prompts, ImageInputs(reference=image))
        return dataclasses.replace(cond, image=cond.reference, mask=packed_mask(self, mask))

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Qwen-Image-Edit's velocity where the mask is set; (x - z) / sigma elsewhere (the module docstring)."""
        if cond.image is None or cond.mask is None:
            raise ValueError(
                "qwen_image_edit_inpaint needs Conditioning.image and .mask: encode prompts with ImageInputs"
            )
        v = super().predict(net, latents, sigma, cond, guidance_scale)
        return inpaint_velocity(v, latents, sigma, cond.image, cond.mask)
