"""Qwen-Image 2.1 (QwenImage21Transformer2DModel, flow matching, Qwen3-VL text encoder) from a local directory.

What differs from Qwen-Image (trainer/models/qwen_image.py), and why this is its own family: the transformer is
single-stream and block-causal over one joint sequence [text; image], whose image block takes its rotary frame
position from the text length it follows; latents are the VAE's 64 channels per 16x16 pixel tile, unpatched; the
VAE is RGBA; CFG is plain (no norm rescaling) and the model is meant to be sampled without it; a Turbo folder
carries its own sigma grid (``sample_sigmas``). Prompts go through the pipeline's ``encode_prompt`` (its raw
template, Qwen3-VL's last layer before its final norm, the system prefix dropped).

Because the image's position follows the text, padding a prompt changes its image: the pipeline's output for a
prompt depends on the longest prompt batched with it. Here each row is computed at its own text length (one
forward per distinct length, CFG's negative prompt being one more), so a sample equals the pipeline run on its
prompt alone, whatever it is batched, chunked or selected with. Conditioning is the usual right-padded text with
``prompt_mask`` (``ragged``); a padded batch's lengths are read once per ``predict`` (Z-Image's cut reads them too).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction, ragged_prompts
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target, shifted_flow_sigmas
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import QwenImage21Pipeline


VAE_FACTOR = 16
"""Pixels per latent token along a side: ``QwenImage21Pipeline.vae_scale_factor`` (a constant there)."""


@dataclass
class QwenImage21Config(DiffusersModelConfig):
    """Where the Qwen-Image 2.1 weights are (transformer/, vae/, text_encoder/, processor/, scheduler/) and how to
    run them."""

    name: str = "qwen_image21"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    resolution: NonNegativeInt = 1024
    negative_prompt: str = " "
    """The negative prompt of CFG (``guidance_scale > 1``); the pipeline reads an empty prompt as a space."""


@functools.cache
def text_processor_class() -> type:
    """Qwen3-VL's processor for text and images alone: its constructor without the video processor, which
    text-to-image never calls and which transformers defines only where torchvision is installed."""
    from transformers import Qwen3VLProcessor

    class TextProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return TextProcessor


def length_groups(lengths: list[int]) -> dict[int, list[int]]:
    """Row indices by text length, lengths in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(lengths):
        groups.setdefault(length, []).append(row)
    return groups


