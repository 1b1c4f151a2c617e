"""The tiny Chroma models: text-to-image and inpainting (one transformer, two pipelines)."""

from __future__ import annotations

from dataclasses import replace
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
    axes_dims_rope=[4, 4, 8],
    approximator_num_channels=8,
    approximator_hidden_dim=32,
    approximator_layers=1,
)
_TINY_SCHEDULER = dict(
    use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
)
"""Chroma1-HD's scheduler: FLUX.1's dynamic shifting."""


def _tiny_components(path: Path) -> dict:
    """Chroma: a 2-layer T5 encoder, a one-block VAE (1x, one latent channel) and the transformer."""
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    t5 = parts.t5_tokenizer(path / "tokenizer")
    return dict(
        transformer=ChromaTransformer2DModel(**_TINY_TRANSFORMER).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**_TINY_SCHEDULER),
        vae=parts.vae_1x(1),
        text_encoder=parts.t5_encoder(t5),
        tokenizer=t5,
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """ChromaPipeline's arguments at the adapter's resolution, with its negative prompt."""
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        negative_prompt=adapter.config.negative_prompt,
        max_sequence_length=adapter.config.max_sequence_length,
    )


def chroma() -> TinySpec:
    """The tiny Chroma: 16 pixels, 8x8 tokens."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(resolution=16, max_sequence_length=parts.TEXT_LENGTH),
        guidance=3.0,
    )


def _inpaint_components(path) -> dict:
    """Chroma's tiny components, the transformer's config also holding ``guidance_embeds=False`` as Chroma1-HD's
    config.json does: ChromaInpaintPipeline reads that key, which ChromaTransformer2DModel itself never sets."""
    components = _tiny_components(path)
    components["transformer"].register_to_config(guidance_embeds=False)
    return components


def _inpaint_call(adapter, inputs, guidance_scale: float) -> dict:
    """ChromaInpaintPipeline's arguments: Chroma's, the source image and mask, strength 1."""
    return {
        **_pipeline_call(adapter, inputs, guidance_scale),
        "image": inputs.image,
        "mask_image": inputs.mask,
        "strength": 1.0,
    }


def chroma_inpaint() -> TinySpec:
    """Chroma's tiny model and facts with an inpainting dataset; the parity check replaces the pipeline's
    posterior draw of the source by its mean, as the adapter takes."""
    return replace(
        chroma(),
        components=_inpaint_components,
        pipeline_call=_inpaint_call,
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        same_shapes=("chroma",),
        slow_dtype_cases=True,
        posterior_draw="diffusers.pipelines.chroma.pipeline_chroma_inpainting.retrieve_latents",
    )


SPECS = {"chroma": chroma, "chroma_inpaint": chroma_inpaint}
