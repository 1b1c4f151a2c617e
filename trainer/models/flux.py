"""FLUX.1-dev (FluxTransformer2DModel, flow matching, guidance embedding) from a local diffusers directory.

Latents live packed, as FLUX's transformer sees them: [B, (h/2)(w/2), 4C] tokens of 2x2 latent patches, with
txt/img position ids. Text (CLIP pooled + T5), packing, position ids and the shifted schedule all come from
diffusers' ``FluxPipeline`` itself, so a rollout at noise level 0 reproduces the pipeline.

Guidance: FLUX-dev is guidance-distilled, so ``guidance_scale`` is fed to the guidance embedding and there
is one forward per step (no CFG). A checkpoint without guidance embedding (schnell-like) gets true CFG with
the empty negative prompt instead, batched as one forward.

The FLUX.1 Fill and Kontext adapters are this class with two hooks replaced: ``_image_conditioning``
(what ImageInputs become) and ``_model_input`` (how they join the packed latents). All of them take an
optional IP-Adapter (``model.ip_adapter``, see ``trainer.models.ip_adapter``) conditioned on
``ImageInputs.style`` through diffusers' own FLUX IP-Adapter classes.
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
from trainer.models.inputs import reject_image_inputs
from trainer.models.ip_adapter import IPAdapter, IPAdapterSettings, refuse_unloadable_flux_tokens, split_style
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal

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
    label = "FLUX"
    """The family's name in messages about ``model.path`` (Chroma subclasses this adapter with its transformer)."""
    model_name = "flux"
    encodes_image_inputs = False
    """Whether ``_image_conditioning`` VAE-encodes per-item inputs (Fill, Kontext): ``model.image_latents``."""
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
    prompt_encoder = classmethod(prompt_encoder)

    def __init__(self, config: FluxConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        saved = denoiser_config(self.transformer_class, config, "transformer", self.label)
        if config.ip_adapter is not None:
            refuse_unloadable_flux_tokens(config.ip_adapter.num_tokens, saved["joint_attention_dim"])
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load)
        self.vae_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)  # as FluxPipeline's vae_scale_factor
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = side
        self.latent_channels = self.vae.config.latent_channels
        tokens_side = side // self.vae_factor // 2
        self.latent_shape = (tokens_side * tokens_side, 4 * self.latent_channels)
        fed = self.latent_shape[1] + self._extra_input_channels()
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
            **load_text_components(type(self), config, self.device),
        )
        self.pipeline.to(self.device)
        assert self.pipeline.vae_scale_factor == self.vae_factor
        freeze(self.vae)
        if not self.encodes_image_inputs:
            refuse_image_latents(self.model_name, config)
        self.image_latents = ImageLatents.of(self.vae, config)
        self.img_ids = self.pipeline._prepare_latent_image_ids(1, tokens_side, tokens_side, self.device, self.dtype)
        self.guidance_embeds = bool(self.denoiser.config.get("guidance_embeds", False))

        self.ip_adapter = (
            IPAdapter(self.denoiser, config.ip_adapter, self.dtype, self.device) if config.ip_adapter else None
        )
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing, self.ip_adapter)
        self.prompts = PromptEmbeddings.of(self, config)

    def _extra_input_channels(self) -> int:
        """Channels a variant concatenates to the packed latents at every forward (none here)."""
        return 0

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
        style, inputs = split_style(self.model_name, self.ip_adapter, inputs, len(prompts))
        images = self._image_conditioning(len(prompts), inputs)
        return Conditioning(embeds=self.prompts.cat(prompts), style=style, **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(self._runs_cfg(scale) for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def _image_conditioning(self, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """Conditioning image fields from ``inputs``; text-to-image FLUX takes none."""
        reject_image_inputs(self.model_name, inputs)
        return {}

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """(transformer hidden_states, img_ids) for packed latents ``x`` in the model dtype."""
        return x, self.img_ids

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, h, w] packed to tokens, drawn as ``FluxPipeline.prepare_latents`` draws it."""
        h = self.resolution // self.vae_factor
        noise = standard_normal((batch_size, self.latent_channels, h, h), generator, self.device)
        return self.pipeline._pack_latents(noise, batch_size, self.latent_channels, h, h)

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
        hidden, img_ids = self._model_input(latents.to(self.dtype), cond)
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
                    f"{self.model_name} has model.ip_adapter and needs Conditioning.style: encode "
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

    @torch.no_grad()
    def vae_encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [B, 3, H, W] -> scaled, unpacked latents [B, C, H/f, W/f] (posterior mean)."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)
        return self.scale_latents(self.vae.encode(x).latent_dist.mode())

    def scale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents -> the shifted and scaled ones the transformer works in, float32."""
        return (latents.float() - self.vae.config.shift_factor) * self.vae.config.scaling_factor

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, (h/2)(w/2), 4C] tokens."""
        b, c, h, w = latents.shape
        return self.pipeline._pack_latents(latents, b, c, h, w)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> packed latents (the inverse of ``decode``) for supervised targets."""
        return self.pack(self.vae_encode(images))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.pipeline._unpack_latents(latents.float(), self.resolution, self.resolution, self.vae_factor)
        x = x / self.vae.config.scaling_factor + self.vae.config.shift_factor
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)
