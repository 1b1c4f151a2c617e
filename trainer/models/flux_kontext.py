"""FLUX.1 Kontext (in-context image editing): FLUX.1-dev that also attends to the reference image's tokens.

The reference is VAE-encoded (posterior mean; ``FluxKontextPipeline`` samples it), packed, and appended to
the sequence of packed latents; its position ids are the latent grid's with the first axis set to 1, as the
pipeline makes them. The transformer's output for the reference tokens is dropped. The reference may have
any size that is a multiple of 2x the VAE factor; the pipeline's resizing to preferred resolutions is left
to the data pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.flux import FluxAdapter, FluxConfig
from trainer.models.inputs import reject_image_inputs, require_image_input


@dataclass
class FluxKontextConfig(FluxConfig):
    """FLUX.1 Kontext weights; same settings as FLUX.1-dev."""

    name: str = "flux_kontext"
    """Registry name of the adapter."""


class FluxKontextAdapter(FluxAdapter):
    """ModelAdapter for FLUX.1 Kontext: needs ``ImageInputs.reference`` (the image to edit) per prompt."""

    config_class = FluxKontextConfig
    pipeline_class = Imported("diffusers:FluxKontextPipeline")
    model_name = "flux_kontext"
    encodes_image_inputs = True

    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``reference``: the scaled reference latents [B, C, h, w] (packed at each forward); the posterior is
        read from ``model.image_latents`` when it holds it."""
        reject_image_inputs(self.model_name, inputs, allowed=("reference",))
        reference = require_image_input(
            self.model_name, inputs, "reference", batch_size, 3, multiple_of=2 * self.vae_factor
        )
        posterior = self.image_latents((reference.to(self.device, torch.float32) * 2 - 1).to(self.dtype))
        return {"reference": self.scale_latents(posterior.mode())}

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        if cond.reference is None:
            raise ValueError("flux_kontext needs Conditioning.reference: encode prompts with ImageInputs.reference")
        _, _, h, w = cond.reference.shape
        ref_ids = self.pipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, self.dtype)
        ref_ids[..., 0] = 1
        tokens = self.pack(cond.reference.to(x.dtype))
        return torch.cat([x, tokens], dim=1), torch.cat([self.img_ids, ref_ids], dim=0)
