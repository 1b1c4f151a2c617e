"""FLUX.2 [klein] inpainting (``Flux2KleinInpaintPipeline``): the Klein weights, repainting where the mask is 1.

The transformer reads the source image's latents z as a conditioning image (tokens after the generated ones,
time id 10), and the pipeline keeps the known region by blending after every step, x' <- (1 - m) (sigma' eps +
(1 - sigma') z) + m x', with eps the initial noise and m the binarised mask made soft by bilinear interpolation
to the token grid. Here that blend comes from the prediction alone (``flow.inpaint_velocity``, which reads eps
and the schedule that ``rollout`` binds to the conditioning): a rollout at noise level 0 equals the pipeline
(strength 1), and where m = 0 the velocity does not depend on the policy (no gradient, ratio 1). Reference
images (the pipeline's ``image_reference``; ``ImageInputs.reference``, optional) follow the source's tokens
with time ids 20, 30, ...
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.common import Imported
from trainer.models.flow import inpaint_velocity
from trainer.models.flux2_klein import Flux2KleinAdapter, Flux2KleinConfig
from trainer.models.inputs import reject_image_inputs, require_image_input


@dataclass
class Flux2KleinInpaintConfig(Flux2KleinConfig):
    """FLUX.2 [klein] weights (the inpainting pipeline has none of its own); the settings of Klein."""

    name: str = "flux2_klein_inpaint"


class Flux2KleinInpaintAdapter(Flux2KleinAdapter):
    """ModelAdapter for FLUX.2 [klein] inpainting: needs ``ImageInputs.image`` and ``.mask`` (1 = repaint)."""

    config_class = Flux2KleinInpaintConfig
    pipeline_class = Imported("diffusers:Flux2KleinInpaintPipeline")
    model_name = "flux2_klein_inpaint"
    reads_trajectory = True
    """``predict`` reads the rollout's initial noise and schedule (``Conditioning.noise``, ``.schedule``)."""
    loads_pipelines = ("Flux2KleinPipeline",)
    """Saved pipelines whose weights are this adapter's own (Klein's directory; no model-path warning)."""

    @torch.no_grad()
    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the source's packed, normalised latents z (posterior mean, as the pipeline's argmax; read
        from ``model.image_latents`` when it holds them), float32; ``mask`` [B, L, 1]: the mask binarised at
        0.5, then interpolated bilinearly to the token grid, as ``prepare_mask_latents`` does; ``reference``
        as FLUX.2's, if given."""
        reject_image_inputs(self.model_name, inputs, allowed=("image", "mask", "reference"))
        size = (self.resolution, self.resolution)
        image = require_image_input(self.model_name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(self.model_name, inputs, "mask", batch_size, 1, size)
        known = self.model_latents(self.image_latents(self._vae_input(image)).mode())
        binary = (mask.to(self.device, torch.float32) >= 0.5).float()
        soft = nn.functional.interpolate(binary, size=(self.tokens_side, self.tokens_side), mode="bilinear")
        return {
            "image": known,
            "mask": self.pipeline._pack_latents(soft),
            **self._reference_latents(batch_size, inputs),
        }

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents followed by the source's tokens and the references', and their position ids."""
        if cond.image is None or cond.mask is None:
            raise ValueError("flux2_klein_inpaint needs Conditioning.image and .mask: encode prompts with ImageInputs")
        images = [cond.image] + ([] if cond.reference is None else [cond.reference])
        tokens = torch.cat([x, *(t.to(x.dtype) for t in images)], dim=1)
        return tokens, self._conditioning_ids(tokens.shape[1] // x.shape[1] - 1)

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Klein's velocity where the mask is 1, the pipeline's blend where it is below (see the module docstring)."""
        v = super().predict(net, latents, sigma, cond, guidance_scale)
        return inpaint_velocity(v, latents, sigma, cond.image, cond.mask, cond.noise, cond.schedule)
