"""Wan text-to-video (WanTransformer3DModel, flow matching, UMT5 text encoder, AutoencoderKLWan) from a local
diffusers directory: Wan 2.1 (one transformer) and Wan 2.2 A14B (two experts switched at a timestep).

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
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
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


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one denoiser: rows whose timestep >= ``boundary`` run ``transformer`` (high
    noise), the others ``transformer_2``, a batch with both split and joined back. Choosing reads the timesteps
    on the host, once per forward, as the pipeline's loop does. The experts not in ``trained`` stay frozen."""

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary: float, trained: tuple[str, ...]):
        super().__init__()
        self.transformer, self.transformer_2, self.boundary = transformer, transformer_2, boundary
        self.trained = trained

    def _trained(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.trained]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, **kwargs) -> tuple[torch.Tensor]:
        """The experts' ``forward(..., return_dict=False)`` per row."""
        kwargs.pop("return_dict", None)
        high = self.high_noise(timestep)
        count = int(high.sum())
        if count in (0, len(high)):
            expert = self.transformer if count else self.transformer_2
            return expert(hidden_states=hidden_states, timestep=timestep, **kwargs, return_dict=False)
        out = hidden_states.new_empty(
            hidden_states.shape[0], self.transformer.config.out_channels, *hidden_states.shape[2:]
        )
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            picked = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            out[rows] = expert(hidden_states=hidden_states[rows], timestep=timestep[rows], **picked, return_dict=False)[
                0
            ]
        return (out,)

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows the high noise expert runs (per-token timesteps: by their largest)."""
        t = timestep if timestep.ndim == 1 else timestep.amax(1)
        return t >= self.boundary

    def requires_grad_(self, requires_grad: bool = True) -> WanExperts:
        super().requires_grad_(requires_grad)
        for name in ("transformer", "transformer_2"):
            if name not in self.trained:
                getattr(self, name).requires_grad_(False)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def peft_config(self) -> dict:
        return self._trained()[0].peft_config

    def add_adapter(self, config) -> None:
        for expert in self._trained():
            expert.add_adapter(config)

    def disable_adapters(self) -> None:
        for expert in self._trained():
            expert.disable_adapters()

    def enable_adapters(self) -> None:
        for expert in self._trained():
            expert.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()
        self.transformer_2.enable_gradient_checkpointing()

    def save_pretrained(self, directory: str) -> None:
        """Both experts, as ``transformer/`` and ``transformer_2/`` of ``directory``."""
        self.transformer.save_pretrained(str(Path(directory) / "transformer"))
        self.transformer_2.save_pretrained(str(Path(directory) / "transformer_2"))

    @classmethod
    def from_pretrained(cls, directory: str, torch_dtype: torch.dtype | None = None) -> WanExperts:
        """What ``save_pretrained`` wrote (its weights; routing is the loading adapter's)."""
        from diffusers import WanTransformer3DModel

        experts = [
            WanTransformer3DModel.from_pretrained(str(Path(directory) / name), torch_dtype=torch_dtype)
            for name in ("transformer", "transformer_2")
        ]
        return cls(*experts, boundary=0.0, trained=())


def check_video_size(config: WanConfig, temporal: int, spatial: int) -> None:
    """ValueErrors naming the nearest valid values for frames that are not ``temporal`` k + 1 and sides that are
    not multiples of ``spatial``."""
    if config.resolution:
        raise ValueError(f"model.resolution={config.resolution}: {config.name} takes model.height and model.width")
    if config.frames % temporal != 1 % temporal:
        below = (config.frames - 1) // temporal * temporal + 1
        raise ValueError(
            f"model.frames={config.frames} must be {temporal}k + 1 (Wan's VAE compresses {temporal} frames after the "
            f"first to one): the nearest are {below} and {below + temporal}"
        )
    for side in ("height", "width"):
        value = getattr(config, side)
        if value % spatial:
            below = value // spatial * spatial
            nearest = f"{below} and {below + spatial}" if below else f"{spatial}"
            raise ValueError(f"model.{side}={value} must be a multiple of {spatial}: the nearest are {nearest}")


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
    """ModelAdapter for Wan text-to-video checkpoints (2.1: ``wan``; 2.2 A14B: ``wan22``)."""

    sampler_kind = "flow"
    modality = "video"
    shard_units = Imported(("diffusers.models.transformers.transformer_wan:WanTransformerBlock",))
    config_class = WanConfig
    reads_trajectory = False
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:WanPipeline")
    text_components = Imported(
        {"text_encoder": "transformers:UMT5EncoderModel", "tokenizer": "transformers:AutoTokenizer"}
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: WanConfig, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKLWan

        from trainer.models import MODELS

        path = Path(config.path)
        self.config = config
        self.device = torch.device(device)
        self.dtype = DTYPES[config.dtype]
        settings = pipeline_settings(config)
        experts = self._load_experts(config, settings["boundary_ratio"])
        self.scheduler = euler_scheduler(path, config.flow_shift)
        self.vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", torch_dtype=self.dtype)
        self.pipeline = MODELS[config.name].pipeline_class(
            vae=self.vae,
            scheduler=self.scheduler,
            **experts,
            **settings,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae)
        refuse_image_latents(config.name, config)
        self.image_latents = ImageLatents.of(self.vae, config)

        temporal, spatial = self.pipeline.vae_scale_factor_temporal, self.pipeline.vae_scale_factor_spatial
        self.patch = experts["transformer"].config.patch_size
        check_video_size(config, temporal, spatial * self.patch[1])
        self.frames, self.height, self.width, self.fps = config.frames, config.height, config.width, config.fps
        self.resolution = max(self.height, self.width)
        self.latent_shape = (
            self.vae.config.z_dim,
            (self.frames - 1) // temporal + 1,
            self.height // spatial,
            self.width // spatial,
        )
        if len(experts) == 1:
            self.denoiser = experts["transformer"]
        else:
            boundary = settings["boundary_ratio"] * self.scheduler.config.num_train_timesteps
            self.denoiser = WanExperts(**experts, boundary=boundary, trained=EXPERTS[config.experts])
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    @staticmethod
    def _load_experts(config: WanConfig, boundary_ratio: float | None) -> dict[str, nn.Module]:
        """``transformer`` (and Wan 2.2's ``transformer_2``), refused where the folder has the other count."""
        from diffusers import WanTransformer3DModel

        load = {"torch_dtype": DTYPES[config.dtype]}
        denoiser_config(WanTransformer3DModel, config, "transformer", "Wan")  # a Wan folder, before the count
        two = (Path(config.path) / "transformer_2").is_dir() and boundary_ratio is not None
        if two != config.two_experts:
            has, other = ("two experts", "wan22") if two else ("one transformer", "wan")
            raise ValueError(
                f"model.path={config.path!r} holds a Wan model with {has}, and model.name={config.name} runs "
                f"{'one' if two else 'two'}: point model.path at its weights, or set model.name={other}"
            )
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
        """Per-prompt embeddings, cached by prompt text. Text-to-video takes no image inputs."""
        reject_image_inputs(self.config.name, inputs)
        return Conditioning(embeds=self.prompts.cat(prompts))

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

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; CFG (``guidance_scale > 1``, as the pipeline decides) as one forward over [negative;
        prompt], combined in float32."""
        embeds = cond.embeds["prompt_embeds"]
        timestep = sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps
        x = latents.to(self.dtype)
        cfg = guidance_scale > 1.0
        n = x.shape[0]
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]["prompt_embeds"]
            embeds = torch.cat([neg.expand(n, -1, -1), embeds])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        out = net(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]
        if cfg:
            return cfg_combine(*out.chunk(2), self.guidance(timestep[:n], guidance_scale))
        return out.float()

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    def _statistics(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel latent mean and 1 / std, [1, C, 1, 1, 1] in ``dtype``, as the pipelines make them."""
        shape = (1, self.vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean).view(shape).to(self.device, dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(shape).to(self.device, dtype)
        return mean, inv_std

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Frames in [0, 1] [B, F, C, H, W] -> latents (posterior mean, normalised as the I2V pipeline normalises
        its condition; the inverse of ``decode``) for supervised targets."""
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype).transpose(1, 2)
        latents = self.vae.encode(x).latent_dist.mode().float()
        mean, inv_std = self._statistics(torch.float32)
        return (latents - mean) * inv_std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames [B, F, C, H, W] in [0, 1], float32: un-normalised and decoded in the VAE's dtype as the
        pipeline does."""
        x = latents.to(self.device, self.vae.dtype)
        mean, inv_std = self._statistics(x.dtype)
        video = self.vae.decode(x / inv_std + mean, return_dict=False)[0].float()
        return (video / 2 + 0.5).clamp(0, 1).transpose(1, 2)
