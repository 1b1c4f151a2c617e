"""The tiny Wan video models (a UMT5 text encoder, the causal 3D VAE, WanTransformer3DModel): Wan 2.1's one
transformer and Wan 2.2 A14B's two experts, at 5 frames of 32x32 pixels (2 latent frames of 4x4, 8 tokens)."""

from __future__ import annotations

from pathlib import Path

from tiny_models import parts
from tiny_models.spec import TinySpec

Z_DIM = 4
"""Latent channels of the tiny VAE (Wan 2.1's has 16)."""
BOUNDARY_RATIO = 0.8
"""The tiny Wan 2.2's expert boundary: with 3 steps at shift 3 its timesteps are 1000, 751 and 9, so the high
noise expert runs the first step and the low noise one the other two (both run; A14B's own is 0.875)."""


def umt5_encoder(tok):
    """A 2-layer UMT5 encoder (the architecture of Wan's umt5-xxl) at the tiny T5 sizes."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=0,
        **parts.T5_ENCODER,
    )
    return UMT5EncoderModel(config).eval()


def wan_vae():
    """AutoencoderKLWan with 3 channels at every level: 8x spatial and 4x temporal compression as the real one,
    Z_DIM latent channels with their own (arbitrary, non-trivial) normalisation statistics."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=3,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3][:Z_DIM],
        latents_std=[1.5, 0.8, 2.0, 1.2][:Z_DIM],
    ).eval()


def wan_transformer(in_channels: int = Z_DIM, **extra):
    """WanTransformer3DModel: 2 blocks of 2 heads of 12 (rope splits each head 4/4/4 over frames, rows, columns)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=Z_DIM,
        text_dim=parts.T5_ENCODER["d_model"],
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
        **extra,
    ).eval()


def text_components(path: Path) -> dict:
    tok = parts.t5_tokenizer(path / "tokenizer")
    return dict(tokenizer=tok, text_encoder=umt5_encoder(tok))


def _scheduler():
    """Wan's published folders configure UniPC with flow_shift 3 (480p); the adapters run Euler steps at that
    shift, so the tiny folder saves that UniPC config and the adapter must read its shift."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def _wan21(path: Path) -> dict:
    return dict(**text_components(path), vae=wan_vae(), scheduler=_scheduler(), transformer=wan_transformer())


def _wan22(path: Path) -> dict:
    return dict(_wan21(path), transformer_2=wan_transformer(), boundary_ratio=BOUNDARY_RATIO)


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The pipeline with the adapter's Euler scheduler (it holds the same object), frames and size."""
    assert not adapter.config.negative_prompt, "the parity reference runs the default negative prompt"
    call = dict(
        height=adapter.height,
        width=adapter.width,
        num_frames=adapter.frames,
        guidance_scale=guidance_scale,
        max_sequence_length=adapter.config.max_sequence_length,
    )
    if getattr(adapter.config, "guidance_scale_2", None) is not None:
        call["guidance_scale_2"] = adapter.config.guidance_scale_2
    return call


CONFIG = dict(frames=5, height=32, width=32, max_sequence_length=parts.TEXT_LENGTH)


def wan() -> TinySpec:
    """The tiny Wan 2.1 T2V."""
    return TinySpec(components=_wan21, pipeline_call=_pipeline_call, config=CONFIG, guidance=3.0)


def wan22() -> TinySpec:
    """The tiny Wan 2.2 T2V A14B: two experts, the low noise one at its own guidance (guidance_scale_2), and
    one read of a device value per forward (the choice of expert, as the pipeline's loop makes it)."""
    return TinySpec(
        components=_wan22,
        pipeline_call=_pipeline_call,
        config=dict(CONFIG, guidance_scale_2=2.0),
        guidance=3.0,
        device_reads_per_forward=1,
    )


SPECS = {"wan": wan, "wan22": wan22}
"""Wan 2.1 T2V (``wan``) and Wan 2.2 T2V A14B (``wan22``)."""
