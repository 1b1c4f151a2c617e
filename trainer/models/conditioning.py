"""Conditioning parts that the variants of several model families combine (registry data: ``ModelSpec.parts``).

A part names the ``ImageInputs`` fields it reads, encodes them into ``Conditioning`` fields with the family's own
latent layout (the adapter's hooks), and may change the prediction after the network. A family's own parts (FLUX.1
Fill's channels, Kontext's reference tokens) live in its file; the ones here serve several families.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.models.base import Conditioning, ImageInputs
from trainer.models.flow import inpaint_velocity
from trainer.models.inputs import VIDEO_SIZE, require_image_input, require_references


@dataclass(frozen=True)
class Inpaint:
    """Repaint where the mask is 1, keep the source image elsewhere. The pipelines blend the known region back
    after every step, x <- (1 - m) (sigma' eps + (1 - sigma') z) + m x (z the source's latents, eps the initial
    noise); here the same trajectory comes from the prediction (``flow.inpaint_velocity``), so a rollout at noise
    level 0 equals the pipeline (strength 1) and the known region adds nothing to the ratio, KL or gradient.

    The adapter supplies ``inpaint_source(image)`` (the source's latents in its layout) and ``inpaint_mask(mask)``
    (the mask on its latent grid). ``trajectory``: the mask is soft, so the blend needs the rollout's initial noise
    and schedule (``Conditioning.noise``, ``.schedule``); a binary mask needs neither."""

    trajectory: bool = False
    fields = ("image", "mask")
    encodes_text = False

    @property
    def reads_trajectory(self) -> bool:
        return self.trajectory

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the source's latents, float32; ``mask``: where to repaint, per latent entry."""
        name, size = adapter.config.name, (adapter.resolution, adapter.resolution)
        image = require_image_input(name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(name, inputs, "mask", batch_size, 1, size)
        return {"image": adapter.inpaint_source(image), "mask": adapter.inpaint_mask(mask)}

    def check(self, adapter, cond: Conditioning) -> None:
        """A ValueError before the forward when ``cond`` lacks what ``velocity`` reads."""
        if cond.image is None or cond.mask is None:
            raise ValueError(
                f"{adapter.config.name} needs Conditioning.image and .mask: encode prompts with ImageInputs"
            )

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """The network's velocity where the mask is set; the blend's elsewhere."""
        trajectory = (cond.noise, cond.schedule) if self.trajectory else ()
        return inpaint_velocity(v, latents, sigma, cond.image, cond.mask, *trajectory)


@dataclass(frozen=True)
class References:
    """Reference images (editing) whose latents the transformer attends to: ``ImageInputs.reference`` [B, 3, H, W]
    or [B, N, 3, H, W], 1 to ``most`` per item at ``model.resolution``; ``optional``: the model also runs without.
    The adapter supplies ``reference_latents(references)`` ([B, N, 3, H, W] -> its tokens, one image after the
    other)."""

    most: int = 1
    optional: bool = False
    fields = ("reference",)
    reads_trajectory = False
    encodes_text = False

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        if self.optional and (inputs is None or inputs.reference is None):
            return {}
        size = (adapter.resolution, adapter.resolution)
        pipeline = adapter.pipeline_class.__name__
        references = require_references(adapter.config.name, inputs, batch_size, size, self.most, pipeline)
        return {"reference": adapter.reference_latents(references)}

    def check(self, adapter, cond: Conditioning) -> None:
        if cond.reference is None and not self.optional:
            raise ValueError(
                f"{adapter.config.name} needs Conditioning.reference: encode prompts with ImageInputs.reference"
            )

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        return v


@dataclass(frozen=True)
class PinnedFirstFrame:
    """An optional first frame (``ImageInputs.image`` [B, 3, H, W] at the video's size) pinned as the first latent
    frame, as Wan 2.2 TI2V-5B's and LTX-2's image-to-video pipelines pin it: its latents replace that frame in the
    transformer's input (which the adapter runs at timestep 0 there), and the prediction keeps the frame on its
    known trajectory (``flow.inpaint_velocity``), so a noise-0 rollout ends on it and the frame adds nothing to the
    ratio, KL or gradient. Without an image the model generates from text alone.

    The adapter supplies ``first_frame_latents(image)`` (the frame's latents as the pipeline normalises them,
    [B, ...] in its layout) and ``first_frame_span`` (dim, n): the first latent frame is the first n entries of the
    latents along dim."""

    pinned = True
    optional = True
    fields = ("image",)
    reads_trajectory = True
    encodes_text = False

    def channels(self, z_dim: int, temporal: int) -> int:
        """Input channels it adds to the transformer's: none (the frame replaces latents)."""
        return 0

    def components(self, path, dtype: torch.dtype, device: torch.device) -> dict:
        """Pipeline components it needs beyond the VAE: none."""
        return {}

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the frame's latents, float32; nothing without a frame."""
        if inputs is None or inputs.image is None:
            return {}
        size = (adapter.height, adapter.width)
        because = "it generates the video from that first frame"
        image = require_image_input(
            adapter.config.name, inputs, "image", batch_size, 3, size, because=because, sized_by=VIDEO_SIZE
        )
        return {"image": adapter.first_frame_latents(image).float()}

    def check(self, adapter, cond: Conditioning) -> None:
        """Nothing is required: the frame is optional."""

    def mask(self, adapter, cond: Conditioning) -> torch.Tensor | None:
        """Whether the first latent frame is pinned: [1, ...] in the latents' layout, 0 on it and 1 elsewhere
        (None without a frame)."""
        if cond.image is None:
            return None
        dim, n = adapter.first_frame_span
        mask = torch.ones(1, *adapter.latent_shape, device=adapter.device)
        mask.narrow(dim, 0, n).zero_()
        return mask

    def join(self, adapter, latents: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, dict]:
        """The transformer's input, ``latents`` with the frame's latents in place of the first latent frame, and
        no extra forward arguments."""
        if cond.image is None:
            return latents, {}
        dim, n = adapter.first_frame_span
        rest = latents.narrow(dim, n, latents.shape[dim] - n)
        return torch.cat([cond.image.to(latents.dtype), rest], dim), {}

    def velocity(self, adapter, v: torch.Tensor, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """The network's velocity after the first latent frame; on it, the velocity of its known trajectory
        sigma noise + (1 - sigma) frame (ending at the frame's latents)."""
        if cond.image is None:
            return v
        dim, n = adapter.first_frame_span
        first = [t if t is None else t.narrow(dim, 0, n) for t in (v, latents, cond.noise)]
        pinned = inpaint_velocity(*first[:2], sigma, cond.image, v.new_zeros(()), first[2], cond.schedule)
        return torch.cat([pinned.to(v.dtype), v.narrow(dim, n, v.shape[dim] - n)], dim)


INPAINT = Inpaint()
"""Inpainting with a binary mask (Qwen-Image, Chroma)."""
SOFT_INPAINT = Inpaint(trajectory=True)
"""Inpainting with a mask made soft on the latent grid (FLUX.2 [klein])."""
FLUX2_REFERENCES = References(most=10, optional=True)
"""FLUX.2's multi-reference editing: up to 10 reference images per item, or none."""
PINNED_FIRST_FRAME = PinnedFirstFrame()
"""Wan 2.2 TI2V-5B and LTX-2: an optional first frame pinned as the first latent frame."""
