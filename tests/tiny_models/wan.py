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
    """AutoencoderKLWan at 8 base channels with the real dim_mult: 8x spatial and 4x temporal compression as the
    real one, Z_DIM latent channels with their own (arbitrary, non-trivial) normalisation statistics. Wan 2.1's
    upsamplers halve the channels: at 3 channels everywhere (the first tiny VAE) they left 1, which the RMS norms
    reduce to its sign, so the decoded frames hardly depended on the latents (top-half brightness std 0.0009 over
    16 draws, unmoved by 20 steps of gradient ascent on the latents themselves, |grad| 2e-7): GRPO had nothing to
    learn (issue 52). Here: std 0.0030, ascent +0.039, |grad| 1.6e-5."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3][:Z_DIM],
        latents_std=[1.5, 0.8, 2.0, 1.2][:Z_DIM],
    ).eval()


def wan22_vae():
    """Wan 2.2's VAE (TI2V-5B): residual blocks over 2x2-patchified pixels, 16x spatial and 4x temporal."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=4,
        decoder_base_dim=4,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
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

SHARED_RATE = ("train.learning_rate=0.02",)
"""The learning test's shared rate, declared: a video model's ``learning`` says it was measured to learn there."""
I2V_LEARNING = ("data.image_inputs=[image]", "train.learning_rate=0.05")
"""The I2V learning runs: the first frame from the inpainting rows (their masks unused), a higher rate, since
the pinned first frame leaves the reward fewer frames to move (at 0.02 for 24 epochs: wan_i2v +0.008, +0.019)."""


def wan() -> TinySpec:
    """The tiny Wan 2.1 T2V. Learning (12 epochs at the shared rate): +0.019, +0.018 (train seeds 0, 1)."""
    return TinySpec(
        components=_wan21,
        pipeline_call=_pipeline_call,
        config=CONFIG,
        guidance=3.0,
        learning=SHARED_RATE,
        video_compression=(4, 16),  # the tiny VAE's 4 frames and 8x8 pixels, patches 2x2
    )


def wan22() -> TinySpec:
    """The tiny Wan 2.2 T2V A14B: two experts, the low noise one at its own guidance (guidance_scale_2), and
    one read of a device value per forward (the choice of expert, as the pipeline's loop makes it). Learning
    (24 epochs; only the trained first step's high noise expert learns): +0.026, +0.025 (at 12: +0.008)."""
    return TinySpec(
        components=_wan22,
        pipeline_call=_pipeline_call,
        config=dict(CONFIG, guidance_scale_2=2.0),
        guidance=3.0,
        device_reads_per_forward=1,
        slow_dtype_cases=True,
        learning=SHARED_RATE,
        learning_epochs=24,
    )


def _image_components(path: Path) -> dict:
    """Wan 2.1 I2V's CLIP image tower (the tiny IP-Adapter encoder's sizes) and its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    side = parts.CLIP_VISION["image_size"]
    processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    return dict(image_encoder=CLIPVisionModel(CLIPVisionConfig(**parts.CLIP_VISION)).eval(), image_processor=processor)


I2V_CHANNELS = 2 * Z_DIM + 4
"""The I2V transformer's input: latents, the first frame's latents and the 4-channel frame mask."""


def _wan21_i2v(path: Path) -> dict:
    """Wan 2.1 I2V: one transformer that also attends to the first frame's CLIP tokens."""
    hidden, inner = parts.CLIP_VISION["hidden_size"], 2 * 12
    transformer = wan_transformer(I2V_CHANNELS, image_dim=hidden, added_kv_proj_dim=inner)
    return dict(_wan21(path), transformer=transformer, **_image_components(path))


