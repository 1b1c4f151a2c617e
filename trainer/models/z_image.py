"""Z-Image (ZImageTransformer2DModel, flow matching, Qwen3 text encoder) from a local diffusers directory.

Prompts go through the pipeline's own ``encode_prompt`` (Qwen3 chat template, hidden states of the second
to last layer, padding dropped), so each keeps its own length: a batch is right-padded to its longest prompt
with ``prompt_mask`` (``Conditioning.ragged``) and cut back into the list of per-prompt tensors the
transformer takes. Latents are [C, h, w] images of latents as the pipeline draws them; the transformer sees
time 1 - sigma and predicts the negated velocity. CFG is Z-Image's: CFG whenever ``guidance_scale > 0``,
pred = cond + scale * (cond - uncond), one batched forward over [prompt; negative], with the pipeline's norm
clamp (``cfg_normalization``) and its cut-off of CFG late in sampling (``cfg_truncation``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeFloat, NonNegativeInt, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction, ragged_prompts
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target, shifted_flow_sigmas
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import ZImagePipeline


@dataclass
class ZImageConfig(DiffusersModelConfig):
    """Where the Z-Image weights are (transformer/, vae/, text_encoder/, tokenizer/, scheduler/) and how to
    run them. ``algorithm.sampler.guidance_scale`` is the pipeline's: 0 runs no CFG (Z-Image-Turbo)."""

    name: str = "z_image"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    max_sequence_length: PositiveInt = 512
    """Text tokens kept per prompt, chat template included (the pipeline's default)."""
    cfg_normalization: NonNegativeFloat = 0.0
    """The pipeline's CFG norm clamp: k > 0 scales each image's guided prediction down to at most k times the
    norm of its conditional one (the pipeline's ``cfg_normalization=True`` is 1.0); 0: off, its default."""
    cfg_truncation: NonNegativeFloat = 1.0
    """The pipeline's CFG cut-off: CFG runs only at steps where 1 - sigma <= this, the others take the
    conditional prediction alone (one forward); >= 1: CFG at every step, its default."""


class ZImageAdapter:
    """ModelAdapter for Z-Image checkpoints (text-to-image)."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(("diffusers.models.transformers.transformer_z_image:ZImageTransformerBlock",))
    config_class = ZImageConfig
    reads_trajectory = False
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:ZImagePipeline")
    text_components = Imported({"text_encoder": "transformers:Qwen3Model", "tokenizer": "transformers:Qwen2Tokenizer"})
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: ZImageConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        self.denoiser = load_denoiser(ZImageTransformer2DModel, config, "transformer", "Z-Image", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load)
        self.pipeline = self.pipeline_class(
            scheduler=self.scheduler,
            vae=self.vae,
            transformer=self.denoiser,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        encode = self.pipeline._encode_prompt
        # the pipeline writes the chat-templated prompts into the caller's list: hand it a copy
        self.pipeline._encode_prompt = lambda prompt, *a, **k: encode(
            list(prompt) if isinstance(prompt, list) else prompt, *a, **k
        )
        freeze(self.vae)
        refuse_image_latents(self.config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)  # never read: no input is VAE-encoded

        self.vae_factor = self.pipeline.vae_scale_factor
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = side
        self.patch = self.denoiser.config.all_patch_size[0]
        h = side // self.vae_factor
        self.latent_shape = (self.denoiser.config.in_channels, h, h)

        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: ZImagePipeline, config: ZImageConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """Unpadded [L, D] embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _ = pipeline.encode_prompt(
            [prompt], device=device, do_classifier_free_guidance=False, max_sequence_length=config.max_sequence_length
        )
        return {"prompt_embeds": embeds[0]}

    def _text(self, prompts: list[str]) -> list[torch.Tensor]:
        return [e["prompt_embeds"] for e in self.prompts(prompts)]

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings right-padded to the batch's longest prompt, with ``prompt_mask``."""
        reject_image_inputs(self.config.name, inputs)
        return ragged_prompts(self._text(prompts))

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG (> 0), those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, h, w], drawn as ``ZImagePipeline.prepare_latents`` draws it."""
        return standard_normal((batch_size, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted for this image token count."""
        _, h, w = self.latent_shape
        return shifted_flow_sigmas(self.scheduler, num_steps, (h // 2) * (w // 2), self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    @staticmethod
    def _captions(cond: Conditioning) -> list[torch.Tensor]:
        """The per-prompt [L_i, D] embeddings the transformer takes. Cutting a padded batch reads its
        lengths from the device (``Conditioning`` carries no host-side lengths); an unpadded one reads none."""
        embeds = cond.embeds["prompt_embeds"]
        if not cond.padded:
            return list(embeds.unbind(0))
        lengths = cond.embeds["prompt_mask"].sum(1).tolist()
        return [e[:n] for e, n in zip(embeds.unbind(0), lengths, strict=True)]

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity (the negated transformer output); with ``guidance_scale > 0`` Z-Image's CFG against
        ``negative_prompt`` in one forward over [prompt; negative], combined in float32 (``z_image_cfg``)
        where 1 - sigma <= ``cfg_truncation``; rows past it take the conditional prediction."""
        captions = self._captions(cond)
        n = latents.shape[0]
        x = latents.to(self.dtype)
        timestep = (1000 - sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps) / 1000
        guided = guided_rows(timestep, self.config.cfg_truncation) if guidance_scale > 0 else False
        if guided is not False:
            (neg,) = self._text([self.config.negative_prompt])
            captions = captions + [neg] * n
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = net(x=list(x.unsqueeze(2).unbind(0)), t=timestep, cap_feats=captions, return_dict=False)[0]
        out = torch.stack(out).squeeze(2)
        if guided is False:
            return -out.float()
        pred = z_image_cfg(out[:n], out[n:], guidance_scale, self.config.cfg_normalization)
        return -(
            pred if guided is True else torch.where(guided.reshape(-1, *[1] * (pred.ndim - 1)), pred, out[:n].float())
        )

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [B, C, H, W] -> latents (posterior mean; the inverse of ``decode``) for supervised
        targets."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)
        latents = self.vae.encode(x).latent_dist.mode()
        return (latents.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = latents.float() / self.vae.config.scaling_factor + self.vae.config.shift_factor
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)


def guided_rows(timestep: torch.Tensor, truncation: float) -> torch.Tensor | bool:
    """Which rows run CFG under ``cfg_truncation``: those whose pipeline time 1 - sigma (``timestep``) is at most
    ``truncation``, compared in float64 as the pipeline compares its Python floats. True or False when all or
    none do (one device read, only where the cut-off can fall inside the schedule), else a [B] mask."""
    if truncation >= 1:
        return True
    guided = timestep.double() <= truncation
    count = int(guided.sum())
    return True if count == len(guided) else guided if count else False


def z_image_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float, normalization: float) -> torch.Tensor:
    """Z-Image's guided prediction in float32: pred = cond + scale (cond - uncond) (``cfg_combine``), and with
    ``normalization`` k > 0 each image's pred times min(1, k ||cond|| / ||pred||), norms over the whole image."""
    pred = cfg_combine(uncond, cond, 1 + scale)
    if normalization <= 0:
        return pred
    dims = tuple(range(1, pred.ndim))
    limit = normalization * torch.linalg.vector_norm(cond.float(), dim=dims, keepdim=True)
    norm = torch.linalg.vector_norm(pred, dim=dims, keepdim=True)
    return torch.where(norm > limit, pred * (limit / norm.clamp_min(torch.finfo(norm.dtype).tiny)), pred)