def gather_text(texts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """[k, L, D] of k rows given as (tensor, row): a slice or an expand where they are consecutive rows of one
    tensor or one row repeated (no copy), else a concatenation."""
    first, start = texts[0]
    if all(t is first for t, _ in texts):
        rows = [r for _, r in texts]
        if rows == list(range(start, start + len(rows))):
            return first[start : start + len(rows)]
        if rows == [start] * len(rows):
            return first[start : start + 1].expand(len(rows), -1, -1)
    return torch.cat([t[r : r + 1] for t, r in texts])


class QwenImage21Adapter:
    """ModelAdapter for Qwen-Image 2.1 checkpoints (text-to-image)."""

    modality = "image"
    sampler_kind = "flow"
    shard_units = Imported(("diffusers.models.transformers.transformer_qwenimage21:QwenImage21TransformerBlock",))
    config_class = QwenImage21Config
    pipeline_class = Imported("diffusers:QwenImage21Pipeline")
    reads_trajectory = False
    compiled_blocks = ()
    text_components = Imported(
        {"text_encoder": "transformers:Qwen3VLForConditionalGeneration", "processor": text_processor_class}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype",)
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: QwenImage21Config, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        self.vae_factor = VAE_FACTOR
        side = config.resolution
        if side <= 0 or side % (2 * self.vae_factor):
            raise ValueError(
                f"model.resolution={side} must be a positive multiple of {2 * self.vae_factor} (the VAE's "
                f"{self.vae_factor}x, and the text encoder's image slots of 2x2 latent tokens)"
            )
        load = {"torch_dtype": self.dtype}
        self.denoiser = load_denoiser(QwenImage21Transformer2DModel, config, "transformer", "Qwen-Image 2.1", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLQwenImage21.from_pretrained(path, subfolder="vae", **load)
        index = path / "model_index.json"
        self.sample_sigmas = json.loads(index.read_text()).get("sample_sigmas") if index.is_file() else None
        """A Turbo checkpoint's own sigma grid (its pipeline samples those steps), else None."""
        text = load_text_components(config, self.device)
        self.pipeline: QwenImage21Pipeline | None = None
        """The pipeline over these components; None without text encoders (its constructor reads the processor)."""
        if not config.text_embeddings:
            self.pipeline = self.pipeline_class(
                scheduler=self.scheduler,
                vae=self.vae,
                transformer=self.denoiser,
                sample_sigmas=self.sample_sigmas,
                **text,
            )
        self.vae.to(self.device)
        self.denoiser.to(self.device)
        freeze(self.vae)
        refuse_image_latents(config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)

        self.resolution = side
        self.latent_channels = self.denoiser.config.in_channels
        self.latent_side = side // self.vae_factor
        self.latent_shape = (self.latent_side**2, self.latent_channels)
        z_dim = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean, device=self.device).view(1, z_dim, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std, device=self.device).view(1, z_dim, 1, 1, 1)

        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: QwenImage21Pipeline, config: QwenImage21Config, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """Unpadded [L, D] embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _, _ = pipeline.encode_prompt([prompt], device=device)
        return {"prompt_embeds": embeds[0]}

    def _text(self, prompts: list[str]) -> list[torch.Tensor]:
        return [e["prompt_embeds"] for e in self.prompts(prompts)]

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Text embeddings right-padded to the batch's longest prompt, with ``prompt_mask``."""
        reject_image_inputs(self.config.name, inputs)
        return ragged_prompts(self._text(prompts))

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, 1, C, h, w] flattened to tokens [B, h w, C], drawn as the pipeline's ``prepare_latents``."""
        h = self.latent_side
        noise = standard_normal((batch_size, 1, self.latent_channels, h, h), generator, self.device)
        return noise.view(batch_size, self.latent_channels, h * h).transpose(1, 2)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T) (a Turbo folder's ``sample_sigmas``) shifted for this image
        token count."""
        if self.sample_sigmas is not None and num_steps != len(self.sample_sigmas):
            raise ValueError(
                f"model.path={self.config.path!r} is a step-distilled Qwen-Image 2.1 whose pipeline samples "
                f"{len(self.sample_sigmas)} steps (model_index.json's sample_sigmas), not {num_steps}: set the "
                f"sampler's num_steps to {len(self.sample_sigmas)}"
            )
        return shifted_flow_sigmas(self.scheduler, num_steps, self.latent_shape[0], self.device, self.sample_sigmas)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; with ``guidance_scale > 1`` CFG against ``negative_prompt``, as the pipeline combines them
        (no rescaling). Rows run at their own text length, those of one length in one forward."""
        n = latents.shape[0]
        x = latents.to(self.dtype)
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        texts = self._rows(cond)
        if guidance_scale > 1.0:
            (neg,) = self._text([self.config.negative_prompt])
            texts += [(neg[None], 0)] * n
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = self._forward(net, x, timestep, texts)
        if guidance_scale > 1.0:
            return cfg_combine(out[n:], out[:n], guidance_scale)
        return out.float()

    def _rows(self, cond: Conditioning) -> list[tuple[torch.Tensor, int]]:
        """Each row's text as (the [B, L, D] tensor it is in, its row), cut to its length: a padded batch reads its
        lengths from the device (``Conditioning`` carries no host-side lengths); an unpadded one reads none."""
        embeds = cond.embeds["prompt_embeds"]
        if not cond.padded:
            return [(embeds, row) for row in range(len(embeds))]
        lengths = cond.embeds["prompt_mask"].sum(1).tolist()
        return [(embeds[row : row + 1, :length], 0) for row, length in enumerate(lengths)]

    def _forward(
        self, net: nn.Module, x: torch.Tensor, timestep: torch.Tensor, texts: list[tuple[torch.Tensor, int]]
    ) -> torch.Tensor:
        """The transformer's output [R, N, C] for rows ``x`` [R, N, C], each with its text (``_rows``' form):
        one forward per text length, as the pipeline runs one prompt (no padding, so no text mask)."""
        groups = length_groups([t.shape[1] for t, _ in texts])
        outs, order = [], []
        for rows in groups.values():
            pick = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else rows
            outs.append(self._transformer(net, x[pick], timestep[pick], gather_text([texts[i] for i in rows])))
            order.extend(rows)
        if len(outs) == 1:
            return outs[0]
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return torch.cat(outs)[torch.tensor(inverse, device=x.device)]

    def _transformer(self, net: nn.Module, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor):
        """One forward of rows sharing one text length: the layout the pipeline builds (text, then one image slot
        per 2x2 latent tokens) and its image shape; the image tokens of the joint output."""
        b, tokens, _ = x.shape
        slots = torch.zeros(b, text.shape[1] + tokens // 4, dtype=torch.bool, device=x.device)
        slots[:, text.shape[1] :] = True
        return net(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=text.to(x.dtype),
            img_shapes=[[(1, self.latent_side, self.latent_side)]] * b,
            img_mask=slots,
            return_dict=False,
        )[0][:, -tokens:]

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    def _pack(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, 1, h, w] -> tokens [B, h w, C] (2.1 takes latents unpatched)."""
        b, c = latents.shape[:2]
        return latents.reshape(b, c, -1).transpose(1, 2)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """RGB images in [0, 1] -> normalised latent tokens (posterior mean) for supervised targets: opaque RGBA, as
        the pipeline makes its images RGBA before its VAE reads them."""
        rgb = images.to(self.device, torch.float32)
        rgba = torch.cat([rgb, torch.ones_like(rgb[:, :1])], dim=1)
        x = (rgba * 2 - 1).to(self.dtype)[:, :, None]
        latents = (self.vae.encode(x).latent_dist.mode().float() - self.latents_mean) / self.latents_std
        return self._pack(latents)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """RGB images in [0, 1]: the VAE's RGBA composited over white (the pipeline returns RGBA; reward models
        read RGB, and the pipeline composites over white where its text encoder reads an RGBA image)."""
        b, _, c = latents.shape
        x = latents.float().transpose(1, 2).reshape(b, c, 1, self.latent_side, self.latent_side)
        x = x * self.latents_std + self.latents_mean
        x = self.vae.decode(x.to(self.dtype), return_dict=False)[0][:, :, 0].float()
        rgba = (x / 2 + 0.5).clamp(0, 1)
        alpha = rgba[:, 3:]
        return rgba[:, :3] * alpha + (1 - alpha)
