"""Stable Diffusion 3 / 3.5 (SD3Transformer2DModel, flow matching) from a local diffusers directory.

The text path is diffusers' own ``StableDiffusion3Pipeline.encode_prompt`` (CLIP-L, CLIP-G, optional T5),
so embeddings match the pipeline users know bit for bit. Without a ``vae`` subfolder the model works in
pixel space (latents are images in [-1, 1]): that is how the tiny embedded model runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.config.fields import PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import (
    DTYPES,
    DiffusersModelConfig,
    Imported,
    denoiser_config,
    freeze,
    load_denoiser,
)
from trainer.models.flow import cfg_combine, dynamic_shift_mu
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline


@dataclass
class SD3Config(DiffusersModelConfig):
    """Where the SD3 / SD3.5 weights are (transformer/, scheduler/, text encoders, optional vae/) and how
    to run them."""

    name: str = "sd3"
    max_sequence_length: PositiveInt = 256
    """T5 tokens (zeros of this length when the model has no T5, as the pipeline does)."""


class SD3Adapter:
    """ModelAdapter for SD3-family checkpoints."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(("diffusers.models.transformers.transformer_sd3:JointTransformerBlock",))
    config_class = SD3Config
    pipeline_class = Imported("diffusers:StableDiffusion3Pipeline")
    text_components = Imported(
        {
            "text_encoder": "transformers:CLIPTextModelWithProjection",
            "tokenizer": "transformers:CLIPTokenizer",
            "text_encoder_2": "transformers:CLIPTextModelWithProjection",
            "tokenizer_2": "transformers:CLIPTokenizer",
            "text_encoder_3": "transformers:T5EncoderModel",
            "tokenizer_3": "transformers:T5TokenizerFast",
        }
    )
    optional_text = ("text_encoder_3", "tokenizer_3")
    text_settings = ("dtype", "max_sequence_length")
    reads_trajectory = False
    compiled_blocks = ()

    def __init__(self, config: SD3Config, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        from trainer.models import MODELS

        MODELS[config.name].provide(config)  # the embedded tiny model is built on first use
        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        self.denoiser = load_denoiser(SD3Transformer2DModel, config, "transformer", "SD3", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load) if (path / "vae").is_dir() else None
        self.pipeline = self.pipeline_class(
            transformer=self.denoiser,
            scheduler=self.scheduler,
            vae=self.vae,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae)
        refuse_image_latents("sd3", config)
        self.image_latents = ImageLatents.of(self.vae, config)  # never read: no input is VAE-encoded

        vae_factor = 2 ** (len(self.vae.config.block_out_channels) - 1) if self.vae is not None else 1
        side = config.resolution or self.denoiser.config.sample_size * vae_factor
        if side % (vae_factor * self.denoiser.config.patch_size):
            raise ValueError(
                f"model.resolution={side} must be a multiple of {vae_factor * self.denoiser.config.patch_size}"
            )
        most, pixels = self.denoiser.config.pos_embed_max_size, vae_factor * self.denoiser.config.patch_size
        if most is not None and side // pixels > most:  # SD3's position table: none beyond it (None: no table)
            raise ValueError(
                f"model.resolution={side} needs {side // pixels} patches a side, but this transformer's "
                f"positions (pos_embed_max_size) reach {most}: at most model.resolution={most * pixels}"
            )
        self.latent_shape = (self.denoiser.config.in_channels, side // vae_factor, side // vae_factor)

        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def prompt_encoder(model, config: SD3Config, device: torch.device | str):
        """``text.prompt_encoder``; without T5 the pipeline reads the transformer's config for its zero T5
        tokens, which a weightless (meta-device) transformer provides."""
        from diffusers import SD3Transformer2DModel

        extra = {}
        if not (Path(config.path) / "text_encoder_3").is_dir():
            with torch.device("meta"):
                extra["transformer"] = SD3Transformer2DModel.from_config(
                    denoiser_config(SD3Transformer2DModel, config, "transformer", "SD3")
                )
        return prompt_encoder(model, config, device, **extra)

    @staticmethod
    def encode_text(
        pipeline: StableDiffusion3Pipeline, config: SD3Config, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """CLIP-L/G (+ T5) sequence and pooled embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=[prompt],
            prompt_2=None,
            prompt_3=None,
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=config.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled": pooled}

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Per-prompt embeddings, cached by prompt text. SD3 takes no image inputs."""
        reject_image_inputs(self.config.name, inputs)  # config.name: "tiny" for the embedded model
        return Conditioning(embeds=self.prompts.cat(prompts))

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        return standard_normal((batch_size, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The scheduler's sigmas as the pipeline sets them: shifted as configured, or with the scheduler's
        dynamic shifting by mu = calculate_shift(image tokens)."""
        shift = {}
        if self.scheduler.config.get("use_dynamic_shifting"):
            _, height, width = self.latent_shape
            patch = self.denoiser.config.patch_size
            shift["mu"] = dynamic_shift_mu(self.scheduler, (height // patch) * (width // patch), default_max_shift=1.16)
        self.scheduler.set_timesteps(num_steps, device=self.device, **shift)
        return self.scheduler.sigmas.to(torch.float32)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; CFG as one forward over [uncond; cond] like the pipeline, combined in float32."""
        embeds, pooled = cond.embeds["prompt_embeds"], cond.embeds["pooled"]
        timestep = sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps
        x = latents.to(self.dtype)
        cfg = guidance_scale > 1.0
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]
            n = x.shape[0]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            pooled = torch.cat([neg["pooled"].expand(n, -1), pooled])
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
        out = net(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if cfg:
            return cfg_combine(*out.chunk(2), guidance_scale)
        return out.float()

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
        return (1 - s) * x0 + s * noise, noise - x0

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [B, C, H, W] -> latents (posterior mean; the inverse of ``decode``) for supervised
        targets."""
        x = images.to(self.device, torch.float32) * 2 - 1
        if self.vae is None:
            return x
        latents = self.vae.encode(x.to(self.dtype)).latent_dist.mode()
        return (latents.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = latents.float()
        if self.vae is not None:
            x = x / self.vae.config.scaling_factor + self.vae.config.shift_factor
            x = self.vae.decode(x.to(self.dtype), return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)
