"""Tiny random models for every adapter, saved in diffusers layout (tests and benchmarks).

Each ``build_*`` function creates components from configs (the sizes of ``docs/TINY_MODELS.md``, as
diffusers' own ``get_dummy_components`` do), with tokenizers trained locally, assembles them into the
model's diffusers pipeline and writes it with ``save_pretrained``. ``tiny_config(name, root)`` builds the
model for adapter ``name`` under ``root`` and returns that adapter's config pointing at it, so the adapter
loads it through the same ``config.path`` code it runs on real weights; ``tiny_ip_adapter(root)`` does the
same for an IP-Adapter's image encoder (a CLIP vision tower). Nothing here needs a network.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CLIP_TEXT = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                 projection_dim=32, max_position_embeddings=77, hidden_act="gelu")
T5_ENCODER = dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False)
VAE_1X = dict(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
              norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
              scaling_factor=1.5035)
"""One-block VAE without downsampling: latents have the image's size (fast, and enough to test the code)."""
FLUX_TRANSFORMER = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                        axes_dims_rope=[4, 4, 8], guidance_embeds=True)
FLUX_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                      max_image_seq_len=4096)
CLIP_VISION = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, image_size=32,
                   patch_size=8, projection_dim=24, hidden_act="gelu")
"""16 patches of 8x8 pixels; 24-dim image embeddings (unlike every text width, so a mix-up fails)."""
TEXT_LENGTH = 16
"""Tokens per prompt for every tiny text encoder (CLIP model_max_length, T5 max_sequence_length)."""

_WORDS = ("a photo of the digit number cat dog red blue green big small image picture text sign handwritten "
          "zero one two three four five six seven eight nine").split()


def _corpus() -> list[str]:
    return [f"{a} {b} {c}" for a, b, c in zip(_WORDS, _WORDS[3:] + _WORDS[:3], _WORDS[7:] + _WORDS[:7], strict=True)]


def clip_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A CLIPTokenizer over a small local corpus (built deterministically), saved to ``directory``."""
    from transformers import CLIPTokenizer

    from trainer.models.tiny import _clip_tokenizer

    _clip_tokenizer(directory, max_length)
    return CLIPTokenizer.from_pretrained(directory)


def t5_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A unigram T5 tokenizer whose pieces are the corpus words and single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, -2.0) for w in _WORDS] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tok.save_pretrained(directory)
    return tok


def qwen_tokenizer(directory: Path):
    """A byte-level BPE with Qwen's chat special tokens, as a Qwen2Tokenizer. The vocabulary stays small
    so that the pipeline's prompt template still spans more than its 34 dropped prefix tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Qwen2Tokenizer(vocab=state["vocab"], merges=merges, unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(directory)
    return tok


def _clip_text_encoder(tok, cls_name: str = "CLIPTextModel"):
    import transformers

    config = transformers.CLIPTextConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **CLIP_TEXT)
    return getattr(transformers, cls_name)(config).eval()


def _t5_encoder(tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id, decoder_start_token_id=0, **T5_ENCODER)).eval()


def _save(pipeline, path: Path) -> Path:
    pipeline.save_pretrained(path)
    return path


def build_tiny_sd3_with_vae(path: str | Path, seed: int = 0) -> Path:
    """SD3 in the real layout: two CLIP encoders, a T5 encoder and a (one-block) VAE; 8x8 latent tokens."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    path = Path(path)
    torch.manual_seed(seed)
    tokenizers = {s: clip_tokenizer(path / f"tokenizer{s}") for s in ("", "_2")}
    return _save(StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64,
        ).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(latent_channels=4, **VAE_1X).eval(),
        text_encoder=_clip_text_encoder(tokenizers[""], "CLIPTextModelWithProjection"), tokenizer=tokenizers[""],
        text_encoder_2=_clip_text_encoder(tokenizers["_2"], "CLIPTextModelWithProjection"),
        tokenizer_2=tokenizers["_2"],
        text_encoder_3=_t5_encoder(t5 := t5_tokenizer(path / "tokenizer_3")), tokenizer_3=t5,
    ), path)


def build_tiny_flux(path: str | Path, variant: str = "dev", seed: int = 0, num_layers: int = 1) -> Path:
    """FLUX.1 ``variant`` "dev", "fill" or "kontext": CLIP + T5 text encoders, one-block VAE, guidance
    embedding. Fill's transformer takes 20 channels (8 latent + 8 masked-image + 4 mask) and outputs 8."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxFillPipeline,
        FluxKontextPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    pipeline_class = {"dev": FluxPipeline, "fill": FluxFillPipeline, "kontext": FluxKontextPipeline}[variant]
    path = Path(path)
    torch.manual_seed(seed)
    transformer = dict(FLUX_TRANSFORMER, num_layers=num_layers, num_single_layers=num_layers)
    latent_channels = 1
    if variant == "fill":
        transformer.update(in_channels=20, out_channels=8)
        latent_channels = 2
    clip = clip_tokenizer(path / "tokenizer")
    t5 = t5_tokenizer(path / "tokenizer_2")
    return _save(pipeline_class(
        transformer=FluxTransformer2DModel(**transformer).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=AutoencoderKL(latent_channels=latent_channels, **VAE_1X).eval(),
        text_encoder=_clip_text_encoder(clip), tokenizer=clip, text_encoder_2=_t5_encoder(t5), tokenizer_2=t5,
    ), path)


