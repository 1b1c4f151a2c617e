"""The tiny SD3 models: SD3 in the real layout (CLIP-L, CLIP-G, T5, VAE) and the embedded digits model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tiny_models import parts
from tiny_models.spec import TinySpec


def _tiny_components(path: Path) -> dict:
    """SD3 in the real layout: two CLIP encoders, a T5 encoder and a (one-block) VAE; 8x8 latent tokens."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    clip = {s: parts.clip_tokenizer(path / f"tokenizer{s}") for s in ("", "_2")}
    t5 = parts.t5_tokenizer(path / "tokenizer_3")
    return dict(
        transformer=SD3Transformer2DModel(
            sample_size=8,
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            pooled_projection_dim=64,
        ).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=parts.vae_1x(4),
        text_encoder=parts.clip_text_encoder(clip[""], "CLIPTextModelWithProjection"),
        tokenizer=clip[""],
        text_encoder_2=parts.clip_text_encoder(clip["_2"], "CLIPTextModelWithProjection"),
        tokenizer_2=clip["_2"],
        text_encoder_3=parts.t5_encoder(t5),
        tokenizer_3=t5,
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    side = adapter.latent_shape[-1] * adapter.pipeline.vae_scale_factor
    return dict(
        height=side, width=side, guidance_scale=guidance_scale, max_sequence_length=adapter.config.max_sequence_length
    )


def sd3() -> TinySpec:
    """The tiny SD3. Its learning test makes every step stochastic: at 8 pixels it gains more so than with the
    first step alone."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(max_sequence_length=parts.TEXT_LENGTH),
        guidance=3.0,
        learning=("algorithm.sampler.sde_window=0",),
        learning_epochs=20,
    )


def tiny() -> TinySpec:
    """The embedded model as the tests' tiny model: SD3's facts, built by ``build_tiny_sd3``, at its own size."""
    from trainer.models.tiny import build_tiny_sd3

    return replace(
        sd3(),
        components=None,
        build=build_tiny_sd3,
        config={},
        same_shapes=("sd3",),
        learning=(),
        learning_epochs=12,
    )


SPECS = {"sd3": sd3, "tiny": tiny}
