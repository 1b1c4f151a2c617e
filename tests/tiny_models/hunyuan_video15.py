"""The tiny HunyuanVideo 1.5 models: a Qwen2.5-VL text model and a ByT5 glyph encoder, the causal 3D VAE (16x
spatial, 4x temporal), HunyuanVideo15Transformer3DModel, at 5 frames of 32x32 pixels (2 latent frames of 2x2: 8
tokens); text-to-video, and image-to-video with a SigLIP vision tower for its first frame."""

from __future__ import annotations

from pathlib import Path

import torch

from tiny_models import parts
from tiny_models.spec import TinySpec

LATENT_CHANNELS = 4
"""Latent channels of the tiny VAE (the real one has 32)."""
QWEN_HIDDEN = 16
"""Width of the tiny Qwen2.5-VL text model (the transformer's ``text_embed_dim``)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen's chat format for text messages, which the pipeline's prompt template is written in."""
VOCAB_SIZE = 600
"""The tiny BPE's vocabulary: most words of the pipeline's system message become one token, so that its template
spans 113 tokens, a few more than the 108 the pipeline crops (Qwen2.5-VL's spans 108): a prompt keeps all its
tokens."""


def qwen_tokenizer(directory: Path):
    """A byte-level BPE over the tiny corpus and the pipeline's system message, as a right-padded
    Qwen2Tokenizer with Qwen's chat special tokens and template."""
    import inspect
    import json

    from diffusers import HunyuanVideo15Pipeline
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([*parts._corpus(), system], trainer)
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="right",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return tok


def qwen_text_model(tok):
    """A 3-layer Qwen2_5_VLTextModel (the pipeline reads the hidden states two layers below the last)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(
        vocab_size=len(tok),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=QWEN_HIDDEN,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
    )
    return Qwen2_5_VLTextModel(config).eval()


def byt5(directory: Path) -> dict:
    """ByT5's tokenizer (bytes, no vocabulary file) and a T5 encoder at the tiny T5 sizes."""
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tok = ByT5Tokenizer()
    tok.save_pretrained(directory)
    config = T5Config(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=0,
        **parts.T5_ENCODER,
    )
    return dict(tokenizer_2=tok, text_encoder_2=T5EncoderModel(config).eval())


def vae():
    """AutoencoderKLHunyuanVideo15 with 32 channels at each of its 5 levels: 16x spatial and 4x temporal compression
    as the real one, LATENT_CHANNELS latent channels and the real scaling factor. At 8 (or 16) channels its decoder
    let the latents move the top half's brightness by only +0.010 (20 Adam steps on the latents), at 32 +0.058."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS, block_out_channels=(32, 32, 32, 32, 32), layers_per_block=1
    ).eval()


def transformer(task_type: str = "t2v"):
    """HunyuanVideo15Transformer3DModel: 2 blocks of 2 heads of 16 (rope 4/6/6 over frames, rows, columns), 1x1
    patches, the input of latents, condition latents and their mask (2 C + 1 channels, as both real variants)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1,
        out_channels=LATENT_CHANNELS,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=QWEN_HIDDEN,
        text_embed_2_dim=parts.T5_ENCODER["d_model"],
        image_embed_dim=SIGLIP["hidden_size"],
        rope_axes_dim=(4, 6, 6),
        target_size=32,
        task_type=task_type,
    ).eval()


def _components(path: Path) -> dict:
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    tok = qwen_tokenizer(path / "tokenizer")
    return dict(
        tokenizer=tok,
        text_encoder=qwen_text_model(tok),
        **byt5(path / "tokenizer_2"),
        vae=vae(),
        transformer=transformer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """The pipeline at the adapter's frames and size; its guidance is its guider's (``_guider``)."""
    assert not adapter.config.negative_prompt, "the parity reference runs the default negative prompt"
    return dict(height=adapter.height, width=adapter.width, num_frames=adapter.frames)


def _guider(adapter, guidance_scale: float) -> dict:
    """The pipeline takes its CFG scale from its ``guider`` component, not from an argument."""
    from diffusers import ClassifierFreeGuidance

    return {"guider": ClassifierFreeGuidance(guidance_scale=guidance_scale)}


SIGLIP = dict(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=32)
"""The tiny SigLIP vision tower (the real one is so400m: 1152 wide, 729 tokens of a 384-pixel picture): 16 tokens
of 8x8 patches, 24 wide (the transformer's ``image_embed_dim``)."""


def image_components() -> dict:
    """The image-to-video pipeline's ``image_encoder`` (SiglipVisionModel) and ``feature_extractor``
    (SiglipImageProcessor at the tower's size, SigLIP's bicubic resize and [-1, 1] normalisation)."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    side = SIGLIP["image_size"]
    encoder = SiglipVisionModel(SiglipVisionConfig(**SIGLIP, patch_size=8)).eval()
    return dict(image_encoder=encoder, feature_extractor=SiglipImageProcessor(size={"height": side, "width": side}))


def _i2v_components(path: Path) -> dict:
    return dict(_components(path), transformer=transformer("i2v"), **image_components())


def _i2v_pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """One first frame per call, as the 8-bit picture the pipeline takes (a PIL image; its size picks the video's
    among the transformer's ``target_size`` buckets: 32x32 here)."""
    from PIL import Image

    pixels = (inputs.image[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    call = _pipeline_call(adapter, inputs, guidance_scale)
    return dict(num_frames=call["num_frames"], image=Image.fromarray(pixels))


CONFIG = dict(frames=5, height=32, width=32, max_sequence_length=32, max_sequence_length_2=16)


def hunyuan_video15() -> TinySpec:
    """The tiny HunyuanVideo 1.5 T2V; one read of a device value per forward, as its pipeline makes (the
    transformer asks whether the image embeddings are all zero)."""
    return TinySpec(
        components=_components,
        pipeline_call=_pipeline_call,
        pipeline_components=_guider,
        config=CONFIG,
        guidance=3.0,
        device_reads_per_forward=1,
        learning=("train.learning_rate=0.02",),  # the learning test's shared rate, measured to learn there
        slow_dtype_cases=True,  # bf16 / fp16 conformance in the slow tier, as the other large families
        video_compression=(4, 16),  # the tiny VAE's 4 frames and 16x16 pixels, patches 1
    )


def hunyuan_video15_i2v() -> TinySpec:
    """The tiny HunyuanVideo 1.5 I2V: the T2V's facts, its first frame from the inpainting rows (their masks
    unused), one prompt per pipeline call (the pipeline conditions a call on one picture). Learning (12 epochs at
    the shared rate): +0.081 and +0.080 (train seeds 0 and 1)."""
    from dataclasses import replace

    return replace(
        hunyuan_video15(),
        components=_i2v_components,
        pipeline_call=_i2v_pipeline_call,
        inputs=("image",),
        data="inpaint_jsonl",
        pipeline_one_prompt=True,
        learning=("data.image_inputs=[image]", "train.learning_rate=0.02"),
    )


SPECS = {"hunyuan_video15": hunyuan_video15, "hunyuan_video15_i2v": hunyuan_video15_i2v}
"""HunyuanVideo 1.5 text-to-video and image-to-video."""