def build_tiny_sd15_inpaint(path: str | Path, seed: int = 0) -> Path:
    """SD1.5 inpainting: a 9-channel UNet, a 2x VAE with 4 latent channels, CLIP, SD1.5's DDIM settings."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionInpaintPipeline, UNet2DConditionModel

    path = Path(path)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=8, in_channels=9, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    ).eval()
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                        sample_size=16).eval()
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    tok = clip_tokenizer(path / "tokenizer")
    return _save(StableDiffusionInpaintPipeline(
        vae=vae, text_encoder=_clip_text_encoder(tok), tokenizer=tok, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ), path)


def build_tiny_qwen_image(path: str | Path, seed: int = 0, num_layers: int = 2) -> Path:
    """Qwen-Image: a 2-layer Qwen2.5-VL text encoder (hidden 16), the Qwen VAE (z_dim 4, 4x), and the
    transformer with 2x2 patches."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    torch.manual_seed(seed)
    tok = qwen_tokenizer(path / "tokenizer")
    text_config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=len(tok), rope_theta=1e6, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id,
                         rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        vision_start_token_id=len(tok) + 1, vision_end_token_id=len(tok) + 2,
        vision_token_id=len(tok) + 3, image_token_id=len(tok) + 4, video_token_id=len(tok) + 5,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=math.log(3), max_shift=math.log(3), base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return _save(QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=num_layers, attention_head_dim=16,
            num_attention_heads=3, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)).eval(),
        vae=AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                   temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                   latents_std=[1.0] * 4).eval(),
        text_encoder=Qwen2_5_VLForConditionalGeneration(text_config).eval(), tokenizer=tok, scheduler=scheduler,
    ), path)