CLIP_TOKENS = (parts.CLIP_VISION["image_size"] // parts.CLIP_VISION["patch_size"]) ** 2 + 1
"""The tiny CLIP tower's tokens per image (16 patches and the class token; ViT-H/14's 257 at 224 pixels)."""


def _wan21_flf2v(path: Path) -> dict:
    """Wan 2.1 FLF2V: Wan 2.1 I2V whose image embedder takes the first and the last frame's CLIP tokens one after
    the other, with a position table over both (``pos_embed_seq_len``: 514 in the 14B checkpoint), here random
    (diffusers starts it at zero), so that the frames' order shows."""
    import torch

    hidden, inner = parts.CLIP_VISION["hidden_size"], 2 * 12
    transformer = wan_transformer(
        I2V_CHANNELS, image_dim=hidden, added_kv_proj_dim=inner, pos_embed_seq_len=2 * CLIP_TOKENS
    )
    with torch.no_grad():
        transformer.condition_embedder.image_embedder.pos_embed.normal_()
    return dict(_wan21(path), transformer=transformer, **_image_components(path))


def _wan22_i2v(path: Path) -> dict:
    """Wan 2.2 I2V A14B: two experts, no image encoder."""
    experts = dict(transformer=wan_transformer(I2V_CHANNELS), transformer_2=wan_transformer(I2V_CHANNELS))
    return dict(_wan21(path), **experts, boundary_ratio=BOUNDARY_RATIO)


def _i2v_pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The first frame (and the last, where given) as tensors in [0, 1], one per call (the pipeline conditions a
    call on one image)."""
    last = {} if inputs.last_image is None else {"last_image": inputs.last_image}
    return dict(_pipeline_call(adapter, inputs, guidance_scale), image=inputs.image, **last)


def _clip_of_8bit_pictures(adapter) -> dict:
    """Wan 2.1 I2V's CLIP path reads the 8-bit picture a user passes (a tensor's [0, 1] values would be taken for
    8-bit ones; the pipeline refuses ``image_embeds`` beside the ``image`` it VAE-encodes): the tensor is handed
    to its ``encode_image`` as that picture, as the adapter's ``clip_hidden_states`` does (FLF2V: a list of the
    first and the last frame, each such a tensor)."""
    import torch
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    original = WanImageToVideoPipeline.encode_image

    def pictures(image):
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        return [Image.fromarray(p) for p in pixels]

    def encode_image(self, image, device=None):
        if isinstance(image, torch.Tensor):
            image = pictures(image)
        elif isinstance(image, list) and all(isinstance(i, torch.Tensor) for i in image):
            image = [p for i in image for p in pictures(i)]
        return original(self, image, device)

    return {"diffusers.pipelines.wan.pipeline_wan_i2v.WanImageToVideoPipeline.encode_image": encode_image}


FIRST_AND_LAST = ("image", "last_image")
"""The inputs of the ``+last`` variants: a first and a last frame (``WanImageToVideoPipeline(image=, last_image=)``)."""


def wan_i2v() -> TinySpec:
    """The tiny Wan 2.1 I2V; ``wan_i2v+last``: a tiny Wan 2.1 FLF2V, which ``wan_i2v`` loads as it loads the 14B
    FLF2V's folder. Learning (24 epochs, ``I2V_LEARNING``): +0.013, +0.013."""
    return TinySpec(
        components=_wan21_i2v,
        pipeline_call=_i2v_pipeline_call,
        config=CONFIG,
        inputs=("image",),
        data="inpaint_jsonl",
        pipeline_one_prompt=True,
        pipeline_patches=_clip_of_8bit_pictures,
        variants={"last": dict(components=_wan21_flf2v, inputs=FIRST_AND_LAST)},
        slow_dtype_cases=True,
        learning=I2V_LEARNING,
        learning_epochs=24,
    )


def wan22_i2v() -> TinySpec:
    """The tiny Wan 2.2 I2V A14B (a last frame optional: no CLIP tokens to pair; ``wan22_i2v+last`` gives one).
    Learning (24 epochs, ``I2V_LEARNING``): +0.034, +0.034."""
    return TinySpec(
        components=_wan22_i2v,
        pipeline_call=_i2v_pipeline_call,
        config=dict(CONFIG, guidance_scale_2=2.0),
        inputs=("image",),
        optional_inputs=("last_image",),
        variants={"last": dict(inputs=FIRST_AND_LAST, optional_inputs=())},
        data="inpaint_jsonl",
        pipeline_one_prompt=True,
        device_reads_per_forward=1,
        slow_dtype_cases=True,
        learning=I2V_LEARNING,
        learning_epochs=24,
    )


def _wan22_ti2v(path: Path) -> dict:
    """Wan 2.2 TI2V-5B: one transformer at a timestep per token (``expand_timesteps``), Wan 2.2's VAE."""
    return dict(_wan21(path), vae=wan22_vae(), expand_timesteps=True)


def wan_ti2v() -> TinySpec:
    """The tiny TI2V-5B at 32x64 pixels (2 latent frames of 2x4: 4 tokens); its optional first frame's parity
    is tests/integration/test_wan.py's. Wan 2.2's VAE keeps its channels (no halving): its decoded frames follow
    the latents (ascent +0.017 in 8 steps); learning (12 epochs at the shared rate): +0.024, +0.028."""
    return TinySpec(
        components=_wan22_ti2v,
        pipeline_call=_pipeline_call,
        config=dict(CONFIG, width=64),
        optional_inputs=("image",),
        slow_dtype_cases=True,
        learning=SHARED_RATE,
    )


def tiny_wan() -> TinySpec:
    """The embedded video model as the tests' tiny model: Wan 2.1's facts in pixel space (no VAE), built by
    ``build_tiny_wan``, at its own size (5 frames of 16x16 in 4x4 patches: 80 tokens)."""
    from dataclasses import replace

    from trainer.models.tiny_wan import build_tiny_wan

    return replace(
        wan(),
        components=None,
        build=build_tiny_wan,
        config={},
        pipeline_call=_pixel_pipeline_call,
        same_shapes=("wan",),  # the Wan 2.1 adapter at a tiny size: each loads the other's folder
    )


def _pixel_pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """``_pipeline_call`` at one frame fewer: WanPipeline rounds ``num_frames`` to 1 + a multiple of its temporal
    factor by adding one whenever ``num_frames % factor != 1``, which at factor 1 (no VAE) is always: F - 1 becomes
    the adapter's F."""
    return dict(_pipeline_call(adapter, inputs, guidance_scale), num_frames=adapter.frames - 1)


SPECS = {
    "tiny_wan": tiny_wan,
    "wan": wan,
    "wan22": wan22,
    "wan_i2v": wan_i2v,
    "wan22_i2v": wan22_i2v,
    "wan_ti2v": wan_ti2v,
}
"""The embedded tiny Wan, Wan 2.1 T2V, Wan 2.2 T2V A14B, Wan 2.1 I2V, Wan 2.2 I2V A14B, Wan 2.2 TI2V-5B."""
