"""FLUX.2 [dev] (Flux2Transformer2DModel, flow matching, guidance embedding, Mistral text encoder) from a local
diffusers directory. FLUX.2 [klein] (``flux2_klein``) is this adapter with another text path (``KleinText``: a Qwen3
text encoder, hidden states of layers 9, 18 and 27) and no guidance embedding: the base models run true CFG against
``negative_prompt`` when ``guidance_scale > 1`` (one batched forward over [negative; prompt]); the step-distilled
ones (``is_distilled`` in model_index.json) ignore the guidance scale, as their pipeline does. Its inpainting
(``flux2_klein_inpaint``) adds ``conditioning.SOFT_INPAINT``: the source's latents are a conditioning image (time id
10, the references after it), and the pipeline's blend with the mask made soft on the token grid comes from the
prediction, which reads the rollout's initial noise and schedule.

Latents live as the transformer sees them: the VAE's latents cut into 2x2 patches [B, 4C, h, w], normalised by
the VAE's batch-norm statistics, and packed to tokens [B, h*w, 4C]. Text (hidden states of three text encoder
layers stacked along channels, padded to ``max_sequence_length``), position ids (t, h, w, l) and the schedule
(shifted by FLUX.2's empirical mu) come from the pipeline itself, so a rollout at noise level 0 reproduces it.

Guidance: FLUX.2 [dev] is guidance-distilled: ``guidance_scale`` feeds the guidance embedding, one forward per
step, no CFG. Reference images (the pipelines' ``image``, multi-reference editing) are optional per item: their
latents follow the generated tokens with time ids 10, 20, ... (``ImageInputs.reference``, at ``model.resolution``,
where the pipelines keep up to 1024^2 pixels; they share one list across a batch, the adapter takes each item's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze
from trainer.models.flow import cfg_combine, rectified_flow_target
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal


@dataclass
class Flux2Config(DiffusersModelConfig):
    """Where the FLUX.2 weights are (transformer/, vae/, scheduler/, text_encoder/, tokenizer/) and how to run
    them; resolution must be a multiple of 2x the VAE factor (16 for the real VAE)."""

    name: str = "flux2"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    max_sequence_length: PositiveInt = 512
    """Text tokens per prompt, chat template included: every prompt is padded to it (the pipeline's default)."""
    text_encoder_out_layers: tuple[int, ...] = (10, 20, 30)
    """Text encoder hidden states stacked into the prompt embeddings (the pipeline's default)."""


def flux2_sigmas(scheduler, num_steps: int, image_seq_len: int, device: torch.device) -> torch.Tensor:
    """FLUX.2's schedule as its pipelines set it: sigmas linspace(1, 1/T, T) time-shifted by the empirical
    mu(image_seq_len, T) of ``compute_empirical_mu`` (a fit over token counts and step counts); sigmas[0..T]."""
    import numpy as np
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    retrieve_timesteps(
        scheduler,
        num_steps,
        device,
        sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
        mu=compute_empirical_mu(image_seq_len, num_steps),
    )
    return scheduler.sigmas.to(torch.float32)


def position_ids(t: int, h: int, w: int, length: int = 1) -> torch.Tensor:
    """The pipelines' 4-axis position ids [h * w * length, 4] = (t, row, column, l) in row-major order: image
    tokens (t = 0 for the generated image, 10, 20, ... for conditioning images) and text tokens (h = w = 1)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(length))


class Flux2Adapter:
    """ModelAdapter for FLUX.2 [dev] checkpoints (text-to-image)."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(
        (
            "diffusers.models.transformers.transformer_flux2:Flux2TransformerBlock",
            "diffusers.models.transformers.transformer_flux2:Flux2SingleTransformerBlock",
        )
    )
    config_class = Flux2Config
    pipeline_class = Imported("diffusers:Flux2Pipeline")
    compiled_blocks = ()
    label = "FLUX.2 [dev]"
    """The model its text path belongs to, in messages (``KleinText.label``)."""
    guidance_embedded = True
    """Whether the transformer has a guidance embedding (FLUX.2 [dev]; the Klein models run CFG instead)."""
    text_components = Imported(
        {"text_encoder": "transformers:Mistral3ForConditionalGeneration", "tokenizer": "transformers:AutoProcessor"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length", "text_encoder_out_layers")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: Flux2Config, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

        from trainer.models import MODELS

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        spec = MODELS[config.name]
        self.pipeline_class, self.parts = spec.pipeline_class, spec.conditioning
        self.reads_trajectory = spec.reads_trajectory
        self.label, self.guidance_embedded = spec.text_path.label, spec.text_path.guidance_embedded
        load = {"torch_dtype": self.dtype}
        saved = denoiser_config(Flux2Transformer2DModel, config, "transformer", self.label)
        self._check_guidance(saved)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLFlux2.from_pretrained(path, subfolder="vae", **load)
        self.vae_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)  # as the pipelines' vae_scale_factor
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor}")
        self.resolution = side
        self.tokens_side = side // self.vae_factor // 2
        self.latent_shape = (self.tokens_side**2, 4 * self.vae.config.latent_channels)
        fed = self.latent_shape[1]
        if saved.get("in_channels", 128) != fed:
            raise ValueError(
                f"model.path={config.path!r} holds a FLUX.2 transformer reading {saved.get('in_channels')} "
                f"channels, and its VAE gives {fed}: point model.path at one complete FLUX.2 directory"
            )
        self.denoiser = Flux2Transformer2DModel.from_pretrained(path, subfolder="transformer", **load)
        self.pipeline = self.pipeline_class(
            scheduler=self.scheduler,
            vae=self.vae,
            transformer=self.denoiser,
            **load_text_components(config, self.device),
            **self._pipeline_settings(path),
        )
        self.pipeline.to(self.device)
        assert self.pipeline.vae_scale_factor == self.vae_factor
        freeze(self.vae)
        self.image_latents = ImageLatents.of(self.vae, config)
        bn = self.vae.bn
        self.bn_mean = bn.running_mean.to(self.device, torch.float32).view(1, -1, 1, 1)
        self.bn_std = torch.sqrt(bn.running_var.to(self.device, torch.float32) + self.vae.config.batch_norm_eps).view(
            1, -1, 1, 1
        )
        self.img_ids = position_ids(0, self.tokens_side, self.tokens_side).to(self.device)
        self._txt_ids: dict[int, torch.Tensor] = {}
        self._image_ids: dict[int, torch.Tensor] = {}

        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    def _check_guidance(self, saved: dict[str, Any]) -> None:
        """A ValueError naming the fix when the saved transformer's guidance embedding is not its text path's
        (FLUX.2 [dev] weights for Klein, or the other way round)."""
        if bool(saved.get("guidance_embeds", True)) == self.guidance_embedded:
            return
        has = "has a guidance embedding (FLUX.2 [dev])" if saved.get("guidance_embeds", True) else "has none (Klein)"
        raise ValueError(
            f"model.path={self.config.path!r} holds a FLUX.2 transformer that {has}, which "
            f"model.name={self.config.name} does not run: point model.path at {self.label} weights, "
            "or set model.name to flux2 for FLUX.2 [dev] and flux2_klein for Klein"
        )

    def _pipeline_settings(self, path: Path) -> dict[str, Any]:
        """Pipeline arguments besides the components: Klein's ``is_distilled`` from model_index.json
        (step-distilled checkpoints run no CFG); none for FLUX.2 [dev]."""
        self.distilled = False
        if self.guidance_embedded:
            return {}
        index = path / "model_index.json"
        saved = json.loads(index.read_text()) if index.is_file() else {}
        self.distilled = bool(saved.get("is_distilled", False))
        return {"is_distilled": self.distilled}

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(pipeline, config: Flux2Config, device: torch.device, prompt: str) -> dict[str, torch.Tensor]:
        """The [1, max_sequence_length, 3D] embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _ = pipeline.encode_prompt(
            prompt=[prompt],
            device=device,
            max_sequence_length=config.max_sequence_length,
            text_encoder_out_layers=tuple(config.text_encoder_out_layers),
        )
        return {"prompt_embeds": embeds}

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings (cached per prompt) and the image conditioning of its parts (reference images, if an
        item has any; inpainting's source and mask)."""
        reject_image_inputs(self.config.name, inputs, allowed=tuple(f for part in self.parts for f in part.fields))
        images = {k: v for part in self.parts for k, v in part.encode(self, len(prompts), inputs).items()}
        return Conditioning(embeds=self.prompts.cat(prompts), **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(self._runs_cfg(scale) for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def reference_latents(self, references: torch.Tensor) -> torch.Tensor:
        """The reference images [B, N, 3, H, W] as packed, normalised latents one after the other [B, N * L, 4C]
        (posterior mode, as the pipelines' argmax; from ``model.image_latents`` when it holds them), float32."""
        return torch.cat(
            [
                self.model_latents(self.image_latents(self._vae_input(references[:, i])).mode())
                for i in range(references.shape[1])
            ],
            dim=1,
        )

    def inpaint_source(self, image: torch.Tensor) -> torch.Tensor:
        """The source's packed, normalised latents z (posterior mean, as the pipeline's argmax; read from
        ``model.image_latents`` when it holds them), float32."""
        return self.model_latents(self.image_latents(self._vae_input(image)).mode())

    def inpaint_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[B, L, 1]: the mask binarised at 0.5, then interpolated bilinearly to the token grid, as the pipeline's
        ``prepare_mask_latents`` does."""
        binary = (mask.to(self.device, torch.float32) >= 0.5).float()
        soft = nn.functional.interpolate(binary, size=(self.tokens_side, self.tokens_side), mode="bilinear")
        return self.pipeline._pack_latents(soft)

    def _conditioning_ids(self, images: int) -> torch.Tensor:
        """Position ids of the generated tokens followed by ``images`` conditioning images' (time ids 10, 20,
        ... as the pipelines' ``_prepare_image_ids``)."""
        if images not in self._image_ids:
            side = self.tokens_side
            self._image_ids[images] = torch.cat(
                [self.img_ids, *(position_ids(10 * (i + 1), side, side).to(self.device) for i in range(images))]
            )
        return self._image_ids[images]

    def _model_input(self, x: torch.Tensor, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
        """(transformer hidden_states, img_ids) for packed latents ``x`` in the model dtype: the latents, then
        inpainting's source tokens and the references' tokens, if any."""
        images = [t for t in (cond.image, cond.reference) if t is not None]
        if not images:
            return x, self.img_ids
        tokens = torch.cat([x, *(t.to(x.dtype) for t in images)], dim=1)
        return tokens, self._conditioning_ids(tokens.shape[1] // x.shape[1] - 1)

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, 4C, h, w] packed to tokens, drawn as the pipelines' ``prepare_latents`` draw it."""
        h = self.tokens_side
        noise = standard_normal((batch_size, self.latent_shape[1], h, h), generator, self.device)
        return self.pipeline._pack_latents(noise)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule for this image token count (``flux2_sigmas``)."""
        return flux2_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def _runs_cfg(self, guidance_scale: float) -> bool:
        return not self.guidance_embedded and guidance_scale > 1.0 and not self.distilled

    def _txt_ids_for(self, length: int) -> torch.Tensor:
        if length not in self._txt_ids:
            self._txt_ids[length] = position_ids(0, 1, 1, length).to(self.device)
        return self._txt_ids[length]

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity for packed latents. FLUX.2 [dev] gets ``guidance_scale`` as its guidance embedding; a model
        without one runs CFG over [negative prompt; prompt] as one forward where ``_runs_cfg`` says so; each
        part's change after (inpainting's known region)."""
        for part in self.parts:
            part.check(self, cond)
        embeds = cond.embeds["prompt_embeds"]
        n = latents.shape[0]
        # (sigma * 1000) / 1000 in the model dtype, exactly as the pipelines round their timestep.
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        hidden, img_ids = self._model_input(latents.to(self.dtype), cond)
        guidance = None
        if self.guidance_embedded:
            guidance = torch.full((n,), guidance_scale, device=self.device, dtype=torch.float32)
        cfg = self._runs_cfg(guidance_scale)
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]["prompt_embeds"]
            embeds = torch.cat([neg.expand(n, -1, -1), embeds])
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
        out = net(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=self._txt_ids_for(embeds.shape[1]),
            img_ids=img_ids,
            return_dict=False,
        )[0]
        out = out[:, : latents.shape[1]]
        v = cfg_combine(*out.chunk(2), guidance_scale) if cfg else out.float()
        for part in self.parts:
            v = part.velocity(self, v, latents, sigma, cond)
        return v

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    # --- latents and images ----------------------------------------------------------------------------
    def model_latents(self, vae_latents: torch.Tensor) -> torch.Tensor:
        """VAE latents [B, C, H, W] -> the packed, normalised tokens [B, HW/4, 4C] the transformer works in
        (float32): 2x2 patches, (x - bn mean) / bn std, packed, as the pipelines' ``_encode_vae_image``."""
        patches = self.pipeline._patchify_latents(vae_latents.float())
        return self.pipeline._pack_latents((patches - self.bn_mean) / self.bn_std)

    def vae_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``model_latents`` (float32)."""
        b, _, c = latents.shape
        h = self.tokens_side
        patches = latents.float().permute(0, 2, 1).reshape(b, c, h, h) * self.bn_std + self.bn_mean
        return self.pipeline._unpatchify_latents(patches)

    def _vae_input(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the VAE's input: mapped to [-1, 1] in float32, then cast once."""
        return (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> packed latents (posterior mean; the inverse of ``decode``) for supervised targets."""
        return self.model_latents(self.vae.encode(self._vae_input(images)).latent_dist.mode())

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        x = self.vae.decode(self.vae_latents(latents).to(self.dtype), return_dict=False)[0].float()
        return (x / 2 + 0.5).clamp(0, 1)


@dataclass
class Flux2KleinConfig(Flux2Config):
    """FLUX.2 [klein] weights (4B or 9B, base or distilled); the settings of FLUX.2."""

    name: str = "flux2_klein"
    text_encoder_out_layers: tuple[int, ...] = (9, 18, 27)
    """Qwen3 hidden states stacked into the prompt embeddings (the pipeline's default)."""


class KleinText:
    """FLUX.2 [klein]'s text path: a Qwen3 text encoder (its chat template, hidden states of three layers stacked),
    called as FLUX.2's; its transformer has no guidance embedding."""

    label = "FLUX.2 [klein]"
    guidance_embedded = False
    text_components = Imported(
        {"text_encoder": "transformers:Qwen3ForCausalLM", "tokenizer": "transformers:Qwen2Tokenizer"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = Flux2Adapter.text_settings
    encode_text = staticmethod(Flux2Adapter.encode_text)
    prompt_encoder = staticmethod(prompt_encoder)