def build_tiny_image_encoder(path: str | Path, seed: int = 0) -> Path:
    """A CLIPVisionModelWithProjection and its CLIP image processor config, as IP-Adapters load them."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModelWithProjection

    path = Path(path)
    torch.manual_seed(seed)
    CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VISION)).eval().save_pretrained(path)
    side = CLIP_VISION["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(path)
    return path


def tiny_ip_adapter(root: str | Path, **overrides: Any):
    """IPAdapterSettings whose image encoder is a tiny CLIP vision tower built (once) under ``root``."""
    from trainer.models.ip_adapter import IPAdapterSettings

    path = Path(root) / "image_encoder"
    if not (path / "config.json").is_file():
        build_tiny_image_encoder(path)
    return IPAdapterSettings(**{"image_encoder": str(path), **overrides})


def randomize_ip_adapter(adapter, seed: int = 0, std: float = 0.5) -> None:
    """Replace every IP-Adapter weight of ``adapter`` by N(0, std^2) draws: a trained IP-Adapter's stand-in
    (fresh weights leave the output unchanged, so they cannot show that the IP path is used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.ip_adapter.parameters():
            p.copy_(std * torch.randn(p.shape, generator=g))


def _configs() -> dict[str, tuple[Callable[[Path], Path], Callable[[str], Any]]]:
    """Adapter name -> (builder, config for the built directory at test resolution: 64 latent tokens)."""
    from trainer.models.flux import FluxConfig
    from trainer.models.flux_fill import FluxFillConfig
    from trainer.models.flux_kontext import FluxKontextConfig
    from trainer.models.qwen_image import QwenImageConfig
    from trainer.models.sd3 import SD3Config
    from trainer.models.sd15_inpaint import SD15InpaintConfig
    from trainer.models.tiny import TinyConfig, build_tiny_sd3

    return {
        "tiny": (build_tiny_sd3, lambda p: TinyConfig(path=p)),
        "sd3": (build_tiny_sd3_with_vae, lambda p: SD3Config(path=p, max_sequence_length=TEXT_LENGTH)),
        "flux": (lambda p: build_tiny_flux(p, "dev"),
                 lambda p: FluxConfig(path=p, resolution=16, max_sequence_length=TEXT_LENGTH)),
        "flux_fill": (lambda p: build_tiny_flux(p, "fill"),
                      lambda p: FluxFillConfig(path=p, resolution=16, max_sequence_length=TEXT_LENGTH)),
        "flux_kontext": (lambda p: build_tiny_flux(p, "kontext"),
                         lambda p: FluxKontextConfig(path=p, resolution=16, max_sequence_length=TEXT_LENGTH)),
        "sd15_inpaint": (build_tiny_sd15_inpaint, lambda p: SD15InpaintConfig(path=p, resolution=16)),
        "qwen_image": (build_tiny_qwen_image, lambda p: QwenImageConfig(path=p, resolution=64)),
    }


TINY_NAMES = ("tiny", "sd3", "flux", "flux_fill", "flux_kontext", "sd15_inpaint", "qwen_image")
"""Adapters that ``tiny_config`` can build a model for."""


def tiny_config(name: str, root: str | Path, **overrides: Any):
    """Build (once) the tiny model of adapter ``name`` under ``root`` and return its adapter config, with
    ``overrides`` applied (e.g. ``lora=LoraSettings(rank=4)``, ``resolution=32``)."""
    from dataclasses import replace

    builder, make_config = _configs()[name]
    path = Path(root) / name
    if not (path / "model_index.json").is_file():
        builder(path)
    return replace(make_config(str(path)), **overrides)


_RETRIEVE_LATENTS = {
    "flux_fill": "diffusers.pipelines.flux.pipeline_flux_fill.retrieve_latents",
    "flux_kontext": "diffusers.pipelines.flux.pipeline_flux_kontext.retrieve_latents",
    "sd15_inpaint": "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint.retrieve_latents",
}


def run_pipeline(adapter, prompts: list[str], inputs, num_steps: int, guidance_scale: float,
                 generator: torch.Generator, output_type: str = "latent") -> torch.Tensor:
    """Sample with the adapter's own diffusers pipeline (same components) as a rollout would: same prompts,
    image inputs, steps, guidance and generator; the reference for parity tests and benchmarks.

    Image-conditioned pipelines sample the VAE posterior of their conditioning images where the adapters
    take its mean; that draw is replaced by the mean here, the only change to the pipelines.
    """
    from unittest import mock

    name = adapter.config.name
    kwargs: dict[str, Any] = dict(prompt=prompts, num_inference_steps=num_steps, generator=generator,
                                  output_type=output_type)
    if getattr(adapter, "ip_adapter", None) is not None:
        kwargs.update(ip_pipeline_kwargs(adapter, inputs))
    if name in ("tiny", "sd3"):
        side = adapter.latent_shape[-1] * adapter.pipeline.vae_scale_factor
        kwargs.update(height=side, width=side, guidance_scale=guidance_scale,
                      max_sequence_length=adapter.config.max_sequence_length)
    elif name == "qwen_image":
        kwargs.update(height=adapter.resolution, width=adapter.resolution, true_cfg_scale=guidance_scale,
                      negative_prompt=adapter.config.negative_prompt if guidance_scale > 1 else None,
                      max_sequence_length=adapter.config.max_sequence_length)
    elif name == "sd15_inpaint":
        kwargs.update(height=adapter.resolution, width=adapter.resolution, guidance_scale=guidance_scale, eta=0.0,
                      image=inputs.image, mask_image=inputs.mask)
    else:
        kwargs.update(height=adapter.resolution, width=adapter.resolution, guidance_scale=guidance_scale,
                      max_sequence_length=adapter.config.max_sequence_length)
        if name == "flux_fill":
            kwargs.update(image=inputs.image, mask_image=inputs.mask)
        if name == "flux_kontext":
            kwargs.update(image=inputs.reference, _auto_resize=False, max_area=adapter.resolution**2)
    if name not in _RETRIEVE_LATENTS:
        return adapter.pipeline(**kwargs).images
    posterior_mean = lambda output, generator=None, sample_mode="sample": output.latent_dist.mode()  # noqa: E731
    with mock.patch(_RETRIEVE_LATENTS[name], posterior_mean):
        return adapter.pipeline(**kwargs).images


def ip_pipeline_kwargs(adapter, inputs) -> dict[str, Any]:
    """``ip_adapter_image_embeds`` for a FLUX-family pipeline: the style embedding of the first item (the
    pipeline repeats one image per IP-Adapter over the batch), and zero embeddings for the negative branch as
    the adapter uses (the pipeline would encode a black image)."""
    if adapter.config.name == "qwen_image":
        raise ValueError("QwenImagePipeline has no IP-Adapter: there is no diffusers reference to compare with")
    if not all(torch.equal(s, inputs.style[0]) for s in inputs.style):
        raise ValueError("the FLUX pipelines take one style image for the whole batch")
    embeds = adapter.ip_adapter.encoder(inputs.style[:1])[None]  # [1 image, 1 item, D]
    return {"ip_adapter_image_embeds": [embeds], "negative_ip_adapter_image_embeds": [torch.zeros_like(embeds)]}


def image_inputs(adapter, batch_size: int, seed: int = 0):
    """Random ImageInputs of the kind ``adapter`` needs (image + binary mask, or a reference; with an
    IP-Adapter a style image, the same for every item as the pipelines take one), else None."""
    from trainer.models.base import ImageInputs

    g = torch.Generator().manual_seed(seed)
    name = adapter.config.name
    side = getattr(adapter, "resolution", 16)
    inputs = ImageInputs()
    if name in ("flux_fill", "sd15_inpaint"):
        inputs = ImageInputs(image=torch.rand(batch_size, 3, side, side, generator=g),
                             mask=(torch.rand(batch_size, 1, side, side, generator=g) > 0.5).float())
    if name == "flux_kontext":
        inputs = ImageInputs(reference=torch.rand(batch_size, 3, side, side, generator=g))
    if getattr(adapter, "ip_adapter", None) is not None:
        inputs.style = torch.rand(1, 3, side, side, generator=g).expand(batch_size, -1, -1, -1)
    return inputs if any(v is not None for v in vars(inputs).values()) else None
