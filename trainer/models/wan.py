"""Wan video models (WanTransformer3DModel, flow matching, UMT5 text encoder, AutoencoderKLWan) from a local
diffusers directory: Wan 2.1 (one transformer) and Wan 2.2 A14B (two experts switched at a timestep), text- or
image-to-video (a first-frame part, trainer/models/wan_parts.py; with a last frame too: first-last-frame-to-video,
Wan 2.1 FLF2V), and Wan 2.2 TI2V-5B.

Prompts go through ``WanPipeline.encode_prompt`` (cleaned, UMT5 hidden states zero-padded to
``max_sequence_length``). Latents are [C, F_latent, h, w] as the pipeline draws them; ``decode`` returns frames
[B, F, C, H, W] in [0, 1]. CFG is the pipeline's (on when ``guidance_scale > 1``; the low noise expert at
``guidance_scale_2``) as one batched forward over [negative; prompt]. The schedule is a
FlowMatchEulerDiscreteScheduler's at Wan's shift: the published folders configure UniPC (``flow_shift``), whose
multistep updates a rollout cannot score, so such a folder is run with Euler steps at its ``flow_shift`` (the
noise-0 rollout equals ``WanPipeline`` with that Euler scheduler). Wan 2.2's two experts are one module
(``WanExperts``) whose forward routes each row by its timestep, so the loop, LoRA, checkpoints and FSDP see one
denoiser.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeFloat, PositiveInt
from trainer.models.base import IMAGE_FIELDS, Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.models.video import check_video_size
from trainer.models.wan_parts import WanExperts
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import WanPipeline

EXPERTS = {"high_noise": ("transformer",), "low_noise": ("transformer_2",), "both": ("transformer", "transformer_2")}
"""``model.experts`` -> the experts (pipeline components) that train."""


@dataclass
class WanConfig(DiffusersModelConfig):
    """Where the Wan 2.1 weights are (transformer/, vae/, text_encoder/, tokenizer/, scheduler/) and the videos
    they make: ``frames`` pixel frames of ``height`` x ``width``, played at ``fps``."""

    name: str = "wan"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    frames: PositiveInt = 81
    """Pixel frames per video: 4k + 1 (the VAE keeps the first frame and compresses each 4 after it to one)."""
    height: PositiveInt = 480
    """Frame height in pixels: a multiple of 16 (the VAE's 8 times the transformer's 2x2 patches)."""
    width: PositiveInt = 832
    """Frame width in pixels: a multiple of 16."""
    fps: PositiveInt = 16
    """Frames per second the videos play at (the pipeline's export rate): metadata for rewards and logs."""
    max_sequence_length: PositiveInt = 512
    """UMT5 tokens per prompt, zero-padded to this length (the pipeline's default)."""
    flow_shift: NonNegativeFloat = 0.0
    """The schedule's shift; 0 reads the folder's scheduler config (UniPC's ``flow_shift``: 3.0 for 480p, 5.0
    for 720p in Wan's guidance)."""

    two_experts: ClassVar[bool] = False


@dataclass
class Wan22Config(WanConfig):
    """Wan 2.2 A14B: two experts, ``transformer`` for the high noise steps (timestep >= the pipeline's
    ``boundary_ratio`` x 1000) and ``transformer_2`` for the rest, each at its own guidance."""

    name: str = "wan22"
    experts: Literal["both", "high_noise", "low_noise"] = "both"
    """Which experts train (LoRA or full); the other stays frozen and still runs its steps."""
    guidance_scale_2: NonNegativeFloat | None = None
    """CFG scale of the low noise expert's steps; None: ``algorithm.sampler.guidance_scale`` (the pipeline's
    default)."""

    two_experts: ClassVar[bool] = True


@dataclass
class WanTI2VConfig(WanConfig):
    """Wan 2.2 TI2V-5B (one transformer, the 16x16 VAE of 48 channels, a timestep per token): text-to-video, or
    image-to-video from an optional first frame (``ImageInputs.image``). Its defaults are its 720p videos."""

    name: str = "wan_ti2v"
    frames: PositiveInt = 121
    """Pixel frames per video: 4k + 1 (121: five seconds at 24 fps)."""
    height: PositiveInt = 704
    """Frame height in pixels: a multiple of 32 (the VAE's 16 times the 2x2 patches)."""
    width: PositiveInt = 1280
    """Frame width in pixels: a multiple of 32."""
    fps: PositiveInt = 24


def refuse_other_variant(config: WanConfig, two: bool, expands: bool, in_channels: int, first_frame) -> None:
    """A ValueError naming the fix where ``model.path`` holds another Wan variant than ``model.name`` runs: another
    count of experts, TI2V-5B's timestep per token (``expand_timesteps``) or not, another transformer input width
    (text- vs image-to-video), found from the folder's configs before any weight is read."""
    where = f"model.path={config.path!r} holds"
    if two != config.two_experts:
        has, other = ("two experts", "wan22") if two else ("one transformer", "wan")
        raise ValueError(
            f"{where} a Wan model with {has}, and model.name={config.name} runs {'one' if two else 'two'}: "
            f"point model.path at its weights, or set model.name={other} (or its _i2v variant)"
        )
    pinned = bool(first_frame and first_frame.pinned)
    if expands != pinned:
        has = "a Wan 2.2 TI2V-5B (expand_timesteps)" if expands else "no Wan 2.2 TI2V-5B (no expand_timesteps)"
        raise ValueError(
            f"{where} {has} in model_index.json, and model.name={config.name} is "
            f"{'' if pinned else 'not '}one: point model.path at its weights, or set model.name to "
            f"{'wan_ti2v' if expands else 'wan, wan22 or their _i2v variants'}"
        )
    vae_file = Path(config.path) / "vae" / "config.json"
    if not vae_file.is_file():  # pixel space (the embedded tiny Wan): frames in, frames out
        return refuse_pixel_variant(config, first_frame)
    vae = json.loads(vae_file.read_text())
    z_dim, temporal = vae.get("z_dim", 16), vae.get("scale_factor_temporal", 4)
    wanted = z_dim + (first_frame.channels(z_dim, temporal) if first_frame else 0)
    if in_channels != wanted:
        kind = "image-to-video" if first_frame and not first_frame.pinned else "text-to-video"
        raise ValueError(
            f"{where} a Wan transformer of {in_channels} input channels, and model.name={config.name} ({kind}) "
            f"feeds it {wanted}: point model.path at a Wan {kind} checkpoint, or set model.name to the Wan variant "
            "of the one there"
        )


def refuse_pixel_variant(config: WanConfig, first_frame) -> None:
    """A ValueError naming the fix for an image-to-video variant on a folder without a VAE (its first frame is
    VAE-encoded)."""
    if first_frame is not None:
        raise ValueError(
            f"model.path={config.path!r} holds no vae/, and model.name={config.name} VAE-encodes its first frame: "
            "point model.path at a Wan checkpoint with its VAE, or use a text-to-video model.name"
        )


def euler_scheduler(path: Path, flow_shift: float):
    """A FlowMatchEulerDiscreteScheduler at Wan's shift: the folder's own when it is one, else one built at its
    UniPC config's ``flow_shift`` (``model.flow_shift`` > 0 replaces either)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    saved = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    if saved.get("_class_name") != FlowMatchEulerDiscreteScheduler.__name__:
        saved = {"num_train_timesteps": saved.get("num_train_timesteps", 1000), "shift": saved.get("flow_shift", 1.0)}
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(saved, **({"shift": flow_shift} if flow_shift > 0 else {}))
    return scheduler


def pipeline_settings(config: WanConfig) -> dict:
    """The pipeline's ``boundary_ratio`` and ``expand_timesteps`` from ``model_index.json``."""
    index = Path(config.path) / "model_index.json"
    saved = json.loads(index.read_text()) if index.is_file() else {}
    return {k: saved.get(k) for k in ("boundary_ratio", "expand_timesteps")}


class WanAdapter:
    """ModelAdapter for Wan checkpoints: text-to-video (2.1: ``wan``; 2.2 A14B: ``wan22``), image-to-video (a
    first-frame part, optionally with a last frame: ``wan_i2v`` (also Wan 2.1 FLF2V), ``wan22_i2v``) and Wan 2.2
    TI2V-5B (``wan_ti2v``)."""

    sampler_kind = "flow"
    modality = "video"
    shard_units = Imported(("diffusers.models.transformers.transformer_wan:WanTransformerBlock",))
    config_class = WanConfig
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:WanPipeline")
    text_components = Imported(
        {"text_encoder": "transformers:UMT5EncoderModel", "tokenizer": "transformers:AutoTokenizer"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: WanConfig, device: torch.device | str = "cpu"):
        from trainer.models import MODELS

        MODELS[config.name].provide(config)  # the embedded tiny Wan is built on first use
        path = Path(config.path)
        self.config, self.device, self.dtype = config, torch.device(device), DTYPES[config.dtype]
        self.pipeline_class, parts = MODELS[config.name].pipeline_class, MODELS[config.name].conditioning
        self.first_frame = parts[0] if parts else None
        self.reads_trajectory = any(part.reads_trajectory for part in parts)
        settings = pipeline_settings(config)
        experts = self._load_experts(config, settings, self.first_frame)
        self.scheduler = euler_scheduler(path, config.flow_shift)
        self.vae = load_vae(path, self.dtype)
        images = self.first_frame.components(path, self.dtype, self.device) if self.first_frame else {}
        self.pipeline = self.pipeline_class(
            vae=self.vae,
            scheduler=self.scheduler,
            **experts,
            **settings,
            **images,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae)
        if not parts:
            refuse_image_latents(config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)
        self._video_shape(config, experts["transformer"].config.patch_size)
        self.expand_timesteps = bool(settings["expand_timesteps"])
        if len(experts) == 1:
            self.denoiser = experts["transformer"]
        else:
            boundary = settings["boundary_ratio"] * self.scheduler.config.num_train_timesteps
            self.denoiser = WanExperts(**experts, boundary=boundary, trained=EXPERTS[config.experts])
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    def _video_shape(self, config: WanConfig, patch: tuple[int, int, int]) -> None:
        """Checks the configured video size and sets ``frames``, ``height``, ``width``, ``fps``, ``latent_shape``."""
        if self.vae is None:  # pixel space: latents are the frames, as the pipeline then draws them
            self.pipeline.vae_scale_factor_temporal = self.pipeline.vae_scale_factor_spatial = 1
        temporal, spatial = self.pipeline.vae_scale_factor_temporal, self.pipeline.vae_scale_factor_spatial
        check_video_size(config, temporal, spatial * patch[1])
        self.patch = patch
        self.frames, self.height, self.width, self.fps = config.frames, config.height, config.width, config.fps
        self.resolution = max(self.height, self.width)
        """The longer side: what a reward server's largest image side must take."""
        latent_frames = (self.frames - 1) // temporal + 1
        channels = self.vae.config.z_dim if self.vae is not None else self.pipeline.transformer.config.out_channels
        self.latent_shape = (channels, latent_frames, self.height // spatial, self.width // spatial)

    @staticmethod
    def _load_experts(config: WanConfig, settings: dict, first_frame) -> dict[str, nn.Module]:
        """``transformer`` (and Wan 2.2's ``transformer_2``), refused where the folder has the other count of
        experts or transformers of another input width (text-to-video vs image-to-video), before any weight."""
        from diffusers import WanTransformer3DModel

        load = {"torch_dtype": DTYPES[config.dtype]}
        saved = denoiser_config(WanTransformer3DModel, config, "transformer", "Wan")
        two = (Path(config.path) / "transformer_2").is_dir() and settings["boundary_ratio"] is not None
        refuse_other_variant(config, two, bool(settings["expand_timesteps"]), saved.get("in_channels", 16), first_frame)
        experts = {"transformer": load_denoiser(WanTransformer3DModel, config, "transformer", "Wan", **load)}
        if two:
            experts["transformer_2"] = load_denoiser(WanTransformer3DModel, config, "transformer_2", "Wan", **load)
        return experts

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: WanPipeline, config: WanConfig, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """[1, max_sequence_length, D] UMT5 embeddings of one prompt via the pipeline's encode_prompt."""
        embeds, _ = pipeline.encode_prompt(
            [prompt], do_classifier_free_guidance=False, max_sequence_length=config.max_sequence_length, device=device
        )
        return {"prompt_embeds": embeds}

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Per-prompt embeddings, cached by prompt text, and the first (and last) frame's conditioning where the
        variant takes one (``ImageInputs.image``, ``.last_image``); text-to-video takes no image inputs."""
        allowed = self.first_frame.fields if self.first_frame else ()
        reject_image_inputs(self.config.name, inputs, allowed=allowed, kind="text-to-video")
        embeds = self.prompts.cat(prompts)
        images = self.first_frame.encode(self, len(prompts), inputs) if self.first_frame else {}
        embeds.update({k: v for k, v in images.items() if k not in IMAGE_FIELDS})
        return Conditioning(embeds=embeds, **{k: v for k, v in images.items() if k in IMAGE_FIELDS})

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(scale > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, F, h, w], drawn as ``WanPipeline.prepare_latents`` draws it."""
        return standard_normal((batch_size, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The Euler scheduler's sigmas at Wan's shift, as the pipeline sets them."""
        self.scheduler.set_timesteps(num_steps, device=self.device)
        return self.scheduler.sigmas.to(torch.float32)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def guidance(self, timestep: torch.Tensor, guidance_scale: float) -> float | torch.Tensor:
        """The CFG scale per row: ``guidance_scale``, or Wan 2.2's ``guidance_scale_2`` on the low noise rows."""
        low = getattr(self.config, "guidance_scale_2", None)
        if low is None or low == guidance_scale:
            return guidance_scale
        high = self.denoiser.high_noise(timestep)
        return torch.where(high, guidance_scale, low).reshape(-1, 1, 1, 1, 1)

    def _timesteps(self, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The transformer's timesteps: [B], or with ``expand_timesteps`` (TI2V-5B) one per token [B, L], 0 on a
        pinned first frame's tokens, as the pipelines make them."""
        if not self.expand_timesteps:
            return timestep
        mask = self.first_frame.mask(self, cond) if self.first_frame else None
        if mask is None:
            mask = torch.ones(1, 1, *self.latent_shape[1:], device=self.device)
        return (mask[0][0][:, ::2, ::2].flatten()[None] * timestep[:, None]).contiguous()

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; CFG (``guidance_scale > 1``, as the pipeline decides) as one forward over [negative;
        prompt], combined in float32; the first frame's conditioning joined as the pipelines join it."""
        embeds = cond.embeds["prompt_embeds"]
        timestep = self._timesteps(sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps, cond)
        x, extra = self.first_frame.join(self, latents.float(), cond) if self.first_frame else (latents, {})
        x = x.to(self.dtype)
        cfg = guidance_scale > 1.0
        n = x.shape[0]
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]["prompt_embeds"]
            embeds = torch.cat([neg.expand(n, -1, -1), embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            extra = {k: torch.cat([v, v]) for k, v in extra.items()}
        out = net(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds, **extra, return_dict=False)[0]
        v = cfg_combine(*out.chunk(2), self.guidance(timestep[:n], guidance_scale)) if cfg else out.float()
        return self.first_frame.velocity(self, v, latents, sigma, cond) if self.first_frame else v

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    def latent_statistics(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and 1 / std, [1, C, 1, 1, 1] in ``dtype``, as the pipelines make them."""
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(self.device, dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(self.device, dtype)
        return mean, inv_std

    first_frame_span = (2, 1)
    """TI2V-5B's pinned first frame (``conditioning.PinnedFirstFrame``): the first latent frame of [B, C, F, h, w]."""

    def first_frame_latents(self, image: torch.Tensor) -> torch.Tensor:
        """A first frame [B, 3, H, W] in [0, 1] as TI2V-5B pins it: its posterior mean, normalised, [B, C, 1, h, w]."""
        pixels = (image.to(self.device, torch.float32) * 2 - 1)[:, :, None]
        latents = self.image_latents(pixels.to(self.vae.dtype)).mode().float()
        mean, inv_std = self.latent_statistics(torch.float32)
        return (latents - mean) * inv_std

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Frames in [0, 1] [B, F, C, H, W] -> latents (posterior mean, normalised as the I2V pipeline normalises
        its condition; the inverse of ``decode``) for supervised targets."""
        if images.ndim != 5:
            raise ValueError(
                f"{self.config.name} learns from clips [B, F, C, H, W], and the data gives images "
                f"{tuple(images.shape)}: set train.warmup_steps=0 (images there are first frames, not targets)"
            )
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype).transpose(1, 2)
        if self.vae is None:
            return x.float()
        latents = self.vae.encode(x).latent_dist.mode().float()
        mean, inv_std = self.latent_statistics(torch.float32)
        return (latents - mean) * inv_std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames [B, F, C, H, W] in [0, 1], float32: un-normalised and decoded in the VAE's dtype as the
        pipeline does; differentiable in ``latents`` (the frozen VAE builds no graph for latents without one), for
        the differentiable-reward algorithms."""
        if self.vae is None:
            return (latents.to(self.device, torch.float32) / 2 + 0.5).clamp(0, 1).transpose(1, 2)
        x = latents.to(self.device, self.vae.dtype)
        mean, inv_std = self.latent_statistics(x.dtype)
        video = self.vae.decode(x / inv_std + mean, return_dict=False)[0].float()
        return (video / 2 + 0.5).clamp(0, 1).transpose(1, 2)


def load_vae(path: Path, dtype: torch.dtype):
    """The folder's AutoencoderKLWan, or None where it has no ``vae/``: pixel space, where ``encode_images`` is
    2x - 1, ``decode`` (x + 1) / 2 clamped and the latents are [C, F, H, W] frames (the embedded tiny Wan)."""
    from diffusers import AutoencoderKLWan

    if not (path / "vae").is_dir():
        return None
    return AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
