"""The tiny SD1.5 inpainting model (a 9-channel UNet, DDIM)."""

from __future__ import annotations

from pathlib import Path

from tiny_models import parts
from tiny_models.spec import TinySpec


def _tiny_components(path: Path) -> dict:
    """SD1.5 inpainting: a 9-channel UNet, a 2x VAE with 4 latent channels, CLIP, SD1.5's DDIM settings."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=8,
        in_channels=9,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    ).eval()
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        sample_size=16,
    ).eval()
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    tok = parts.clip_tokenizer(path / "tokenizer")
    return dict(
        vae=vae,
        text_encoder=parts.clip_text_encoder(tok),
        tokenizer=tok,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        eta=0.0,
        image=inputs.image,
        mask_image=inputs.mask,
    )


def sd15_inpaint() -> TinySpec:
    """The tiny SD1.5 inpainting model. Its UNet learns at a tenth of the others' rate (at 1e-2 it rises, then
    collapses) and needs bigger groups."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(resolution=16),
        guidance=3.0,
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        posterior_draw="diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint.retrieve_latents",
        learning=("train.learning_rate=0.003", "algorithm.group_size=32"),
        learning_epochs=15,
        compiled_ratio_atol=1e-5,
        compiled_ratio_atol_bf16=0.08,
    )


SPECS = {"sd15_inpaint": sd15_inpaint}
