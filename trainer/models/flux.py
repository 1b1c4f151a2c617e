"""FLUX.1-dev (FluxTransformer2DModel, flow matching, guidance embedding) from a local diffusers directory.

Latents live packed, as FLUX's transformer sees them: [B, (h/2)(w/2), 4C] tokens of 2x2 latent patches, with
txt/img position ids. Text (CLIP pooled + T5), packing, position ids and the shifted schedule all come from
diffusers' ``FluxPipeline`` itself, so a rollout at noise level 0 reproduces the pipeline.

Guidance: FLUX-dev is guidance-distilled, so ``guidance_scale`` is fed to the guidance embedding and there
is one forward per step (no CFG). A checkpoint without guidance embedding (schnell-like) gets true CFG with
the empty negative prompt instead, batched as one forward.

FLUX.1 Fill and Kontext are this adapter with one conditioning part each (registry data, ``MODELS``):
``FILL_CHANNELS`` concatenates the masked image's latents and the mask to the latents' channels, and
``KONTEXT_REFERENCE`` appends the reference image's tokens. All of them take an optional IP-Adapter
(``model.ip_adapter``, see ``trainer.models.ip_adapter``) conditioned on ``ImageInputs.style`` through diffusers'
own FLUX IP-Adapter classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze
from trainer.models.flow import cfg_combine, rectified_flow_target, shifted_flow_sigmas
from trainer.models.inputs import reject_image_inputs, require_image_input
from trainer.models.ip_adapter import IPAdapter, IPAdapterSettings, refuse_unloadable_flux_tokens, split_style
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.packing import PackedLatents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step

if TYPE_CHECKING:
    from diffusers import FluxPipeline


@dataclass
class FluxConfig(DiffusersModelConfig):
    """Where the FLUX.1 weights are (transformer/, vae/, scheduler/, text_encoder(_2)/, tokenizer(_2)/) and
    how to run them; resolution must be a multiple of 2x the VAE factor (16 for the real VAE)."""

    name: str = "flux"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    max_sequence_length: PositiveInt = 512
    """T5 tokens per prompt (the pipeline's default)."""
    ip_adapter: IPAdapterSettings | None = None
    """An IP-Adapter conditioned on ``ImageInputs.style``; None: the model takes no style image."""

    def __post_init__(self):
        if self.ip_adapter is not None:
            refuse_unloadable_flux_tokens(self.ip_adapter.num_tokens)


class FluxAdapter:
    """ModelAdapter for FLUX.1-dev checkpoints."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(
        (
            "diffusers.models.transformers.transformer_flux:FluxTransformerBlock",
            "diffusers.models.transformers.transformer_flux:FluxSingleTransformerBlock",
        )
    )
    config_class = FluxConfig
    pipeline_class = Imported("diffusers:FluxPipeline")
    transformer_class = Imported("diffusers:FluxTransformer2DModel")
    reads_trajectory = False
    compiled_blocks = ()
    text_components = Imported(
        {
            "text_encoder": "transformers:CLIPTextModel",
            "tokenizer": "transformers:CLIPTokenizer",
            "text_encoder_2": "transformers:T5EncoderModel",
            "tokenizer_2": "transformers:T5TokenizerFast",
        }
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: FluxConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        from trainer.models import MODELS

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        self.pipeline_class, self.parts = MODELS[config.name].pipeline_class, MODELS[config.name].conditioning
        load = {"torch_dtype": self.dtype}
        saved = denoiser_config(self.transformer_class, config, "transformer", "FLUX")
        if config.ip_adapter is not None:
            refuse_unloadable_flux_tokens(config.ip_adapter.num_tokens, saved["joint_attention_dim"])
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load)
        self.latents = PackedLatents(self.vae, self.pipeline_class, config.resolution, self.device, self.dtype)
        self.vae_factor, self.resolution = self.latents.vae_factor, self.latents.resolution
        self.latent_channels, self.latent_shape = self.latents.channels, self.latents.shape
        fed = self.latent_shape[1] + sum(part.channels(self) for part in self.parts)
        if saved["in_channels"] != fed:
            raise ValueError(
                f"model.path={config.path!r} holds a FLUX transformer reading {saved['in_channels']} "
                f"input channels, and model.name={config.name} feeds it {fed}: FLUX.1 Fill reads 384 "
                "(latents | masked-image latents | mask), FLUX.1-dev and Kontext 64; point model.path at "
                "the weights of the model that model.name names"
            )
        self.denoiser = self.transformer_class.from_pretrained(path, subfolder="transformer", **load)
        self.pipeline = self.pipeline_class(
            scheduler=self.scheduler,
            vae=self.vae,
            transformer=self.denoiser,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        assert self.pipeline.vae_scale_factor == self.vae_factor
        freeze(self.vae)
        if not self.parts:
            refuse_image_latents(config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)
        self.guidance_embeds = bool(self.denoiser.config.get("guidance_embeds", False))

        self.ip_adapter = (
            IPAdapter(self.denoiser, config.ip_adapter, self.dtype, self.device) if config.ip_adapter else None
        )
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing, self.ip_adapter)
        self.prompts = PromptEmbeddings.of(self, config)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: FluxPipeline, config: FluxConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """T5 sequence + CLIP pooled embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, pooled, _ = pipeline.encode_prompt(
            prompt=[prompt], prompt_2=None, device=device, max_sequence_length=config.max_sequence_length
        )
        return {"prompt_embeds": embeds, "pooled": pooled}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings (cached per prompt), the style image's embeddings when there is an IP-Adapter,
        and the image conditioning this variant takes."""
        style, inputs = split_style(self.config.name, self.ip_adapter, inputs, len(prompts))
        reject_image_inputs(self.config.name, inputs, allowed=tuple(f for part in self.parts for f in part.fields))
        images = {k: v for part in self.parts for k, v in part.encode(self, len(prompts), inputs).items()}
        return Conditioning(embeds=self.prompts.cat(prompts), style=style, **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(self._runs_cfg(scale) for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, h, w] packed to tokens, drawn as ``FluxPipeline.prepare_latents`` draws it."""
        return self.latents.noise(batch_size, generator)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted for this image token count."""
        return shifted_flow_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def _runs_cfg(self, guidance_scale: float) -> bool:
        return not self.guidance_embeds and guidance_scale > 1.0

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity for packed latents. Guidance-distilled models get ``guidance_scale`` as the guidance
        embedding; others run CFG over [negative prompt; prompt] as one forward (zero image embeddings in the
        unconditional half when there is an IP-Adapter)."""
        embeds, pooled = cond.embeds["prompt_embeds"], cond.embeds["pooled"]
        n = latents.shape[0]
        # (sigma * 1000) / 1000 in the model dtype, exactly as the pipeline rounds its timestep.
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        hidden, img_ids = latents.to(self.dtype), self.latents.img_ids
        for part in self.parts:
            hidden, img_ids = part.join(self, hidden, img_ids, cond)
        guidance = (
            torch.full((n,), guidance_scale, device=self.device, dtype=torch.float32) if self.guidance_embeds else None
        )
        cfg = self._runs_cfg(guidance_scale)
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            pooled = torch.cat([neg["pooled"].expand(n, -1), pooled])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        extra = {}
        if self.ip_adapter is not None:
            if cond.style is None:
                raise ValueError(
                    f"{self.config.name} has model.ip_adapter and needs Conditioning.style: encode "
                    "prompts with ImageInputs.style"
                )
            extra["joint_attention_kwargs"] = self.ip_adapter.image_kwargs(cond.style, cfg, self.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = net(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
            **extra,
        )[0]
        out = out[:, : latents.shape[1]]
        if cfg:
            return cfg_combine(*out.chunk(2), guidance_scale)
        return out.float()

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> packed latents (the inverse of ``decode``) for supervised targets."""
        return self.latents.encode_images(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.latents.decode(latents)


@dataclass(frozen=True)
class FillChannels:
    """FLUX.1 Fill's conditioning: the masked image (pixels where mask >= 0.5 zeroed, as ``FluxFillPipeline``
    does) VAE-encoded with the posterior mean and packed, and the mask folded to the latent grid and packed by the
    pipeline's ``prepare_mask_latents``, both concatenated to the packed latents along channels at every forward:
    [latents | masked-image latents | mask]. The pipeline samples the posterior instead of taking its mean."""

    fields = ("image", "mask")
    reads_trajectory = False

    def channels(self, adapter: FluxAdapter) -> int:
        """Packed 2x2: the masked image's latents, and the mask folded from vae_factor^2 pixels per latent."""
        return 4 * adapter.latent_channels + 4 * adapter.vae_factor**2

    @torch.no_grad()
    def encode(self, adapter: FluxAdapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: packed masked-image latents; ``mask``: the packed mask, as the pipeline makes them. The
        masked image's posterior is read from ``model.image_latents`` when it holds it."""
        name, size = adapter.config.name, (adapter.resolution, adapter.resolution)
        image = require_image_input(name, inputs, "image", batch_size, 3, size)
        mask = require_image_input(name, inputs, "mask", batch_size, 1, size)
        mask = (mask.to(adapter.device, torch.float32) >= 0.5).float()
        masked = (image.to(adapter.device, torch.float32) * 2 - 1) * (1 - mask)
        latents = adapter.image_latents(masked.to(adapter.dtype)).mode()
        mask_tokens, image_tokens = adapter.pipeline.prepare_mask_latents(
            mask, latents, batch_size, adapter.latent_channels, 1, *size, adapter.dtype, adapter.device, None
        )
        return {"image": image_tokens, "mask": mask_tokens}

    def join(self, adapter: FluxAdapter, x: torch.Tensor, ids: torch.Tensor, cond: Conditioning):
        if cond.image is None or cond.mask is None:
            raise ValueError("flux_fill needs Conditioning.image and .mask: encode prompts with ImageInputs")
        return torch.cat([x, cond.image.to(x.dtype), cond.mask.to(x.dtype)], dim=2), ids


@dataclass(frozen=True)
class KontextReference:
    """FLUX.1 Kontext's conditioning: the reference image VAE-encoded (posterior mean; ``FluxKontextPipeline``
    samples it), packed and appended to the packed latents, its position ids the latent grid's with the first axis
    set to 1, as the pipeline makes them; the transformer's output for its tokens is dropped. The reference may
    have any size that is a multiple of 2x the VAE factor (the pipeline's resizing is the data pipeline's)."""

    fields = ("reference",)
    reads_trajectory = False

    def channels(self, adapter: FluxAdapter) -> int:
        return 0

    def encode(self, adapter: FluxAdapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``reference``: the scaled reference latents [B, C, h, w] (packed at each forward); the posterior is
        read from ``model.image_latents`` when it holds it."""
        reference = require_image_input(
            adapter.config.name, inputs, "reference", batch_size, 3, multiple_of=2 * adapter.vae_factor
        )
        posterior = adapter.image_latents(adapter.latents.vae_input(reference))
        return {"reference": adapter.latents.scale(posterior.mode())}

    def join(self, adapter: FluxAdapter, x: torch.Tensor, ids: torch.Tensor, cond: Conditioning):
        if cond.reference is None:
            raise ValueError("flux_kontext needs Conditioning.reference: encode prompts with ImageInputs.reference")
        _, _, h, w = cond.reference.shape
        ref_ids = adapter.pipeline._prepare_latent_image_ids(1, h // 2, w // 2, adapter.device, adapter.dtype)
        ref_ids[..., 0] = 1
        tokens = adapter.latents.pack(cond.reference.to(x.dtype))
        return torch.cat([x, tokens], dim=1), torch.cat([ids, ref_ids], dim=0)


FILL_CHANNELS = FillChannels()
KONTEXT_REFERENCE = KontextReference()
