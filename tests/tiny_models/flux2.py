"""The tiny FLUX.2 models: [dev], [klein] and [klein] inpainting (one transformer and VAE, two text encoders)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tiny_models import parts
from tiny_models.spec import TinySpec

_DEV_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'system' %}{% for c in m['content'] %}{% if c['type'] == "
    "'text' %}<|im_start|>{{ m['role'] }}\n{{ c['text'] }}<|im_end|>\n{% endif %}{% endfor %}{% endif %}"
    "{% endfor %}"
)
"""A chat template for the tiny tokenizer that drops the system message: the pipeline's long one would leave
no room for the prompt in the tests' 48 tokens."""


def tiny_transformer(joint_attention_dim: int, guidance_embeds: bool):
    """FLUX.2's transformer at test size: 8 input channels (2x2 patches of ``tiny_vae``'s 2 channels)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        joint_attention_dim=joint_attention_dim,
        guidance_embeds=guidance_embeds,
    ).eval()


def tiny_vae(seed: int = 0):
    """A one-block FLUX.2 VAE (1x, 2 latent channels) whose batch-norm statistics are random, so that a test
    sees a latent normalisation that is missing or inverted."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        block_out_channels=(4,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        layers_per_block=1,
        latent_channels=2,
        norm_num_groups=1,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    ).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    return vae


def _tiny_components(path: Path) -> dict:
    """FLUX.2 [dev]: a 2-layer Mistral 3 (text hidden 24, all three hidden states stacked: 72 channels; a
    one-layer Pixtral vision tower it does not use), the 1x VAE, the transformer with guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    tok = parts.qwen_tokenizer(path / "tokenizer")
    tok.chat_template = _DEV_CHAT_TEMPLATE
    tok.save_pretrained(path / "tokenizer")
    text = MistralConfig(
        vocab_size=len(tok),
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )
    vision = PixtralVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
        head_dim=8,
    )
    encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    ).eval()
    return dict(
        transformer=tiny_transformer(joint_attention_dim=72, guidance_embeds=True),
        vae=tiny_vae(),
        text_encoder=encoder,
        tokenizer=tok,
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        max_sequence_length=adapter.config.max_sequence_length,
        text_encoder_out_layers=tuple(adapter.config.text_encoder_out_layers),
    )


def flux2() -> TinySpec:
    """The tiny FLUX.2 [dev]: 16 pixels, 8x8 tokens, guidance embedding at 4 (the pipeline's default)."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(resolution=16, max_sequence_length=48, text_encoder_out_layers=[0, 1, 2]),
        guidance=4.0,
        optional_inputs=("reference",),
    )


_KLEIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""A Qwen3-style chat template for the tiny tokenizer (an empty think block when thinking is off)."""


def _klein_components(path: Path) -> dict:
    """Klein: a 2-layer Qwen3 (hidden 16; all three hidden states stacked: 48 text channels), the 1x FLUX.2
    VAE, and the transformer without guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = parts.qwen_tokenizer(path / "tokenizer")
    tok.chat_template = _KLEIN_CHAT_TEMPLATE
    tok.save_pretrained(path / "tokenizer")
    text = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return dict(
        transformer=tiny_transformer(joint_attention_dim=48, guidance_embeds=False),
        vae=tiny_vae(),
        text_encoder=Qwen3ForCausalLM(text).eval(),
        tokenizer=tok,
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0),
        is_distilled=False,
    )


def _klein_call(adapter, inputs, guidance_scale: float) -> dict:
    """The pipeline's arguments at the adapter's settings; its negative prompt is always ""."""
    assert not adapter.config.negative_prompt, "the parity reference runs the default negative prompt"
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        guidance_scale=guidance_scale,
        max_sequence_length=adapter.config.max_sequence_length,
        text_encoder_out_layers=tuple(adapter.config.text_encoder_out_layers),
    )


def _klein_latents(adapter, latents):
    """The Klein pipelines return latents un-normalised and unpatchified: back to the adapter's tokens."""
    return adapter.model_latents(latents)


def flux2_klein() -> TinySpec:
    """The tiny FLUX.2 [klein]: 16 pixels, 8x8 tokens, CFG at 3 (a base model)."""
    return TinySpec(
        components=_klein_components,
        pipeline_call=_klein_call,
        pipeline_latents=_klein_latents,
        config=dict(resolution=16, max_sequence_length=48, text_encoder_out_layers=[0, 1, 2]),
        guidance=3.0,
        learning=("train.learning_rate=0.05",),
        learning_epochs=24,
        optional_inputs=("reference",),
    )


def _inpaint_call(adapter, inputs, guidance_scale: float) -> dict:
    return {
        **_klein_call(adapter, inputs, guidance_scale),
        "image": inputs.image,
        "mask_image": inputs.mask,
        "strength": 1.0,
    }


def flux2_klein_inpaint() -> TinySpec:
    """Klein's tiny model and facts with an inpainting dataset (its pipeline encodes the source with the
    posterior's mode, as the adapter does: no draw to replace). Its learning run's reward (only the masked right
    half is the policy's) peaks near Klein's 24 epochs and drifts back after them."""
    return replace(
        flux2_klein(),
        pipeline_call=_inpaint_call,
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        same_shapes=("flux2_klein",),
        slow_dtype_cases=True,
    )


SPECS = {"flux2": flux2, "flux2_klein": flux2_klein, "flux2_klein_inpaint": flux2_klein_inpaint}
