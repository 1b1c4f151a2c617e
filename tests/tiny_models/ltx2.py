"""The tiny LTX-2 (joint audio-video LTX2VideoTransformer3DModel, AutoencoderKLLTX2Video, Gemma-3 text encoder and
the text connectors, the audio VAE and vocoder) at 5 frames of 32x32 pixels: 3 latent frames of 8x8 (192
video tokens) and 5 audio latent frames."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import parts
from tiny_models.spec import TinySpec

GEMMA_TEXT = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    sliding_window=8,
)
"""A 2-layer Gemma-3 language model (the architecture of LTX-2's Gemma-3-12B) at test sizes."""
LATENT_CHANNELS = 4
"""Video latent channels of the tiny VAE (LTX-2's has 128)."""
VAE = dict(
    latent_channels=LATENT_CHANNELS,
    patch_size=1,
    block_out_channels=(8, 8),
    layers_per_block=(1, 1, 1),
    down_block_types=("LTX2VideoDownBlock3D",) * 2,
    spatio_temporal_scaling=(True, True),
    downsample_type=("spatial", "spatiotemporal"),
    decoder_block_out_channels=(16, 16),
    decoder_layers_per_block=(1, 1, 1),
    decoder_spatio_temporal_scaling=(True, True),
    decoder_inject_noise=(False, False, False),
    upsample_type=("spatiotemporal", "spatial"),
    upsample_residual=(False, False),
    upsample_factor=(1, 1),
    temporal_compression_ratio=2,
    timestep_conditioning=False,
    encoder_causal=True,
    decoder_causal=False,
)
"""AutoencoderKLLTX2Video at 4x4 pixels and 2 frames a latent (LTX-2's: 32x32 and 8) by two 2x up-samplings without
pixel patches, so that the latents move the decoded brightness enough for the learning test. One of the two scalings
is spatial only, so the temporal ratio is given (the one the VAE computes counts both)."""


def gemma_tokenizer(directory: Path):
    """A byte-level BPE over the tiny corpus as a GemmaTokenizer (its <pad>, <eos>, <bos> specials), saved."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        parts._corpus(),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = GemmaTokenizer(vocab=state["vocab"], merges=merges, model_max_length=parts.TEXT_LENGTH)
    tok.save_pretrained(directory)
    return tok


def gemma3_encoder(tok):
    """Gemma3ForConditionalGeneration (the class LTX2Pipeline calls) with a 2-layer text model and a 1-layer
    SigLIP vision tower that text prompts never run."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        GEMMA_TEXT,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(config).eval()


def components(path: Path) -> dict:
    """Every LTX2Pipeline component, random, at test sizes."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tok = gemma_tokenizer(path / "tokenizer")
    width, layers = GEMMA_TEXT["hidden_size"], GEMMA_TEXT["num_hidden_layers"]
    connectors = LTX2TextConnectors(
        caption_channels=width,
        text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    transformer = LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        caption_channels=width,
        rope_double_precision=False,
        rope_type="split",
    ).eval()
    vae = AutoencoderKLLTX2Video(**VAE).eval()
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        mid_block_add_attention=False,
        mel_bins=8,
    ).eval()
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=16,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024, max_image_seq_len=4096
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=gemma3_encoder(tok),
        tokenizer=tok,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The pipeline at the adapter's size, frame rate and CFG scales, with the guidance terms the adapter does not
    run switched off: STG, modality isolation guidance and guidance rescale (on by default in the pipeline)."""
    assert not adapter.config.negative_prompt, "the parity reference runs the default negative prompt"
    return dict(
        height=adapter.height,
        width=adapter.width,
        num_frames=adapter.frames,
        frame_rate=float(adapter.fps),
        guidance_scale=guidance_scale,
        audio_guidance_scale=adapter.config.audio_guidance_scale,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        guidance_rescale=0.0,
        audio_guidance_rescale=0.0,
        use_cross_timestep=adapter.config.cross_timestep,
        max_sequence_length=adapter.config.max_sequence_length,
    )


def _latents(adapter, output):
    """The pipeline's un-normalised video [B, C, F, h, w] and audio [B, C, L, M] latents as the adapter's [B, N]
    pair: normalised and packed again."""
    p = adapter.pipeline
    video = p._normalize_latents(output.frames, p.vae.latents_mean, p.vae.latents_std, p.vae.config.scaling_factor)
    video = p._pack_latents(video, p.transformer_spatial_patch_size, p.transformer_temporal_patch_size)
    audio = p._normalize_audio_latents(
        p._pack_audio_latents(output.audio), p.audio_vae.latents_mean, p.audio_vae.latents_std
    )
    return torch.cat([video.flatten(1), audio.flatten(1)], 1)


CONFIG = dict(frames=5, height=32, width=32, max_sequence_length=parts.TEXT_LENGTH)
"""5 frames (3 latent frames at the tiny VAE's 2x temporal compression) of 32x32 (the pipelines' least size): 192 video
tokens, 5 audio ones."""


def ltx2() -> TinySpec:
    """The tiny LTX-2: CFG 3 on the video, 4 on the audio stream; an optional first frame (image-to-video)."""
    return TinySpec(
        components=components,
        pipeline_call=_pipeline_call,
        pipeline_outputs=_latents,
        config=dict(CONFIG, audio_guidance_scale=4.0),
        guidance=3.0,
        optional_inputs=(
            "image",
        ),  # a first frame: LTX2ImageToVideoPipeline's parity is tests/integration/test_ltx2.py's
        learning=("train.learning_rate=0.02",),  # the learning test's shared rate, measured to learn there
        learning_epochs=24,  # at 12 other draws of the tiny model rose by +0.009 on some seeds; at 24 by +0.021 or more
        slow_dtype_cases=True,  # bf16 / fp16 conformance in the slow tier, as the other large families
        video_compression=(2, 4),  # the tiny VAE's 2 frames and 4x4 pixels, patches 1 (LTX-2's VAE: 8, 32x32)
    )


SPECS = {"ltx2": ltx2}
"""LTX-2 text-to-video."""
