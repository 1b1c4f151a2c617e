"""The tiny Qwen-Image models: text-to-image, inpainting, editing (one and several references) and editing
inside a mask (one transformer, five pipelines)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from tiny_models import parts
from tiny_models.spec import TinySpec
from trainer.models.base import ImageInputs

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
"""The tokens with which the editing pipelines' prompt template places an image."""


def _tiny_components(path: Path, vision: bool = False) -> dict:
    """Qwen-Image: a 2-layer Qwen2.5-VL text encoder (hidden 16; with ``vision`` its tokenizer places images
    with ``VISION_TOKENS``), the Qwen VAE (z_dim 4, 4x), and the transformer with 2x2 patches."""
    import math

    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = parts.qwen_tokenizer(path / "tokenizer", VISION_TOKENS if vision else ())
    ids = dict(vision_start_token_id=len(tok) + 1, vision_end_token_id=len(tok) + 2, image_token_id=len(tok) + 4)
    if vision:
        ids = {key: tok.convert_tokens_to_ids(t) for key, t in zip(ids, VISION_TOKENS, strict=True)}
    text_config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=len(tok),
            rope_theta=1e6,
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        ),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16,
        vocab_size=len(tok),
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        vision_token_id=len(tok) + 3,
        video_token_id=len(tok) + 5,
        **ids,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=math.log(3),
        max_shift=math.log(3),
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return dict(
        transformer=QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=3,
            joint_attention_dim=16,
            axes_dims_rope=(8, 4, 4),
        ).eval(),
        vae=AutoencoderKLQwenImage(
            base_dim=24,
            z_dim=4,
            dim_mult=[1, 2, 4],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ).eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(text_config).eval(),
        tokenizer=tok,
        scheduler=scheduler,
    )


def _pipeline_call(adapter, inputs, guidance_scale: float) -> dict:
    return dict(
        height=adapter.resolution,
        width=adapter.resolution,
        true_cfg_scale=guidance_scale,
        negative_prompt=adapter.config.negative_prompt if guidance_scale > 1 else None,
        max_sequence_length=adapter.config.max_sequence_length,
    )


def qwen_image() -> TinySpec:
    """The tiny Qwen-Image. diffusers has no IP-Adapter for it; 32 pixels, where its 3D VAE no longer dominates
    the time."""
    return TinySpec(
        components=_tiny_components,
        pipeline_call=_pipeline_call,
        config=dict(resolution=32),
        guidance=3.0,
        ip_adapter=True,
    )


def _inpaint_call(adapter, inputs, guidance_scale: float) -> dict:
    return {
        **_pipeline_call(adapter, inputs, guidance_scale),
        "image": inputs.image,
        "mask_image": inputs.mask,
        "strength": 1.0,
    }


def qwen_image_inpaint() -> TinySpec:
    """Qwen-Image's tiny model and facts at 32 pixels (16 image tokens: its 3D VAE's cost is the suite's) with
    an inpainting dataset; its pipeline takes no IP-Adapter."""
    return replace(
        qwen_image(),
        pipeline_call=_inpaint_call,
        config=dict(resolution=32),
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        ip_adapter=False,
        same_shapes=("qwen_image",),
        slow_dtype_cases=True,
        posterior_draw="diffusers.pipelines.qwenimage.pipeline_qwenimage_inpaint.retrieve_latents",
    )


def _edit_components(path) -> dict:
    """Qwen-Image's tiny components with vision tokens, and a Qwen2-VL processor (14-pixel patches)."""
    from transformers import Qwen2VLImageProcessorPil

    from trainer.models.qwen_edit import image_processor_class

    components = _tiny_components(path, vision=True)
    processor = image_processor_class()(image_processor=Qwen2VLImageProcessorPil(), tokenizer=components["tokenizer"])
    return {**components, "processor": processor}


def _edit_call(adapter, inputs, guidance_scale: float) -> dict:
    from PIL import Image

    pixels = (inputs.reference.float().clamp(0, 1) * 255).round().to(torch.uint8)
    images = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]
    call = _pipeline_call(adapter, inputs, guidance_scale)
    if guidance_scale > 1:  # one negative prompt per image
        call["negative_prompt"] = [call["negative_prompt"]] * len(images)
    return {**call, "image": images}


