"""Stable Diffusion 1.5 inpainting (9-channel UNet, epsilon prediction, DDIM) from a local diffusers directory.

The UNet reads [noisy latents (4) | mask (1) | masked-image latents (4)]. The mask (1 = repaint, binarised
at 0.5) is resized to the latent grid and the masked image (pixels to repaint zeroed) is VAE-encoded with
the posterior mean, both as ``StableDiffusionInpaintPipeline`` prepares them (the pipeline samples the
posterior instead of taking its mean). Text goes through the pipeline's own ``encode_prompt``.

Time: rollouts use DDIM (``trainer.samplers.ddim``) with eta = the sampler's noise level. The adapter speaks
one time unit everywhere, u = t / num_train_timesteps: ``sigmas`` returns the DDIM timesteps in that unit,
and ``predict`` and ``training_target`` round u back to an integer training timestep, so rollouts and the
supervised loss (which draws u in (0, 1)) share one convention.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze
from trainer.models.flow import cfg_combine
from trainer.models.inputs import reject_image_inputs, require_image_input
from trainer.models.latents import ImageLatents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import standard_normal
from trainer.samplers.ddim import ddim_step

if TYPE_CHECKING:
    from diffusers import StableDiffusionInpaintPipeline


@dataclass
class SD15InpaintConfig(DiffusersModelConfig):
    """Where the SD1.5 inpainting weights are (unet/, vae/, text_encoder/, tokenizer/, scheduler/) and how
    to run them; the denoiser is the UNet."""

    name: str = "sd15_inpaint"
    resolution: NonNegativeInt = 512


class SD15InpaintAdapter:
    """ModelAdapter for SD1.5 inpainting: needs ``ImageInputs.image`` and ``.mask`` per prompt."""

    modality = "image"
    sampler_kind = "ddim"
    shard_units = Imported(
        tuple(
            f"diffusers.models.unets.unet_2d_blocks:{block}"
            for block in (
                "CrossAttnDownBlock2D",
                "DownBlock2D",
                "UNetMidBlock2DCrossAttn",
                "CrossAttnUpBlock2D",
                "UpBlock2D",
            )
        )
    )
    config_class = SD15InpaintConfig
    reads_trajectory = False
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:StableDiffusionInpaintPipeline")
    text_components = Imported(
        {"text_encoder": "transformers:CLIPTextModel", "tokenizer": "transformers:CLIPTokenizer"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype",)
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: SD15InpaintConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

        from trainer.models import MODELS

        self.parts = MODELS[config.name].conditioning
        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        in_channels = denoiser_config(UNet2DConditionModel, config, "unet", "SD1.5")["in_channels"]
        if in_channels != 9:
            raise ValueError(
                f"model.path={config.path!r} has a {in_channels}-channel UNet, and the sd15_inpaint "
                "adapter needs an inpainting UNet (9 channels: latents | mask | masked-image latents): "
                "point model.path at an SD1.5 inpainting checkpoint"
            )
        self.denoiser = UNet2DConditionModel.from_pretrained(path, subfolder="unet", **load)
        self.scheduler = DDIMScheduler.from_pretrained(path, subfolder="scheduler")
        if self.scheduler.config.prediction_type != "epsilon":
            raise ValueError(f"sd15_inpaint supports epsilon prediction, not {self.scheduler.config.prediction_type!r}")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load)
        self.pipeline = self.pipeline_class(
            vae=self.vae,
            unet=self.denoiser,
            scheduler=self.scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae)
        self.image_latents = ImageLatents.of(self.vae, config)

        self.vae_factor = self.pipeline.vae_scale_factor
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = side
        self.latent_shape = (self.vae.config.latent_channels, side // self.vae_factor, side // self.vae_factor)
        self.num_train_timesteps = self.scheduler.config.num_train_timesteps
        self.alphas_cumprod = self.scheduler.alphas_cumprod.to(self.device, torch.float32)

        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    # --- conditioning -------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """CLIP embeddings (cached per prompt) and the image conditioning of its part (``MASKED_IMAGE``)."""
        reject_image_inputs(self.config.name, inputs, allowed=tuple(f for part in self.parts for f in part.fields))
        images = {k: v for part in self.parts for k, v in part.encode(self, len(prompts), inputs).items()}
        return Conditioning(embeds=self.prompts.cat(prompts), **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    @staticmethod
    def encode_text(
        pipeline: StableDiffusionInpaintPipeline, config: SD15InpaintConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """CLIP embeddings of one prompt via the pipeline's encode_prompt."""
        return {"prompt_embeds": pipeline.encode_prompt([prompt], device, 1, False)[0]}

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise times the scheduler's init_noise_sigma, drawn as the pipeline draws it (strength 1)."""
        noise = standard_normal((batch_size, *self.latent_shape), generator, self.device)
        return noise * self.scheduler.init_noise_sigma

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """DDIM timesteps and the final one (t - N // T), divided by N = num_train_timesteps."""
        self.scheduler.set_timesteps(num_steps, device=self.device)
        timesteps = self.scheduler.timesteps
        final = timesteps[-1:] - self.num_train_timesteps // num_steps
        return torch.cat([timesteps, final]).to(torch.float32) / self.num_train_timesteps

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """The DDIM step (noise level = eta) with this scheduler's alphas bound; only kind "ddim"."""
        if kind != "ddim":
            raise ValueError(f"sampler.kind={kind!r}: sd15_inpaint is an epsilon (DDIM) model; use sampler.kind=ddim")
        return ddim_step(
            schedule * self.num_train_timesteps,
            self.alphas_cumprod,
            torch.as_tensor(self.scheduler.final_alpha_cumprod, dtype=torch.float32),
        )

    # --- the network ---------------------------------------------------------------------------------
    def _timesteps(self, u: torch.Tensor) -> torch.Tensor:
        return (u.to(self.device, torch.float32) * self.num_train_timesteps).round().long()

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Noise prediction at u = ``sigma`` [B]; CFG as one forward over [empty prompt; prompt], both
        with the same mask and masked image, like the pipeline."""
        if cond.image is None or cond.mask is None:
            raise ValueError("sd15_inpaint needs Conditioning.image and .mask: encode prompts with ImageInputs")
        embeds = cond.embeds["prompt_embeds"]
        timestep = self._timesteps(sigma)
        x = torch.cat([latents.to(self.dtype), cond.mask.to(self.dtype), cond.image.to(self.dtype)], dim=1)
        cfg = guidance_scale > 1.0
        if cfg:
            n = x.shape[0]
            neg = self.prompts([self.config.negative_prompt])[0]["prompt_embeds"]
            embeds = torch.cat([neg.expand(n, -1, -1), embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = net(x, timestep, encoder_hidden_states=embeds, return_dict=False)[0]
        if cfg:
            return cfg_combine(*out.chunk(2), guidance_scale)
        return out.float()

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DDPM forward process at t = round(u N): x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise; target noise."""
        t = self._timesteps(sigma).clamp(0, self.num_train_timesteps - 1)
        abar = self.alphas_cumprod[t].reshape(-1, *([1] * (x0.ndim - 1)))
        return abar.sqrt() * x0.float() + (1 - abar).sqrt() * noise.float(), noise

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> scaled latents (posterior mean) for supervised targets."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)
        return self.vae.encode(x).latent_dist.mode().float() * self.vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = (latents.float() / self.vae.config.scaling_factor).to(self.dtype)
        x = self.vae.decode(x, return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)


@dataclass(frozen=True)
class MaskedImage:
    """SD1.5 inpainting's conditioning, which its UNet reads as 5 more input channels: the masked image's latents
    (pixels where mask >= 0.5 zeroed; the posterior read from ``model.image_latents`` when it holds it) and the mask
    at the latent size, as the pipeline's ``prepare_mask_latents`` makes them."""

    fields = ("image", "mask")
    reads_trajectory = False

    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        name, size = adapter.config.name, (adapter.resolution, adapter.resolution)
        image = require_image_input(name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(name, inputs, "mask", batch_size, 1, size)
        mask = (mask.to(adapter.device, torch.float32) >= 0.5).float()
        masked = (image.to(adapter.device, torch.float32) * 2 - 1) * (mask < 0.5)
        masked_latents = adapter.image_latents(masked.to(adapter.dtype)).mode() * adapter.vae.config.scaling_factor
        latent_mask, masked_latents = adapter.pipeline.prepare_mask_latents(
            mask, masked_latents, batch_size, *size, adapter.dtype, adapter.device, None, False
        )
        return {"image": masked_latents, "mask": latent_mask}


MASKED_IMAGE = MaskedImage()
