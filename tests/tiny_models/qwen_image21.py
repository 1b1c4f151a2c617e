"""The tiny Qwen-Image 2.1 model: a Qwen3-VL text encoder with its processor, the RGBA 16x VAE and the
single-stream block-causal transformer."""

from __future__ import annotations

from pathlib import Path

from tiny_models import parts
from tiny_models.spec import TinySpec

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen3-VL's vision tokens (the processor and the pipeline look them up, text-to-image included)."""

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen3-VL's template for text messages: the pipeline derives how many system tokens to drop from it."""


def _tiny_components(path: Path) -> dict:
    """Qwen-Image 2.1: a 2-layer Qwen3-VL (hidden 16, one vision block), the VAE with its 16x compression (five
    levels of 8 channels, 8 latent channels, RGBA) and a 2-block transformer of width 32."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from trainer.models.qwen_image21 import text_processor_class

    tok = parts.qwen_tokenizer(path / "processor", VISION_TOKENS)
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {key: tok.convert_tokens_to_ids(t) for key, t in zip(keys, VISION_TOKENS, strict=True)}
    text_config = Qwen3VLConfig(
        text_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=len(tok),
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=16,
            num_heads=2,
            out_hidden_size=16,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        ),
        **ids,
    )
    processor = text_processor_class()(
        image_processor=Qwen2VLImageProcessorPil(patch_size=16), tokenizer=tok, chat_template=CHAT_TEMPLATE
    )
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=8,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, False, False, False],
        latents_mean=[0.1 * i for i in range(8)],
        latents_std=[1.0 + 0.1 * i for i in range(8)],
    )
    transformer = QwenImage21Transformer2DModel(
        in_channels=8,
        out_channels=8,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        context_in_dim=16,
        mlp_ratio=2,
        axes_dims_rope=(4, 6, 6),
    )
    return dict(
        transformer=transformer.eval(),
        vae=vae.eval(),
        text_encoder=Qwen3VLForConditionalGeneration(text_config).eval(),
        processor=processor,
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    """Its pipeline without the KV cache (the rollout recomputes the text each step, as training must), the
    negative prompt only where CFG runs (it turns CFG on)."""
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        true_cfg_scale=guidance_scale,
        negative_prompt=adapter.config.negative_prompt if guidance_scale > 1 else None,
        use_kv_cache=False,
    )


def qwen_image21() -> TinySpec:
    """The tiny Qwen-Image 2.1 at 64 pixels (4x4 latent tokens). Its pipeline's output for a prompt depends on the
    prompts batched with it (the image's position follows the padded text), where the adapter's does not: the
    parity reference runs it per prompt. Its transformer reads one value back per forward (the text's length)."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(resolution=64),
        guidance=3.0,
        pipeline_one_prompt=True,
        device_reads_per_forward=1,
        slow_dtype_cases=True,  # bf16 / fp16 conformance in the slow tier, as the other large families
    )


SPECS = {"qwen_image21": qwen_image21}