def _reference_area(adapter) -> dict:
    """The pipeline's reference size computed for ``model.resolution`` squared instead of 1024^2 pixels."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    calculate = pipeline_qwenimage_edit.calculate_dimensions
    return {
        f"{pipeline_qwenimage_edit.__name__}.calculate_dimensions": lambda area, ratio: calculate(
            adapter.resolution**2, ratio
        )
    }


def qwen_image_edit() -> TinySpec:
    """Qwen-Image's tiny model and facts at 32 pixels (as inpainting's) with a reference image from an editing
    dataset. The pipeline sizes references to about 1024^2 pixels, which ``_reference_area`` brings to
    ``model.resolution`` squared."""
    return replace(
        qwen_image(),
        components=_edit_components,
        pipeline_call=_edit_call,
        config=dict(resolution=32),
        pipeline_patches=_reference_area,
        inputs=("reference",),
        data="edit_jsonl",
        ip_adapter=False,
        text_store=False,
        same_shapes=("qwen_image", "qwen_image_inpaint"),
        slow_dtype_cases=True,
    )


def _plus_call(adapter, inputs, guidance_scale: float) -> dict:
    """One item's call (the pipeline takes one prompt): its references as PIL images."""
    from PIL import Image

    references = inputs.reference if inputs.reference.ndim == 5 else inputs.reference[:, None]
    (pixels,) = (references.float().clamp(0, 1) * 255).round().to(torch.uint8)
    images = [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]
    return {**_pipeline_call(adapter, inputs, guidance_scale), "image": images}


def _pipeline_sizes(adapter) -> dict:
    """The pipeline's reference areas brought to the adapter's: ``condition_size`` squared for the text
    encoder's images and ``model.resolution`` squared for the VAE's (1024^2 in the pipeline)."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    module = pipeline_qwenimage_edit_plus.__name__
    return {
        f"{module}.CONDITION_IMAGE_SIZE": adapter.config.condition_size**2,
        f"{module}.VAE_IMAGE_SIZE": adapter.resolution**2,
    }


def qwen_image_edit_plus() -> TinySpec:
    """Qwen-Image-Edit's tiny model and facts with two references per item, read by the text encoder at 64
    pixels (twice the 32 of the VAE's: the two sizes differ, as in the pipeline)."""
    return replace(
        qwen_image_edit(),
        pipeline_call=_plus_call,
        pipeline_patches=_pipeline_sizes,
        config=dict(resolution=32, condition_size=64),
        references=2,
        pipeline_one_prompt=True,
        same_shapes=("qwen_image", "qwen_image_inpaint", "qwen_image_edit"),
    )


def _edit_inpaint_call(adapter, inputs, guidance_scale: float) -> dict:
    call = _edit_call(adapter, ImageInputs(reference=inputs.image), guidance_scale)
    return {**call, "mask_image": inputs.mask, "strength": 1.0}


def _image_area(adapter) -> dict:
    """The pipeline's image size computed for ``model.resolution`` squared instead of 1024^2 pixels."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_inpaint

    calculate = pipeline_qwenimage_edit_inpaint.calculate_dimensions
    return {
        f"{pipeline_qwenimage_edit_inpaint.__name__}.calculate_dimensions": lambda area, ratio: calculate(
            adapter.resolution**2, ratio
        )
    }


def qwen_image_edit_inpaint() -> TinySpec:
    """Qwen-Image-Edit's tiny model and facts with an inpainting dataset (image, mask, instruction)."""
    return replace(
        qwen_image_edit(),
        pipeline_call=_edit_inpaint_call,
        pipeline_patches=_image_area,
        inputs=("image", "mask"),
        data="inpaint_jsonl",
        same_shapes=("qwen_image", "qwen_image_inpaint", "qwen_image_edit", "qwen_image_edit_plus"),
        posterior_draw="diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint.retrieve_latents",
    )


SPECS = {
    "qwen_image": qwen_image,
    "qwen_image_inpaint": qwen_image_inpaint,
    "qwen_image_edit": qwen_image_edit,
    "qwen_image_edit_plus": qwen_image_edit_plus,
    "qwen_image_edit_inpaint": qwen_image_edit_inpaint,
}
