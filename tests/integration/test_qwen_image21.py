"""What the conformance suite does not ask of the Qwen-Image 2.1 adapter: its size check, the folders of Qwen-Image 1
and 2.1 told apart, each row computed at its own text length (where the pipeline's batches are not), the KV-cached
pipeline, a Turbo folder's sigma grid, the RGBA VAE's images and the export of a trained transformer."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import pytest
import torch
from tiny_models import run_pipeline, tiny_config

from trainer.models import build_adapter
from trainer.models.common import LoraSettings
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen_image21")


@pytest.fixture(scope="module")
def adapter(root):
    return build_adapter(tiny_config("qwen_image21", root, dtype="float32"), "cpu")


@pytest.mark.parametrize("side", [48, 80, 0])
def test_a_resolution_off_the_32_pixel_grid_is_refused_as_it_loads(side, root):
    with pytest.raises(ValueError, match=rf"model\.resolution={side} must be a positive multiple of 32"):
        build_adapter(tiny_config("qwen_image21", root, resolution=side), "cpu")


@pytest.mark.parametrize(("name", "other"), [("qwen_image21", "qwen_image"), ("qwen_image", "qwen_image21")])
def test_the_other_qwen_image_generations_folder_is_refused_in_one_line(name, other, root):
    config = dataclasses.replace(tiny_config(name, root), path=tiny_config(other, root).path)
    classes = {"qwen_image": "QwenImageTransformer2DModel", "qwen_image21": "QwenImage21Transformer2DModel"}
    with pytest.raises(ValueError, match=rf"holds a {classes[other]} in transformer/.*model\.name={name}") as error:
        build_adapter(config, "cpu")
    assert "\n" not in str(error.value)


def test_each_row_runs_at_its_own_text_length_where_the_pipeline_pads(adapter):
    """The image's rotary position follows the text: a padded batch's rows equal each row alone (and CFG's
    negative prompt, of another length, changes nothing), while the pipeline's batched output differs from its
    per-prompt output for the shorter prompt."""
    cond = adapter.encode_prompts(PROMPTS)
    assert cond.padded
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    sigma = adapter.sigmas(3)[1].expand(2)
    with torch.no_grad():
        for scale in (1.0, 3.0):
            both = adapter.predict(adapter.denoiser, x, sigma, cond, scale)
            alone = [
                adapter.predict(adapter.denoiser, x[i : i + 1], sigma[:1], cond.select([i]), scale) for i in (0, 1)
            ]
            torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-6)
    generator = torch.Generator().manual_seed(0)
    batched = adapter.pipeline(
        PROMPTS, height=64, width=64, num_inference_steps=2, generator=generator, output_type="latent"
    )
    per_prompt = run_pipeline(adapter, PROMPTS, None, 2, 1.0, torch.Generator().manual_seed(0))
    assert (batched.images - per_prompt).abs().max() > 1e-3


def test_the_rollout_matches_the_pipeline_with_its_kv_cache_up_to_rounding(adapter):
    """The pipeline caches the text's keys and values after its first step by default; the rollout recomputes them
    (training must): the same samples up to float32 rounding."""
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, kind="sde", noise_level=0.0)
    ro = rollout(adapter, adapter.denoiser, PROMPTS[:1], torch.arange(1), settings, torch.Generator().manual_seed(0))
    cached = adapter.pipeline(
        PROMPTS[:1],
        negative_prompt=adapter.config.negative_prompt,
        true_cfg_scale=3.0,
        height=64,
        width=64,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    ).images
    torch.testing.assert_close(ro.latents[:, -1], cached, rtol=0, atol=1e-5)


def test_a_turbo_folder_samples_its_own_sigma_grid(root, tmp_path):
    """``sample_sigmas`` in model_index.json: the pipeline samples that grid whatever its step count; the adapter
    takes it, shifted as the pipeline shifts it, and refuses another step count in one line."""
    path = tmp_path / "turbo"
    shutil.copytree(tiny_config("qwen_image21", root).path, path)
    index = json.loads((path / "model_index.json").read_text())
    (path / "model_index.json").write_text(json.dumps({**index, "sample_sigmas": [1.0, 0.9, 0.6, 0.3]}))
    turbo = build_adapter(tiny_config("qwen_image21", root, path=str(path), dtype="float32"), "cpu")
    seen = []
    turbo.pipeline.scheduler.set_timesteps = _recording(turbo.pipeline.scheduler.set_timesteps, seen)
    turbo.pipeline(PROMPTS[:1], height=64, width=64, num_inference_steps=20, output_type="latent")
    assert torch.equal(turbo.sigmas(4), seen[-1])
    with pytest.raises(ValueError, match=r"samples 4 steps \(model_index\.json's sample_sigmas\), not 3: set"):
        turbo.sigmas(3)


def _recording(set_timesteps, seen: list):
    """``scheduler.set_timesteps`` that appends the sigmas it sets to ``seen`` (its signature kept: the pipeline
    reads it)."""

    @functools.wraps(set_timesteps)
    def wrapped(*args, **kwargs):
        set_timesteps(*args, **kwargs)
        seen.append(set_timesteps.__self__.sigmas.clone())

    return wrapped


def test_images_are_rgb_over_white_and_encode_as_opaque_rgba(adapter):
    """``decode`` composites the VAE's RGBA over white; ``encode_images`` reads RGB as the pipeline's VAE reads an
    opaque RGBA image (normalised as its ``_encode_vae_image``)."""
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        rgba = adapter.vae.decode(
            adapter.pipeline._unpack_latents(
                x * adapter.latents_std.view(1, 1, -1) + adapter.latents_mean.view(1, 1, -1), 64, 64, 16
            ),
            return_dict=False,
        )[0][:, :, 0]
    rgba = (rgba / 2 + 0.5).clamp(0, 1)
    images = adapter.decode(x)
    assert images.shape == (2, 3, 64, 64)
    torch.testing.assert_close(images, rgba[:, :3] * rgba[:, 3:] + 1 - rgba[:, 3:], rtol=0, atol=1e-6)
    opaque = torch.cat([images, torch.ones_like(images[:, :1])], dim=1) * 2 - 1
    with torch.no_grad():
        expected = adapter.pipeline._encode_vae_image(opaque[:, :, None], None)
    b, c = expected.shape[:2]
    torch.testing.assert_close(adapter.encode_images(images), expected.reshape(b, c, -1).transpose(1, 2))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_export_loads_back_as_a_qwen_image21_transformer(lora, root, tmp_path):
    from diffusers import QwenImage21Transformer2DModel

    from trainer.export import export_denoiser

    config = tiny_config("qwen_image21", root, dtype="float32", lora=LoraSettings(rank=4, alpha=8) if lora else None)
    trained = build_adapter(config, "cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stands for training: every trainable weight moves (LoRA B starts at zero)
        for p in trained.trainable.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    cond = trained.encode_prompts(PROMPTS)
    x = trained.prepare_latents(2, torch.Generator().manual_seed(0))
    sigma = trained.sigmas(3)[1].expand(2)
    with torch.no_grad():
        expected = trained.predict(trained.denoiser, x, sigma, cond, 1.0)
    export_denoiser(trained.denoiser, tmp_path / "exported")
    exported = QwenImage21Transformer2DModel.from_pretrained(tmp_path / "exported")
    assert not getattr(exported, "peft_config", None)
    with torch.no_grad():
        torch.testing.assert_close(trained.predict(exported, x, sigma, cond, 1.0), expected, atol=1e-5, rtol=1e-5)
