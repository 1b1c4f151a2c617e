"""Qwen-Image (QwenImageTransformer2DModel, flow matching, Qwen2.5-VL text encoder) from a local directory.

Latents are packed 2x2 tokens as in FLUX. Text embeddings come from ``QwenImagePipeline.encode_prompt`` and
have a per-prompt length: a batch is right-padded to its longest prompt and carries ``prompt_mask``, which
the transformer turns into its joint attention mask (padding changes nothing else: text positions count
from the start). The conditioning marks that text as ``ragged`` (rollout chunks concatenate padded to a
common length) and says on the host whether it holds padding, so that no forward reads the mask back to
drop it when it is all ones, as the pipeline does. CFG is Qwen-Image's "true CFG" against ``negative_prompt`` with
the pipeline's norm
rescaling, batched as one forward over [negative; prompt] (the pipeline runs two), so the rollout equals
the pipeline up to float rounding of the masked padding.

An optional IP-Adapter (``model.ip_adapter``, see ``trainer.models.ip_adapter``; diffusers has none for
Qwen-Image) conditions the image stream on ``ImageInputs.style``.

Its variants are this adapter with conditioning parts (registry data, ``MODELS``): inpainting
(``conditioning.INPAINT``: the transformer reads no mask, the known region comes from the prediction as the
pipeline's blend), editing (``qwen_edit.EDIT``, ``EDIT_PLUS``: the text encoder and the transformer read the
images to edit) and editing inside a mask (``qwen_edit.EDIT_SOURCE`` with ``INPAINT``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction, pad_dim1, pad_text, ragged_prompts
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target, shifted_flow_sigmas
from trainer.models.inputs import reject_image_inputs
from trainer.models.ip_adapter import IPAdapter, IPAdapterSettings, split_style
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.packing import fold_mask
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import QwenImagePipeline


@dataclass
class QwenImageConfig(DiffusersModelConfig):
    """Where the Qwen-Image weights are (transformer/, vae/, text_encoder/, tokenizer/, scheduler/) and how
    to run them."""

    name: str = "qwen_image"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    max_sequence_length: PositiveInt = 512
    """Text tokens kept per prompt (the pipeline's default)."""
    negative_prompt: str = " "
    """The negative prompt of true CFG (the pipeline's examples use a single space)."""
    ip_adapter: IPAdapterSettings | None = None
    """An IP-Adapter conditioned on ``ImageInputs.style``; None: the model takes no style image."""


@dataclass
class QwenImageEditConfig(QwenImageConfig):
    """Where the Qwen-Image-Edit weights are (Qwen-Image's folders plus processor/) and how to run them."""

    name: str = "qwen_image_edit"
    """Registry name of the adapter."""

    def __post_init__(self):
        if self.text_embeddings:
            raise ValueError(
                "model.text_embeddings is set, but qwen_image_edit's prompt embeddings depend on the "
                "image to edit (its text encoder reads it): unset it"
            )
        if self.ip_adapter is not None:
            raise ValueError("model.ip_adapter is set, but the qwen_image_edit adapter takes no IP-Adapter: unset it")


@dataclass
class QwenImageEditPlusConfig(QwenImageEditConfig):
    """Where the Qwen-Image-Edit-2509 (or 2511) weights are and how to run them."""

    name: str = "qwen_image_edit_plus"
    """Registry name of the adapter."""
    condition_size: PositiveInt = 384
    """Side in pixels of the square image the text encoder reads each reference at (the pipeline's
    CONDITION_IMAGE_SIZE area of 384^2; a multiple of 32, as the pipeline rounds it)."""

    def __post_init__(self):
        super().__post_init__()
        if self.condition_size % 32:
            raise ValueError(
                f"model.condition_size={self.condition_size} must be a multiple of 32 (the pipeline "
                "rounds its condition images' sides to 32): 384 is the pipeline's"
            )


def true_cfg(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's CFG: the usual combination, rescaled per token to the conditional prediction's norm."""
    combined = cfg_combine(uncond, cond, scale)
    cond = cond.float()
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageAdapter:
    """ModelAdapter for Qwen-Image checkpoints (text-to-image)."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(("diffusers.models.transformers.transformer_qwenimage:QwenImageTransformerBlock",))
    config_class = QwenImageConfig
    pipeline_class = Imported("diffusers:QwenImagePipeline")
    reads_trajectory = False
    compiled_blocks = ()
    text_components = Imported(
        {"text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration", "tokenizer": "transformers:Qwen2Tokenizer"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: QwenImageConfig, device: torch.device | str = "cpu"):
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImageTransformer2DModel,
        )

        from trainer.models import MODELS

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        self.pipeline_class, self.parts = MODELS[config.name].pipeline_class, MODELS[config.name].conditioning
        self.editing = next((part for part in self.parts if part.encodes_text), None)
        """The part that encodes the prompts with their images (editing), or None."""
        load = {"torch_dtype": self.dtype}
        self.denoiser = load_denoiser(QwenImageTransformer2DModel, config, "transformer", "Qwen-Image", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", **load)
        self.pipeline = self.pipeline_class(
            scheduler=self.scheduler,
            vae=self.vae,
            transformer=self.denoiser,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae)
        if not self.parts:
            refuse_image_latents(config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)

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

        self.ip_adapter = (
            IPAdapter(self.denoiser, config.ip_adapter, self.dtype, self.device) if config.ip_adapter else None
        )
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing, self.ip_adapter)
        self.prompts = PromptEmbeddings.of(self, config)
        self._padded_negative: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.text_cache: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
        """(prompt, images) -> embeddings, for a part whose text encoder reads images (``qwen_edit.Edit``)."""

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: QwenImagePipeline, config: QwenImageConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """Unpadded [L, D] embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _ = pipeline.encode_prompt([prompt], device=device, max_sequence_length=config.max_sequence_length)
        return {"prompt_embeds": embeds[0]}

    def _text(self, prompts: list[str]) -> list[torch.Tensor]:
        return [e["prompt_embeds"] for e in self.prompts(prompts)]

    def _negative(self, length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The negative prompt's embeddings and mask padded to at least ``length`` ([1, L, D], [1, L]), and
        its own length. The padded pair is kept while the prompt cache holds the same embeddings and the
        length stays (a batch's forwards share it), instead of being built anew per forward."""
        (neg,) = self._text([self.config.negative_prompt])
        length = max(length, len(neg))
        kept = self._padded_negative
        if kept is None or kept[0] is not neg or kept[1].shape[1] != length:
            self._padded_negative = kept = (neg, *pad_text([neg], length))
        return kept[1], kept[2], len(neg)

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings right-padded to the batch's longest prompt, with ``prompt_mask``; the style image's
        embeddings when there is an IP-Adapter; the image conditioning of its parts (an editing part encodes the
        prompts itself, with their images)."""
        if self.editing is not None:
            return self.editing.encode_prompts(self, prompts, inputs)
        style, inputs = split_style(self.config.name, self.ip_adapter, inputs, len(prompts))
        reject_image_inputs(self.config.name, inputs, allowed=tuple(f for part in self.parts for f in part.fields))
        images = {k: v for part in self.parts for k, v in part.encode(self, len(prompts), inputs).items()}
        return ragged_prompts(self._text(prompts), style=style, **images)

    def inpaint_source(self, image: torch.Tensor) -> torch.Tensor:
        """The source's normalised, packed latents (posterior mean; read from ``model.image_latents`` when it
        holds them), float32, as the inpainting pipeline makes them."""
        x = (image.to(self.device, torch.float32) * 2 - 1).to(self.dtype)[:, :, None]
        latents = self.image_latents(x).mode().float()
        latents = (latents - self.latents_mean) * (1 / self.latents_std)  # the pipeline's rounding
        b, c, _, h, w = latents.shape
        return self.pipeline._pack_latents(latents, b, c, h, w)

    def inpaint_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """True where to repaint, per packed latent entry, as the pipelines' ``prepare_mask_latents`` fold it."""
        side = self.resolution // self.vae_factor
        return fold_mask(mask, side, self.latent_channels, self.pipeline._pack_latents, self.device)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks (none for an editing part: its text encoders always encode)."""
        if self.editing is not None:
            return []
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, 1, C, h, w] packed to tokens, drawn as ``QwenImagePipeline.prepare_latents`` draws it."""
        h = 2 * self.tokens_side
        noise = standard_normal((batch_size, 1, self.latent_channels, h, h), generator, self.device)
        return self.pipeline._pack_latents(noise, batch_size, self.latent_channels, h, h)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted for this image token count."""
        return shifted_flow_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; with ``guidance_scale > 1`` true CFG against ``negative_prompt`` in one forward (zero
        image embeddings in the unconditional half when there is an IP-Adapter); each part's change after."""
        for part in self.parts:
            part.check(self, cond)
        embeds, mask = cond.embeds["prompt_embeds"], cond.embeds["prompt_mask"]
        n = latents.shape[0]
        x, shapes = self._model_input(latents.to(self.dtype), cond)
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        cfg = guidance_scale > 1.0
        padded = cond.padded
        if cfg:
            neg_embeds, neg_mask, neg_padded = self._negative_text(cond, embeds.shape[1])
            length = max(neg_embeds.shape[1], embeds.shape[1])
            padded = padded or neg_padded or neg_embeds.shape[1] != embeds.shape[1]
            embeds = torch.cat([pad_dim1(neg_embeds.expand(n, -1, -1), length), pad_dim1(embeds, length)])
            if padded:
                mask = torch.cat([pad_dim1(neg_mask.expand(n, -1), length), pad_dim1(mask, length)])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = net(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask if padded else None,
            img_shapes=[shapes] * x.shape[0],
            return_dict=False,
            **self._ip_kwargs(cond, cfg),
        )[0][:, : latents.shape[1]]
        v = true_cfg(*out.chunk(2), guidance_scale) if cfg else out.float()
        for part in self.parts:
            v = part.velocity(self, v, latents, sigma, cond)
        return v

    def _ip_kwargs(self, cond: Conditioning, cfg: bool) -> dict:
        """The transformer's ``attention_kwargs`` of the IP-Adapter's image embeddings, if there is one."""
        if self.ip_adapter is None:
            return {}
        if cond.style is None:
            raise ValueError(
                "qwen_image has model.ip_adapter and needs Conditioning.style: encode prompts with ImageInputs.style"
            )
        return {"attention_kwargs": self.ip_adapter.image_kwargs(cond.style, cfg, self.dtype)}

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """(transformer hidden_states, one sample's img_shapes) for packed latents ``x`` in the model dtype, with
        an editing part's reference tokens appended, each with its grid."""
        grid = (1, self.tokens_side, self.tokens_side)
        if self.editing is None:
            return x, [grid]
        if cond.reference is None:
            raise ValueError("qwen_image_edit needs Conditioning.reference: encode prompts with ImageInputs.reference")
        references = cond.reference.shape[1] // x.shape[1]
        return torch.cat([x, cond.reference.to(x.dtype)], dim=1), [grid] * (1 + references)

    def _negative_text(self, cond: Conditioning, length: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """CFG's negative text ([1 or B, L, D] embeddings, [1 or B, L] mask, whether it holds padding), at least
        ``length`` long: the negative prompt's, one for the whole batch; with an editing part each item's negative
        prompt read with its images (no padding: all ones mask)."""
        if self.editing is not None:
            negative = cond.embeds["negative_embeds"]
            return negative, torch.ones(negative.shape[:2], dtype=torch.long, device=negative.device), False
        neg_embeds, neg_mask, neg_length = self._negative(length)
        return neg_embeds, neg_mask, neg_length != neg_embeds.shape[1]

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> normalised, packed latents (posterior mean) for supervised targets."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)[:, :, None]
        latents = (self.vae.encode(x).latent_dist.mode().float() - self.latents_mean) / self.latents_std
        b, c, _, h, w = latents.shape
        return self.pipeline._pack_latents(latents, b, c, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.pipeline._unpack_latents(latents.float(), self.resolution, self.resolution, self.vae_factor)
        x = x * self.latents_std + self.latents_mean
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0][:, :, 0].float()
        return (x / 2 + 0.5).clamp(0, 1)
