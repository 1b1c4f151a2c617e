"""LTX-2 (LTX2VideoTransformer3DModel, a joint audio-video transformer; AutoencoderKLLTX2Video; Gemma-3 hidden
states through LTX2TextConnectors) from a local diffusers directory: text-to-video as ``LTX2Pipeline`` samples it,
and image-to-video from an optional first frame as ``LTX2ImageToVideoPipeline`` does (the frame's latents pinned as
the first latent frame at timestep 0: ``conditioning.PINNED_FIRST_FRAME``, as Wan 2.2 TI2V-5B).

The transformer denoises a video and an audio stream together, each attending to the other. rewardflow trains
and scores the video only; the audio stream runs along as the pipeline runs it (drawn from noise after the
video's noise, deterministic Euler steps at its own CFG scale), because the video's velocity depends on it. A
rollout's latent is therefore the flat pair [packed video tokens; packed audio tokens]: the step's noise and
log-probability cover the video part alone, the audio part takes the Euler step, and the audio velocity is
detached in every forward, so that no loss trains the audio output. Decoding returns the frames; the audio is not
decoded (``model.audio`` is refused). Guidance is the pipeline's CFG in its x0 form; its STG, modality guidance
and guidance rescale are off (the noise-0 rollout equals the pipeline called with them off).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from trainer.config.fields import NonNegativeFloat, PositiveInt
from trainer.models.base import Conditioning, ImageInputs, StepFunction
from trainer.models.common import DTYPES, DiffusersModelConfig, Imported, freeze, load_denoiser
from trainer.models.flow import rectified_flow_target
from trainer.models.inputs import reject_image_inputs
from trainer.models.latents import ImageLatents
from trainer.models.text import PromptEmbeddings, load_text_components, prompt_encoder
from trainer.models.trainable import Trainable
from trainer.models.video import check_video_size
from trainer.samplers import flow_step, standard_normal

if TYPE_CHECKING:
    from diffusers import LTX2Pipeline


@dataclass
class LTX2Config(DiffusersModelConfig):
    """Where the LTX-2 weights are (transformer/, vae/, audio_vae/, text_encoder/, tokenizer/, connectors/,
    scheduler/) and the videos they make: ``frames`` pixel frames of ``height`` x ``width``, played at ``fps``."""

    name: str = "ltx2"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    frames: PositiveInt = 121
    """Pixel frames per video: 8k + 1 (the VAE keeps the first frame and compresses each 8 after it to one)."""
    height: PositiveInt = 512
    """Frame height in pixels: a multiple of 32 (the VAE's spatial compression)."""
    width: PositiveInt = 768
    """Frame width in pixels: a multiple of 32."""
    fps: PositiveInt = 24
    """Frames per second: the transformer's positions are in seconds, and the audio stream lasts frames / fps."""
    max_sequence_length: PositiveInt = 1024
    """Gemma tokens per prompt, left-padded to this length (the pipeline's default)."""
    audio_guidance_scale: NonNegativeFloat | None = None
    """CFG scale of the audio stream (which the video attends to); None: the rollout's guidance scale, as the
    pipeline takes None. LTX-2's authors suggest 7 (the pipeline's default argument)."""
    cross_timestep: bool = True
    """The pipeline's ``use_cross_timestep``: True for LTX-2.3 and later, False for LTX-2.0's behaviour."""
    audio: bool = False
    """Audio output: not supported (the audio stream runs along, untrained and not decoded)."""

    def __post_init__(self):
        if self.audio:
            raise ValueError(
                "model.audio=true: ltx2 generates and trains video only (the audio stream runs along, untrained and "
                "not decoded): unset model.audio"
            )


@dataclass
class VideoStep:
    """A flow step on the video part of the [video; audio] latent (its noise and log-probability are the video's
    alone) and the pipeline's Euler step on the audio part, which is state the video depends on, not action."""

    video: StepFunction
    schedule: torch.Tensor
    split: int

    def _audio(self, velocity: torch.Tensor, sample: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
        """x + (sigma_next - sigma) v in float32, as the scheduler's Euler step."""
        if isinstance(index, torch.Tensor):  # per-sample steps [B]; an int indexes without reading a device value
            index = index.to(self.schedule.device)
        dt = (self.schedule[index + 1] - self.schedule[index]).reshape(-1, 1)
        return sample[:, self.split :].float() + dt * velocity[:, self.split :].float()

    def __call__(self, model_output, sample, index, noise_level, prev_sample=None, generator=None):
        n = self.split
        given = None if prev_sample is None else prev_sample[:, :n]
        x, log_prob, mean, std = self.video(model_output[:, :n], sample[:, :n], index, noise_level, given, generator)
        audio = self._audio(model_output, sample, index)
        return torch.cat([x, audio.to(x.dtype)], 1), log_prob, torch.cat([mean, audio], 1), std

    def mean(self, model_output, sample, index, noise_level):
        mean, std = self.video.mean(model_output[:, : self.split], sample[:, : self.split], index, noise_level)
        return torch.cat([mean, self._audio(model_output, sample, index)], 1), std

    def std(self, index: int | torch.Tensor, noise_level: float, like: torch.Tensor) -> torch.Tensor:
        """The video step's noise std, shaped to broadcast over ``like``."""
        return self.video.std(index, noise_level, like[:, : self.split])

    def check_noise_level(self, noise_level: float) -> None:
        self.video.check_noise_level(noise_level)


class LTX2Adapter:
    """ModelAdapter for LTX-2 checkpoints (``ltx2``): text-to-video, or image-to-video from an optional first frame
    (``ImageInputs.image``)."""

    sampler_kind = "flow"
    modality = "video"
    shard_units = Imported(("diffusers.models.transformers.transformer_ltx2:LTX2VideoTransformerBlock",))
    config_class = LTX2Config
    compiled_blocks = ()
    pipeline_class = Imported("diffusers:LTX2Pipeline")
    text_components = Imported(
        {
            "text_encoder": "transformers:Gemma3ForConditionalGeneration",
            "tokenizer": "transformers:AutoTokenizer",
            "connectors": "diffusers.pipelines.ltx2:LTX2TextConnectors",
        }
    )
    optional_text: tuple[str, ...] = ()
    text_settings = ("dtype", "max_sequence_length")
    prompt_encoder = staticmethod(prompt_encoder)

    def __init__(self, config: LTX2Config, device: torch.device | str = "cpu"):
        from diffusers import (
            AutoencoderKLLTX2Audio,
            AutoencoderKLLTX2Video,
            FlowMatchEulerDiscreteScheduler,
            LTX2VideoTransformer3DModel,
        )

        from trainer.models import MODELS

        path = Path(config.path)
        self.config, self.device, self.dtype = config, torch.device(device), DTYPES[config.dtype]
        load = {"torch_dtype": self.dtype}
        transformer = load_denoiser(LTX2VideoTransformer3DModel, config, "transformer", "LTX-2", **load)
        self.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler")
        self.vae = AutoencoderKLLTX2Video.from_pretrained(path, subfolder="vae", **load)
        audio_vae = AutoencoderKLLTX2Audio.from_pretrained(path, subfolder="audio_vae", **load)
        self.pipeline = self.pipeline_class(
            scheduler=self.scheduler,
            vae=self.vae,
            audio_vae=audio_vae,
            transformer=transformer,
            vocoder=None,
            **load_text_components(config, self.device),
        )
        self.pipeline.to(self.device)
        freeze(self.vae, audio_vae)
        parts = MODELS[config.name].conditioning
        self.first_frame = parts[0] if parts else None
        self.reads_trajectory = any(part.reads_trajectory for part in parts)
        self.image_latents = ImageLatents.of(self.vae, config)
        self._shapes(config)
        self.denoiser = transformer
        self.trainable = Trainable(self.denoiser, config.lora, config.gradient_checkpointing)
        self.prompts = PromptEmbeddings.of(self, config)

    def _shapes(self, config: LTX2Config) -> None:
        """Checks the configured video size; sets the video's and the audio stream's latent sizes and the flat
        ``latent_shape`` of their pair."""
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        p = self.pipeline
        temporal, spatial = p.vae_temporal_compression_ratio, p.vae_spatial_compression_ratio
        check_video_size(
            config, temporal * p.transformer_temporal_patch_size, spatial * p.transformer_spatial_patch_size
        )
        self.frames, self.height, self.width, self.fps = config.frames, config.height, config.width, config.fps
        self.resolution = max(self.height, self.width)
        """The longer side: what a reward server's largest image side must take."""
        self.video_shape = (self.vae.config.latent_channels, (self.frames - 1) // temporal + 1)
        self.video_shape += (self.height // spatial, self.width // spatial)
        self.video_tokens = self.video_shape[1] * self.video_shape[2] * self.video_shape[3]
        per_second = p.audio_sampling_rate / p.audio_hop_length / p.audio_vae_temporal_compression_ratio
        audio = p.audio_vae.config
        self.audio_shape = (audio.latent_channels, round(self.frames / self.fps * per_second))
        self.audio_shape += (audio.mel_bins // p.audio_vae_mel_compression_ratio,)
        self.split = self.video_tokens * self.video_shape[0]
        self.first_tokens = self.video_shape[2] * self.video_shape[3] // p.transformer_spatial_patch_size**2
        self.first_frame_span = (1, self.first_tokens * self.video_shape[0])
        """The pinned first frame (``conditioning.PinnedFirstFrame``): the first latent frame's video tokens."""
        self.latent_shape = (self.split + self.audio_shape[0] * self.audio_shape[1] * self.audio_shape[2],)
        self.position_fps = conditioning_frame_rate(float(self.fps), 1.0)

    # --- conditioning -------------------------------------------------------------------------------
    @staticmethod
    def encode_text(
        pipeline: LTX2Pipeline, config: LTX2Config, device: torch.device, prompt: str
    ) -> dict[str, torch.Tensor]:
        """One prompt's Gemma hidden states (the pipeline's ``encode_prompt``) through the text connectors: the
        video and audio streams' text tokens [1, L, D] and their mask [1, L]."""
        embeds, mask, _, _ = pipeline.encode_prompt(
            [prompt], do_classifier_free_guidance=False, max_sequence_length=config.max_sequence_length, device=device
        )
        video, audio, text_mask = pipeline.connectors(embeds, mask, padding_side=pipeline.tokenizer.padding_side)
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_mask": text_mask}

    def encode_prompts(self, prompts: list[str], inputs: ImageInputs | None = None) -> Conditioning:
        """Per-prompt text tokens, cached by prompt text, and the optional first frame's latents."""
        fields = self.first_frame.fields if self.first_frame else ()
        reject_image_inputs(self.config.name, inputs, allowed=fields, kind="text-to-video")
        images = self.first_frame.encode(self, len(prompts), inputs) if self.first_frame else {}
        return Conditioning(embeds=self.prompts.cat(prompts), **images)

    def first_frame_latents(self, image: torch.Tensor) -> torch.Tensor:
        """A first frame [B, 3, H, W] in [0, 1] as ``LTX2ImageToVideoPipeline`` conditions on it (without its H.264
        re-compression, ``image_crf=0``): the posterior's mode, normalised by the VAE's statistics (without its
        scaling factor, as that pipeline does) and packed as the first latent frame's tokens, [B, h w C]."""
        p = self.pipeline
        pixels = (image.to(self.device, torch.float32) * 2 - 1)[:, :, None]
        latents = self.image_latents(pixels.to(self.vae.dtype)).mode().float()
        latents = p._normalize_latents(latents, self.vae.latents_mean, self.vae.latents_std)
        return p._pack_latents(latents, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size).flatten(1)

    def missing_prompts(self, prompts: Iterable[str], guidance_scales: Iterable[float]) -> list[str]:
        """Of ``prompts``, and of the negative prompt where a guidance scale runs CFG, those the
        ``model.text_embeddings`` store lacks."""
        cfg = any(max(self._scales(scale)) > 1.0 for scale in guidance_scales)
        return self.prompts.missing([*prompts, *[self.config.negative_prompt] * cfg])

    def prepare_latents(self, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
        """[B, N] noise: the video's [B, C, F, h, w] then the audio's [B, C, L, M] draw, as the pipeline draws
        them, each packed into the transformer's tokens and flattened."""
        p = self.pipeline
        video = standard_normal((batch_size, *self.video_shape), generator, self.device)
        audio = standard_normal((batch_size, *self.audio_shape), generator, self.device)
        video = p._pack_latents(video, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size)
        return torch.cat([video.flatten(1), p._pack_audio_latents(audio).flatten(1)], 1)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule: linspace(1, 1/T, T) shifted at mu of the video's token count."""
        import numpy as np
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        get = self.scheduler.config.get
        mu = calculate_shift(
            self.video_tokens,
            get("base_image_seq_len", 1024),
            get("max_image_seq_len", 4096),
            get("base_shift", 0.95),
            get("max_shift", 2.05),
        )
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        retrieve_timesteps(self.scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return self.scheduler.sigmas.to(torch.float32)

    def step_function(self, kind: str, schedule: torch.Tensor) -> StepFunction:
        """A flow step on the video part and Euler on the audio part (``VideoStep``)."""
        return VideoStep(flow_step(kind, schedule), schedule, self.split)

    # --- the network ---------------------------------------------------------------------------------
    def _scales(self, guidance_scale: float) -> tuple[float, float]:
        """(video, audio) CFG scales: the audio's is ``model.audio_guidance_scale``, or the video's (the
        pipeline's ``audio_guidance_scale or guidance_scale``)."""
        return guidance_scale, self.config.audio_guidance_scale or guidance_scale

    def _streams(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat [B, N] pair as the transformer's video [B, S, C] and audio [B, L, D] tokens."""
        n = latents.shape[0]
        return latents[:, : self.split].reshape(n, self.video_tokens, -1), latents[:, self.split :].reshape(
            n, self.audio_shape[1], -1
        )

    @staticmethod
    def _guided(out: torch.Tensor, x: torch.Tensor, s: torch.Tensor, scale: float, cfg: bool) -> torch.Tensor:
        """The pipeline's guidance in x0 form, back to a velocity: x0 = x - s v; x0_c + (g - 1)(x0_c - x0_u)."""
        if cfg:
            uncond, cond = out.float().chunk(2)
            x0 = x - cond * s
            x0 = x0 + (scale - 1) * (x0 - (x - uncond * s))
        else:
            x0 = x - out.float() * s
        return (x - x0) / s

    def predict(
        self, net: nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity of the [video; audio] pair; CFG (either scale > 1, as the pipeline decides) as one forward over
        [negative; prompt]; a first frame pinned as ``conditioning.PinnedFirstFrame`` joins it. The audio velocity is
        detached: it moves the audio stream and trains nothing (the weights only it reads get zero gradients, as DDP
        and FSDP expect every trainable weight to get one)."""
        video, audio = self._streams(latents.float())
        joined = self.first_frame.join(self, latents.float(), cond)[0] if self.first_frame else latents.float()
        x, a = (t.to(self.dtype) for t in self._streams(joined))
        scales = self._scales(guidance_scale)
        cfg = max(scales) > 1.0
        keys = ("prompt_embeds", "audio_prompt_embeds", "prompt_mask")
        embeds = [cond.embeds[k] for k in keys]
        timestep = sigma.to(torch.float32) * self.scheduler.config.num_train_timesteps
        video_timestep = self._video_timesteps(timestep, cond)
        if cfg:
            neg = self.prompts([self.config.negative_prompt])[0]
            n = latents.shape[0]
            embeds = [torch.cat([neg[k].expand(n, *e.shape[1:]), e]) for k, e in zip(keys, embeds, strict=True)]
            x, a, timestep = torch.cat([x, x]), torch.cat([a, a]), torch.cat([timestep, timestep])
            video_timestep = torch.cat([video_timestep, video_timestep])
        out_video, out_audio = net(
            hidden_states=x,
            audio_hidden_states=a,
            encoder_hidden_states=embeds[0],
            audio_encoder_hidden_states=embeds[1],
            timestep=video_timestep,
            audio_timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=embeds[2],
            audio_encoder_attention_mask=embeds[2],
            num_frames=self.video_shape[1],
            height=self.video_shape[2],
            width=self.video_shape[3],
            fps=self.position_fps,
            audio_num_frames=self.audio_shape[1],
            use_cross_timestep=self.config.cross_timestep,
            return_dict=False,
        )
        s = sigma.to(torch.float32).reshape(-1, 1, 1)
        v_video = self._guided(out_video, video, s, scales[0], cfg)
        v_audio = self._guided(out_audio, audio, s, scales[1], cfg)
        if v_audio.requires_grad:  # a zero tie: the weights only the audio output reads get a zero gradient
            v_video = v_video + v_audio.sum() * 0.0
        v = torch.cat([v_video.flatten(1), v_audio.detach().flatten(1)], 1)
        return self.first_frame.velocity(self, v, latents, sigma, cond) if self.first_frame else v

    def _video_timesteps(self, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The video tokens' timesteps: ``timestep`` [B], or with a pinned first frame one per token [B, S], 0 on
        the frame's tokens, as ``LTX2ImageToVideoPipeline`` makes them (the audio's stay [B])."""
        if cond.image is None:
            return timestep
        keep = torch.ones(self.video_tokens, device=timestep.device)
        keep[: self.first_tokens] = 0
        return timestep[:, None] * keep

    def training_target(
        self, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rectified flow on the pair: x_sigma = (1 - sigma) x0 + sigma noise, target velocity = noise - x0 (the
        audio part's prediction is detached, so only the video's error trains)."""
        return rectified_flow_target(x0, noise, sigma)

    def _video_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The video part of [B, N] latents as the VAE's [B, C, F, h, w], un-normalised as the pipeline does."""
        p = self.pipeline
        tokens = self._streams(latents)[0]
        video = p._unpack_latents(
            tokens, *self.video_shape[1:], p.transformer_spatial_patch_size, p.transformer_temporal_patch_size
        )
        return p._denormalize_latents(
            video, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor
        )

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Frames in [0, 1] [B, F, C, H, W] -> [B, N] latents for supervised targets: the video's posterior mean,
        normalised and packed (the inverse of ``decode``), and the audio stream at 0 (its latent mean): a clip's
        audio is not learned, it only conditions the video through the noised input."""
        if images.ndim != 5:
            raise ValueError(
                f"{self.config.name} learns from clips [B, F, C, H, W], and the data gives images "
                f"{tuple(images.shape)}: set train.warmup_steps=0"
            )
        p = self.pipeline
        x = (images.to(self.device, torch.float32) * 2 - 1).to(self.dtype).transpose(1, 2)
        latents = self.vae.encode(x).latent_dist.mode().float()
        latents = p._normalize_latents(
            latents, self.vae.latents_mean, self.vae.latents_std, self.vae.config.scaling_factor
        )
        video = p._pack_latents(latents, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size)
        return torch.cat([video.flatten(1), video.new_zeros(len(video), self.latent_shape[0] - self.split)], 1)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Frames [B, F, C, H, W] in [0, 1], float32, decoded in the VAE's dtype as the pipeline decodes at its
        default ``decode_timestep`` 0 (a timestep-conditioned VAE gets 0 and no noise); differentiable in
        ``latents``. The audio part is not decoded."""
        video = self._video_latents(latents.to(self.device, self.vae.dtype))
        timestep = None
        if self.vae.config.timestep_conditioning:
            timestep = torch.zeros(len(video), device=self.device, dtype=video.dtype)
        frames = self.vae.decode(video, timestep, return_dict=False)[0].float()
        return (frames / 2 + 0.5).clamp(0, 1).transpose(1, 2)
