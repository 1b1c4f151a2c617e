"""The tiny FLUX.1 models: FLUX.1-dev, Fill and Kontext (one transformer, three pipelines)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from tiny_models import parts
from tiny_models.spec import TinySpec

_TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=[4, 4, 8],
    guidance_embeds=True,
)
_TINY_SCHEDULER = dict(
    use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
)


def tiny_components(path: Path, latent_channels: int = 1, **transformer) -> dict:
    """A FLUX.1 pipeline's components: CLIP + T5 text encoders, a one-block VAE with ``latent_channels``, the
    transformer with guidance embedding (``transformer``: config changes, e.g. Fill's channels)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    clip = parts.clip_tokenizer(path / "tokenizer")
    t5 = parts.t5_tokenizer(path / "tokenizer_2")
    return dict(
        transformer=FluxTransformer2DModel(**{**_TINY_TRANSFORMER, **transformer}).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**_TINY_SCHEDULER),
        vae=parts.vae_1x(latent_channels),
        text_encoder=parts.clip_text_encoder(clip),
        tokenizer=clip,
        text_encoder_2=parts.t5_encoder(t5),
        tokenizer_2=t5,
    )


def pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The FLUX pipelines' arguments for a text-to-image call at the adapter's resolution."""
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        max_sequence_length=adapter.config.max_sequence_length,
    )


def flux() -> TinySpec:
    """The tiny FLUX.1-dev."""
    return TinySpec(
        components=tiny_components,
        pipeline_call=pipeline_call,
        config=dict(resolution=16, max_sequence_length=parts.TEXT_LENGTH),
        guidance=3.5,
        ip_adapter=True,
        ip_pipeline=True,
    )


def _fill_call(adapter, inputs, guidance_scale: float) -> dict:
    return {**pipeline_call(adapter, inputs, guidance_scale), "image": inputs.image, "mask_image": inputs.mask}


def flux_fill() -> TinySpec:
    """FLUX.1-dev's tiny model and facts with Fill's channels (20 in: latents | masked image | mask; 8 out), an
    inpainting dataset, and no IP-Adapter in the pipeline (``FluxFillPipeline`` takes none)."""
    return replace(
        flux(),
        pipeline_call=_fill_call,
        components=partial(tiny_components, latent_channels=2, in_channels=20, out_channels=8),
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        ip_pipeline=False,
        posterior_draw="diffusers.pipelines.flux.pipeline_flux_fill.retrieve_latents",
    )


def _kontext_call(adapter, inputs, guidance_scale: float) -> dict:
    return {
        **pipeline_call(adapter, inputs, guidance_scale),
        "image": inputs.reference,
        "_auto_resize": False,
        "max_area": adapter.resolution**2,
    }


def flux_kontext() -> TinySpec:
    """FLUX.1-dev's tiny model and facts with a reference image from an editing dataset; FLUX.1-dev weights
    have Kontext's shapes."""
    return replace(
        flux(),
        pipeline_call=_kontext_call,
        inputs=("reference",),
        data="edit_jsonl",
        ip_adapter=False,
        same_shapes=("flux",),
        posterior_draw="diffusers.pipelines.flux.pipeline_flux_kontext.retrieve_latents",
    )


SPECS = {"flux": flux, "flux_fill": flux_fill, "flux_kontext": flux_kontext}
