"""Chroma (ChromaTransformer2DModel, 8.9 B, derived from FLUX.1-schnell) from a local diffusers directory.

FLUX.1's latents, packing, position ids, shifted schedule and VAE (``trainer.models.packing``), with Chroma's
text path and forward: T5 alone encodes a prompt, and its attention mask (padding masked but for its first token, as
``ChromaPipeline`` builds it) travels with the embeddings, in a precomputed store too. There is no guidance
embedding and no pooled projection: ``guidance_scale > 1`` runs true CFG against ``negative_prompt``, as one
forward over [negative; prompt], each half with its own mask (the pipeline runs two). No IP-Adapter.

Chroma inpainting (``ChromaInpaintPipeline``, the same weights) is this adapter with the ``conditioning.INPAINT``
part: the transformer reads no mask, and the known region comes from the prediction as the pipeline's blend
(``FluxInpaintPipeline``'s: the binarised mask folded to the latent grid), with the source's latents shifted and
scaled in the model dtype as the pipeline does.
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
from trainer.models.ip_adapter import IPAdapterSettings
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.packing import PackedLatents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step

if TYPE_CHECKING:
    from diffusers import ChromaPipeline


@dataclass
class ChromaConfig(DiffusersModelConfig):
    """Where the Chroma weights are (transformer/, vae/, scheduler/, text_encoder/, tokenizer/) and how to run
    them; resolution must be a multiple of 2x the VAE factor (16 for the real VAE)."""

    name: str = "chroma"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    max_sequence_length: PositiveInt = 512
    """T5 tokens per prompt (the pipeline's default)."""
    ip_adapter: IPAdapterSettings | None = None
    """Not supported for chroma: leave it unset."""

    def __post_init__(self):
        if self.ip_adapter is not None:
            raise ValueError(
                "model.ip_adapter is not supported for chroma (diffusers has no Chroma IP-Adapter to "
                "check it against): remove model.ip_adapter"
            )


class ChromaAdapter:
    """ModelAdapter for Chroma checkpoints (Chroma1-HD, Chroma1-Base): text-to-image with true CFG, or inpainting
    with the ``INPAINT`` part."""

    modality = "image"
    sampler_kind = "flow"
    reads_trajectory = False
    compiled_blocks = ()
    shard_units = Imported(
        (
            "diffusers.models.transformers.transformer_chroma:ChromaTransformerBlock",
            "diffusers.models.transformers.transformer_chroma:ChromaSingleTransformerBlock",
        )
    )
    config_class = ChromaConfig
    pipeline_class = Imported("diffusers:ChromaPipeline")
    text_components = Imported(
        {"text_encoder": "transformers:T5EncoderModel", "tokenizer": "transformers:T5TokenizerFast"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: ChromaConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

        from trainer.models import MODELS

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        self.pipeline_class, self.parts = MODELS[config.name].pipeline_class, MODELS[config.name].conditioning
        load = {"torch_dtype": self.dtype}
        saved = denoiser_config(ChromaTransformer2DModel, config, "transformer", "Chroma")
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **load)
        self.latents = PackedLatents(self.vae, self.pipeline_class, config.resolution, self.device, self.dtype)
        self.vae_factor, self.resolution = self.latents.vae_factor, self.latents.resolution
        self.latent_channels, self.latent_shape = self.latents.channels, self.latents.shape
        if saved["in_channels"] != self.latent_shape[1]:
            raise ValueError(
                f"model.path={config.path!r} holds a Chroma transformer reading {saved['in_channels']} input "
                f"channels, and its VAE gives {self.latent_shape[1]}: point model.path at one complete Chroma "
                "directory"
            )
        self.denoiser = ChromaTransformer2DModel.from_pretrained(path, subfolder="transformer", **load)
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
        self.ip_adapter = None
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)
        if config.gradient_checkpointing:
            checkpoint_single_blocks_with_mask(self.denoiser)

    @staticmethod
    def encode_text(
        pipeline: ChromaPipeline, config: ChromaConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """T5 embeddings [1, L, D] of one prompt and their mask [1, L] via the pipeline's encode_prompt."""
        embeds, _, mask, _, _, _ = pipeline.encode_prompt(
            prompt=[prompt],
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=config.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "prompt_mask": mask}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings and masks (cached per prompt), and the image conditioning of its parts."""
        reject_image_inputs(self.config.name, inputs, allowed=tuple(f for part in self.parts for f in part.fields))
        images = {k: v for part in self.parts for k, v in part.encode(self, len(prompts), inputs).items()}
        return Conditioning(embeds=self.prompts.cat(prompts), **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def inpaint_source(self, image: torch.Tensor) -> torch.Tensor:
        """The source's shifted, scaled and packed latents (posterior mean; read from ``model.image_latents`` when
        it holds them), float32: the pipeline shifts and scales in the model dtype."""
        latents = self.image_latents(self.latents.vae_input(image)).mode()
        latents = ((latents - self.vae.config.shift_factor) * self.vae.config.scaling_factor).float()
        return self.latents.pack(latents)

    def inpaint_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """True where to repaint, per packed latent entry (``PackedLatents.mask``)."""
        return self.latents.mask(mask)

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, h, w] packed to tokens, drawn as ``ChromaPipeline.prepare_latents`` draws it."""
        return self.latents.noise(batch_size, generator)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) shifted for this image token count."""
        return shifted_flow_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity for packed latents; with ``guidance_scale > 1`` CFG over [negative prompt; prompt] as one
        forward, the text masks extended over the image tokens by the pipeline's ``_prepare_attention_mask``; each
        part's change after (inpainting's known region)."""
        for part in self.parts:
            part.check(self, cond)
        embeds, mask = cond.embeds["prompt_embeds"], cond.embeds["prompt_mask"]
        n = latents.shape[0]
        # (sigma * 1000) / 1000 in the model dtype, exactly as the pipeline rounds its timestep.
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        hidden = latents.to(self.dtype)
        cfg = guidance_scale > 1.0
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]
            embeds = torch.cat([neg["prompt_embeds"].expand(n, -1, -1), embeds])
            mask = torch.cat([neg["prompt_mask"].expand(n, -1), mask])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        attention_mask = self.pipeline._prepare_attention_mask(len(hidden), hidden.shape[1], self.dtype, mask)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        out = net(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=self.latents.img_ids,
            attention_mask=attention_mask,
            return_dict=False,
        )[0]
        v = cfg_combine(*out.chunk(2), guidance_scale) if cfg else out.float()
        for part in self.parts:
            v = part.velocity(self, v, latents, sigma, cond)
        return v

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


def checkpoint_single_blocks_with_mask(denoiser: nn.Module) -> None:
    """Gradient checkpointing that hands the single-stream blocks the attention mask, which diffusers' checkpointed
    path leaves out (its plain path passes it): without it a training forward would not compute the rollout's.
    The mask of the running forward is recorded by a pre-hook and bound to each checkpointed call."""
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock

    running: dict[str, torch.Tensor | None] = {"mask": None}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        running["mask"] = kwargs.get("attention_mask")

    def checkpoint(block: nn.Module, *args):
        extra = {"attention_mask": running["mask"]} if isinstance(block, ChromaSingleTransformerBlock) else {}
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False, **extra)

    denoiser.register_forward_pre_hook(record, with_kwargs=True)
    denoiser.enable_gradient_checkpointing(checkpoint)
