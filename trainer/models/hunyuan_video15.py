"""HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel, flow matching, a Qwen2.5-VL text model and a ByT5 glyph
encoder, AutoencoderKLHunyuanVideo15) from a local diffusers directory: text-to-video, and image-to-video from a
first frame (a conditioning part, trainer/models/hunyuan_video15_parts.py).

Prompts are encoded as ``HunyuanVideo15Pipeline.encode_prompt`` encodes them: the Qwen2.5-VL hidden states two
layers below the last of the prompt in the pipeline's chat template (its system message cropped), and ByT5's
states of the prompt's quoted text (zeros where it quotes none), each zero-padded with its mask. Latents are
[C, F_latent, h, w] as the pipeline draws them; the transformer reads them beside condition latents and their mask
(zeros for text-to-video, the first frame's for image-to-video); ``decode`` returns frames [B, F, C, H, W] in
[0, 1]. CFG is the pipeline's ``ClassifierFreeGuidance`` guider (on unless the scale is 1), batched as one forward
over [negative; prompt]. The schedule is the pipeline's: Euler steps over linspace(1, 0) shifted by the scheduler's
``shift``. For text-to-video the image embeddings the pipeline feeds as 729 zero tokens, which the transformer masks
out of every attention, are left out: the same velocities (equal on the tiny model), less attention.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import torch
from torch import nn

from trainer.config.fields import PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, denoiser_config, freeze, load_denoiser
from trainer.models.flow import cfg_combine, rectified_flow_target
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents, refuse_image_latents
from trainer.models.text import PromptEmbeddings, load_text_components
from trainer.models.trainable import Trainable
from trainer.models.video import check_video_size
from trainer.quiet import truncation_notice_once
from trainer.samplers import flow_step, standard_normal

TEXT = ("prompt_embeds", "prompt_mask", "prompt_embeds_2", "prompt_mask_2")
"""The tensors cached per prompt: Qwen2.5-VL's states and mask, ByT5's states and mask."""
TRANSFORMER_TEXT = dict(
    zip(
        TEXT,
        ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2"),
        strict=True,
    )
)
"""Each cached tensor's argument of the transformer's forward."""


@dataclass
class HunyuanVideo15Config(DiffusersModelConfig):
    """Where the HunyuanVideo 1.5 weights are (transformer/, vae/, text_encoder/, tokenizer/, text_encoder_2/,
    tokenizer_2/, scheduler/, guider/; image-to-video also image_encoder/, feature_extractor/) and the videos they
    make: ``frames`` pixel frames of ``height`` x ``width``, played at ``fps``. The defaults are the 480p model's
    16:9 clips of five seconds."""

    name: str = "hunyuan_video15"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    frames: PositiveInt = 121
    """Pixel frames per video: 4k + 1 (the VAE keeps the first frame and compresses each 4 after it to one)."""
    height: PositiveInt = 480
    """Frame height in pixels: a multiple of 16 (the VAE's 16 times the transformer's 1x1 patches)."""
    width: PositiveInt = 848
    """Frame width in pixels: a multiple of 16."""
    fps: PositiveInt = 24
    """Frames per second the videos play at: metadata for rewards and logs."""
    max_sequence_length: PositiveInt = 1000
    """Qwen2.5-VL tokens per prompt after the template's system message, zero-padded (the pipeline's 1000)."""
    max_sequence_length_2: PositiveInt = 256
    """ByT5 bytes of the prompt's quoted text, zero-padded (the pipeline's 256)."""


I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"


def refuse_other_variant(config: HunyuanVideo15Config, saved: dict, latent_channels: int, i2v: bool) -> None:
    """A ValueError naming the fix where ``model.path`` holds another HunyuanVideo 1.5 variant than ``model.name``
    runs (text- vs image-to-video: the pipeline of model_index.json, else the transformer's ``task_type``; a
    transformer of another input width), or image-to-video weights it cannot run, read from configs before any
    weight."""
    where = f"model.path={config.path!r} holds"
    index = Path(config.path) / "model_index.json"
    pipeline = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    holds_i2v = pipeline == I2V_PIPELINE if pipeline else saved.get("task_type") == "i2v"
    kind, other = ("image-to-video", "hunyuan_video15_i2v") if holds_i2v else ("text-to-video", "hunyuan_video15")
    if holds_i2v != i2v:
        raise ValueError(
            f"{where} HunyuanVideo 1.5 {kind} weights, and model.name={config.name} runs "
            f"{'image' if i2v else 'text'}-to-video: set model.name={other}, or point model.path at a HunyuanVideo "
            f"1.5 {'i2v' if i2v else 't2v'} checkpoint"
        )
    wanted = 2 * latent_channels + 1
    if saved.get("in_channels") != wanted:
        raise ValueError(
            f"{where} a transformer of {saved.get('in_channels')} input channels, and model.name={config.name} feeds "
            f"it {wanted} (latents, condition latents, mask): point model.path at a HunyuanVideo 1.5 "
            f"{'i2v' if i2v else 't2v'} checkpoint"
        )
    if i2v and saved.get("use_meanflow"):
        raise ValueError(
            f"{where} a step-distilled transformer (use_meanflow), whose second timestep model.name={config.name} "
            "does not feed: point model.path at a HunyuanVideo 1.5 i2v checkpoint without use_meanflow"
        )
    missing = [d for d in ("image_encoder", "feature_extractor") if i2v and not (Path(config.path) / d).is_dir()]
    if missing:
        raise ValueError(
            f"{where} no {' or '.join(missing)}/, which model.name={config.name} reads its first frame with: point "
            "model.path at a whole diffusers HunyuanVideo 1.5 i2v folder (with its SigLIP image encoder)"
        )


def load_guider(path: Path):
    """The folder's ``ClassifierFreeGuidance`` (a default one where it has none), refused where its settings make
    another combination than uncond + scale (cond - uncond) at every step, which a rollout reproduces."""
    from diffusers import ClassifierFreeGuidance

    if not (path / "guider").is_dir():
        return ClassifierFreeGuidance()
    guider = ClassifierFreeGuidance.from_pretrained(path, subfolder="guider")
    settings = {k: guider.config.get(k) for k in ("guidance_rescale", "use_original_formulation", "start", "stop")}
    if settings != {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0}:
        raise ValueError(
            f"{path / 'guider'} configures CFG with {settings}, which the hunyuan_video15 adapter does not "
            "reproduce: set guidance_rescale 0, use_original_formulation false, start 0 and stop 1 in its config.json"
        )
    return guider


def text_only(config: HunyuanVideo15Config, device: torch.device) -> SimpleNamespace:
    """The text encoders and tokenizers alone (what ``encode_text`` reads), without the pipeline, whose
    constructor needs a VAE."""
    return SimpleNamespace(**load_text_components(replace(config, text_embeddings=""), device))


class HunyuanVideo15Adapter:
    """ModelAdapter for HunyuanVideo 1.5 checkpoints (480p and 720p): text-to-video (``hunyuan_video15``) and
    image-to-video (a first-frame part: ``hunyuan_video15_i2v``)."""

    sampler_kind = "flow"
    modality = "video"
    reads_trajectory = False
    shard_units = Imported(
        ("diffusers.models.transformers.transformer_hunyuan_video15:HunyuanVideo15TransformerBlock",)
    )
    config_class = HunyuanVideo15Config
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:HunyuanVideo15Pipeline")
    text_components = Imported(
        {
            "text_encoder": "transformers:Qwen2_5_VLTextModel",
            "tokenizer": "transformers:AutoTokenizer",
            "text_encoder_2": "transformers:T5EncoderModel",
            "tokenizer_2": "transformers:AutoTokenizer",
        }
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length", "max_sequence_length_2")

    def __init__(self, config: HunyuanVideo15Config, device: torch.device | str = "cpu"):
        from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler

        from trainer.models import MODELS

        path = Path(config.path)
        self.config, self.device, self.dtype = config, torch.device(device), DTYPES[config.dtype]
        self.pipeline_class, parts = MODELS[config.name].pipeline_class, MODELS[config.name].conditioning
        self.first_frame = parts[0] if parts else None
        if not parts:
            refuse_image_latents(config.name, config)
        self.transformer = self._load_transformer(config, self.first_frame is not None)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLHunyuanVideo15.from_pretrained(path, subfolder="vae", torch_dtype=self.dtype)
        images = self.first_frame.components(path, self.dtype, self.device) if self.first_frame else {}
        self.pipeline = self.pipeline_class(
            transformer=self.transformer,
            vae=self.vae,
            scheduler=self.scheduler,
            guider=load_guider(path),
            **images,
            **load_text_components(config, self.device),
        )
        self.pipeline.tokenizer_max_length = config.max_sequence_length
        self.pipeline.tokenizer_2_max_length = config.max_sequence_length_2
        self.pipeline.to(self.device)
        freeze(self.vae)
        self.image_latents = ImageLatents.of(self.vae, config)
        self._video_shape(config)
        self.denoiser = self.transformer
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    @staticmethod
    def _load_transformer(config: HunyuanVideo15Config, i2v: bool) -> nn.Module:
        """The transformer, once the folder is known to hold the variant ``model.name`` runs (before any weight)."""
        from diffusers import HunyuanVideo15Transformer3DModel

        saved = denoiser_config(HunyuanVideo15Transformer3DModel, config, "transformer", "HunyuanVideo 1.5")
        vae = json.loads((Path(config.path) / "vae" / "config.json").read_text())
        refuse_other_variant(config, saved, vae.get("latent_channels", 32), i2v)
        load = {"torch_dtype": DTYPES[config.dtype]}
        return load_denoiser(HunyuanVideo15Transformer3DModel, config, "transformer", "HunyuanVideo 1.5", **load)

    def _video_shape(self, config: HunyuanVideo15Config) -> None:
        """Checks the configured video size and sets ``frames``, ``height``, ``width``, ``fps``, ``latent_shape``."""
        temporal, spatial = self.vae.temporal_compression_ratio, self.vae.spatial_compression_ratio
        check_video_size(config, temporal, spatial * self.transformer.config.patch_size)
        self.frames, self.height, self.width, self.fps = config.frames, config.height, config.width, config.fps
        self.resolution = max(self.height, self.width)
        """The longer side: what a reward server's largest image side must take."""
        latent_frames = (self.frames - 1) // temporal + 1
        channels = self.vae.config.latent_channels
        self.latent_shape = (channels, latent_frames, self.height // spatial, self.width // spatial)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(pipeline, config: HunyuanVideo15Config, device: torch.device, prompt: str) -> dict:
        """One prompt's Qwen2.5-VL states [1, max_sequence_length, D] and ByT5 states [1, max_sequence_length_2,
        D2] with their masks, as ``HunyuanVideo15Pipeline.encode_prompt`` makes them (its template and crop)."""
        from diffusers import HunyuanVideo15Pipeline as Pipeline

        embeds, mask = Pipeline._get_mllm_prompt_embeds(
            pipeline.text_encoder, pipeline.tokenizer, [prompt], device, config.max_sequence_length
        )
        embeds_2, mask_2 = Pipeline._get_byt5_prompt_embeds(
            pipeline.tokenizer_2, pipeline.text_encoder_2, [prompt], device, config.max_sequence_length_2
        )
        dtype = DTYPES[config.dtype]
        return dict(zip(TEXT, (t.to(dtype) for t in (embeds, mask, embeds_2, mask_2)), strict=True))

    @staticmethod
    def prompt_encoder(model, config: HunyuanVideo15Config, device: torch.device | str):
        """The text path alone as prompt -> tensors (``trainer.precompute``)."""
        device = torch.device(device)
        truncation_notice_once()
        return functools.partial(model.encode_text, text_only(config, device), config, device)

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Per-prompt embeddings, cached by prompt text, and the first frame's conditioning where the variant takes
        one (``ImageInputs.image``); text-to-video takes no image inputs."""
        allowed = self.first_frame.fields if self.first_frame else ()
        reject_image_inputs(self.config.name, inputs, allowed=allowed, kind="text-to-video")
        embeds = self.prompts.cat(prompts)
        if not self.first_frame:
            return Conditioning(embeds=embeds)
        images = self.first_frame.encode(self, len(prompts), inputs)
        embeds["image_embeds"] = images.pop("image_embeds")
        return Conditioning(embeds=embeds, **images)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(uses_cfg(scale) for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """Noise [B, C, F, h, w], drawn as ``HunyuanVideo15Pipeline.prepare_latents`` draws it in float32."""
        return standard_normal((batch_size, *self.latent_shape), generator, self.device)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 0, T + 1)[:-1] shifted by the scheduler, then 0."""
        import numpy as np

        self.scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device=self.device)
        return self.scheduler.sigmas.to(torch.float32)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step; sigma_max = schedule[1] replaces sigma where sigma == 1 (no division by zero)."""
        return flow_step(kind, schedule)

    # --- the network ---------------------------------------------------------------------------------
    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity; CFG (unless ``guidance_scale`` is 1, as the guider decides) as one forward over [negative;
        prompt], combined in float32. The transformer reads the condition latents and mask beside the latents (zeros
        for text-to-video), the image embeddings (the first frame's, for both branches) and the timestep in the
        weights' dtype, as the pipelines feed them."""
        n = latents.shape[0]
        x = latents.to(self.dtype)
        if self.first_frame:
            condition, image = self.first_frame.join(self, cond)
        else:
            condition = x.new_zeros(n, x.shape[1] + 1, *x.shape[2:])
            image = x.new_zeros(n, 0, self.transformer.config.image_embed_dim)
        x = torch.cat([x, condition], dim=1)
        timestep = (sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype)
        text = {k: cond.embeds[k] for k in TEXT}
        cfg = uses_cfg(guidance_scale)
        if cfg:
            negative = self.prompts([self.config.negative_prompt])[0]
            text = {k: torch.cat([negative[k].expand(n, *v.shape[1:]), v]) for k, v in text.items()}
            x, timestep, image = torch.cat([x, x]), torch.cat([timestep, timestep]), torch.cat([image, image])
        args = {TRANSFORMER_TEXT[k]: v for k, v in text.items()}
        out = net(hidden_states=x, timestep=timestep, image_embeds=image, **args, return_dict=False)[0]
        return cfg_combine(*out.chunk(2), guidance_scale) if cfg else out.float()

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0."""
        return rectified_flow_target(x0, noise, sigma)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Clips in [0, 1] [B, F, C, H, W] -> latents (posterior mean times the scaling factor, as the image-to-video
        pipeline encodes; the inverse of ``decode``) for supervised targets, one clip per VAE forward."""
        if images.ndim != 5:
            raise ValueError(
                f"{self.config.name} learns from clips [B, F, C, H, W], and the data gives images "
                f"{tuple(images.shape)}: set train.warmup_steps=0 (its image inputs are first frames, not targets)"
            )
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype).transpose(1, 2)
        latents = torch.cat([self.vae.encode(clip[None]).latent_dist.mode() for clip in x]).float()
        return latents * self.vae.config.scaling_factor

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames [B, F, C, H, W] in [0, 1], float32, decoded in the VAE's dtype as the pipeline does, one clip per
        forward (the VAE's attention mask broadcasts over one clip only in diffusers 0.42); differentiable in
        ``latents`` for the differentiable-reward algorithms."""
        x = latents.to(self.device, self.vae.dtype) / self.vae.config.scaling_factor
        video = torch.cat([self.vae.decode(clip[None], return_dict=False)[0] for clip in x]).float()
        return (video / 2 + 0.5).clamp(0, 1).transpose(1, 2)


def uses_cfg(guidance_scale: float) -> bool:
    """Whether the pipeline's ``ClassifierFreeGuidance`` runs the unconditional branch at ``guidance_scale``."""
    return not math.isclose(guidance_scale, 1.0)
