"""Qwen-Image (QwenImageTransformer2DModel, flow matching, Qwen2.5-VL text encoder) from a local directory.

Latents are packed 2x2 tokens as in FLUX. Text embeddings come from ``QwenImagePipeline.encode_prompt`` and
have a per-prompt length: a batch is right-padded to its longest prompt and carries ``prompt_mask``, which
the transformer turns into its joint attention mask (padding changes nothing else: text positions count
from the start). CFG is Qwen-Image's "true CFG" against ``negative_prompt`` with the pipeline's norm
rescaling, batched as one forward over [negative; prompt] (the pipeline runs two), so the rollout equals
the pipeline up to float rounding of the masked padding.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from torch import nn
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import (
    DTYPES,
    DiffusersModelConfig,
    cfg_combine,
    freeze,
    load_trainable,
    prepare_denoiser,
    rectified_flow_target,
    reference_network,
    reject_image_inputs,
    save_trainable,
    shifted_flow_sigmas,
)
from trainer.samplers import flow_step


@dataclass
class QwenImageConfig(DiffusersModelConfig):
    """Where the Qwen-Image weights are (transformer/, vae/, text_encoder/, tokenizer/, scheduler/) and how
    to run them."""

    name: str = "qwen_image"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: int = 1024
    max_sequence_length: int = 512
    """Text tokens kept per prompt (the pipeline's default)."""
    negative_prompt: str = " "
    """The negative prompt of true CFG (the pipeline's examples use a single space)."""


def pad_text(embeds: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad [L_i, D] embeddings to ``length``: ([B, length, D], mask [B, length] long)."""
    out = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.long, device=out.device)
    for i, e in enumerate(embeds):
        out[i, : len(e)] = e
        mask[i, : len(e)] = 1
    return out, mask


def true_cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's CFG: the usual combination, rescaled per token to the conditional prediction's norm."""
    combined = cfg_combine(uncond, cond, scale)
    cond = cond.float()
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageAdapter:
    """ModelAdapter for Qwen-Image checkpoints (text-to-image)."""

    sampler_kind = "flow"
    shard_units = (QwenImageTransformerBlock,)
    config_class = QwenImageConfig
    model_name = "qwen_image"

    def __init__(self, config: QwenImageConfig, device: torch.device | str = "cpu"):
        path = Path(config.path)
        if not (path / "transformer" / "config.json").is_file():
            raise ValueError(f"model.path={config.path!r} is not a diffusers Qwen-Image directory "
                             "(no transformer/config.json)")
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        self.denoiser = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", **load)
        self.pipeline = QwenImagePipeline(
            scheduler=self.scheduler, vae=self.vae, transformer=self.denoiser,
            text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", **load),
            tokenizer=Qwen2Tokenizer.from_pretrained(path, subfolder="tokenizer"),
        )
        self.pipeline.to(self.device)
        freeze(self.pipeline.text_encoder, self.vae)

        self.vae_factor = self.pipeline.vae_scale_factor
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = side
        self.latent_channels = self.denoiser.config.in_channels // 4
        self.tokens_side = side // self.vae_factor // 2
        self.latent_shape = (self.tokens_side**2, 4 * self.latent_channels)
        z_dim = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean, device=self.device).view(1, z_dim, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std, device=self.device).view(1, z_dim, 1, 1, 1)

        prepare_denoiser(self.denoiser, config.lora, config.gradient_checkpointing)
        self._prompt_cache: dict[str, torch.Tensor] = {}
        self._reference: nn.Module | None = None

    # --- conditioning -------------------------------------------------------------------------------
    @torch.no_grad()
    def _text(self, prompts: list[str]) -> list[torch.Tensor]:
        """Unpadded [L_i, D] embeddings per prompt via the pipeline's encode_prompt, cached."""
        for p in sorted({p for p in prompts if p not in self._prompt_cache}):
            embeds, _ = self.pipeline.encode_prompt(
                [p], device=self.device, max_sequence_length=self.config.max_sequence_length)
            self._prompt_cache[p] = embeds[0]
        return [self._prompt_cache[p] for p in prompts]

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings right-padded to the batch's longest prompt, with ``prompt_mask``."""
        reject_image_inputs(self.model_name, inputs)
        text = self._text(prompts)
        embeds, mask = pad_text(text, max(len(t) for t in text))
        return Conditioning(embeds={"prompt_embeds": embeds, "prompt_mask": mask})

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, 1, C, h, w] packed to tokens, drawn as ``QwenImagePipeline.prepare_latents`` draws it."""
        h = 2 * self.tokens_side
        noise = torch.randn((batch_size, 1, self.latent_channels, h, h), generator=generator, device=self.device,
                            dtype=torch.float32)
        return self.pipeline._pack_latents(noise, batch_size, self.latent_channels, h, h)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted for this image token count."""
        return shifted_flow_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return functools.partial(flow_step(kind), sigma_max=schedule[1])

    # --- the network ---------------------------------------------------------------------------------
    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; with ``guidance_scale > 1`` true CFG against ``negative_prompt`` in one forward."""
        embeds, mask = cond.embeds["prompt_embeds"], cond.embeds["prompt_mask"]
        n = latents.shape[0]
        x = latents.to(self.dtype)
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        cfg = guidance_scale > 1.0
        if cfg:
            (neg,) = self._text([self.config.negative_prompt])
            length = max(embeds.shape[1], len(neg))
            neg_embeds, neg_mask = pad_text([neg], length)
            embeds = torch.cat([neg_embeds.expand(n, -1, -1), nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[1]))])
            mask = torch.cat([neg_mask.expand(n, -1), nn.functional.pad(mask, (0, length - mask.shape[1]))])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        img_shapes = [[(1, self.tokens_side, self.tokens_side)]] * x.shape[0]
        out = net(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                  encoder_hidden_states_mask=None if bool(mask.all()) else mask, img_shapes=img_shapes,
                  return_dict=False)[0]
        if cfg:
            return true_cfg(*out.chunk(2), guidance_scale)
        return out.float()

    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> normalised, packed latents (posterior mean) for supervised targets."""
        x = (images.to(self.device, self.dtype) * 2 - 1)[:, :, None]
        latents = (self.vae.encode(x).latent_dist.mode().float() - self.latents_mean) / self.latents_std
        b, c, _, h, w = latents.shape
        return self.pipeline._pack_latents(latents, b, c, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.pipeline._unpack_latents(latents.float(), self.resolution, self.resolution, self.vae_factor)
        x = x * self.latents_std + self.latents_mean
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0][:, :, 0].float()
        return (x / 2 + 0.5).clamp(0, 1)

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.denoiser.parameters() if p.requires_grad)

    def reference(self) -> nn.Module:
        """LoRA: the transformer with the adapter disabled. Full fine-tuning: a frozen copy made on the first
        call (one more transformer in memory)."""
        if self._reference is None:
            self._reference = reference_network(self.denoiser, self.config.lora)
        return self._reference

    def save_trainable(self, directory: str) -> None:
        save_trainable(self.denoiser, self.config.lora is not None, directory)

    def load_trainable(self, directory: str) -> None:
        """Load weights written by ``save_trainable`` (same LoRA settings) into this adapter's transformer."""
        load_trainable(self.denoiser, self.config.lora is not None, directory)
