"""FLUX.2 reference images (multi-reference editing, the pipelines' ``image``; inpainting's ``image_reference``): a
rollout at noise level 0 with
each item's references equals the pipeline called with them, the on-policy ratio stays exactly 1, references
change the prediction, and references the adapter cannot take are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_models import tiny, tiny_config

from trainer.models import build_adapter
from trainer.models.base import ImageInputs
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]
NAMES = ["flux2", "flux2_klein"]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("flux2-references")


def _adapter(name: str, root):
    """At 64 pixels: the pipelines refuse reference images with a side under 64."""
    adapter = build_adapter(tiny_config(name, root, dtype="float32", resolution=64), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


def _references(adapter, count: int, seed: int = 0) -> torch.Tensor:
    """[count, 3, H, W] on the uint8 grid, so that the pipeline's PIL images hold exactly these values."""
    side = adapter.resolution
    return (torch.rand(count, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 255).round() / 255


def _settings(name: str, noise_level: float) -> SamplerSettings:
    return SamplerSettings(num_steps=3, guidance_scale=tiny(name).guidance, kind="sde", noise_level=noise_level)


@pytest.mark.parametrize("name", NAMES)
def test_rollout_with_references_at_noise_zero_equals_the_pipeline(name, model_root):
    """Two references shared by the batch (the pipeline takes one list for all its prompts)."""
    adapter, spec = _adapter(name, model_root), tiny(name)
    references = _references(adapter, 2)
    inputs = ImageInputs(reference=references.expand(len(PROMPTS), -1, -1, -1, -1))
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        _settings(name, 0.0),
        torch.Generator().manual_seed(0),
        inputs,
    )
    images = [Image.fromarray((r.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()) for r in references]
    latents = adapter.pipeline(
        prompt=PROMPTS,
        image=images,
        num_inference_steps=3,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **spec.pipeline_call(adapter, None, spec.guidance),
    ).images
    expected = spec.pipeline_latents(adapter, latents) if spec.pipeline_latents is not None else latents
    torch.testing.assert_close(ro.latents[:, -1], expected.float().reshape(ro.latents[:, -1].shape), rtol=0, atol=1e-5)
    plain = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        _settings(name, 0.0),
        torch.Generator().manual_seed(0),
    )
    assert (plain.latents[:, -1] - ro.latents[:, -1]).abs().max() > 1e-3, "the references changed nothing"


def test_inpainting_with_references_at_noise_zero_equals_the_pipeline(model_root):
    """FLUX.2 [klein] inpainting with the pipeline's ``image_reference``: one item (the pipeline reads a list of
    as many references as prompts as one per prompt), two references after the source's tokens."""
    name = "flux2_klein_inpaint"
    adapter, spec = _adapter(name, model_root), tiny(name)
    side, g = adapter.resolution, torch.Generator().manual_seed(3)
    references = _references(adapter, 2)
    inputs = ImageInputs(
        image=torch.rand(1, 3, side, side, generator=g),
        reference=references[None],
        mask=(torch.rand(1, 1, side, side, generator=g) > 0.5).float(),
    )
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS[:1],
        torch.arange(1),
        _settings(name, 0.0),
        torch.Generator().manual_seed(0),
        inputs,
    )
    images = [Image.fromarray((r.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()) for r in references]
    latents = adapter.pipeline(
        prompt=PROMPTS[:1],
        image_reference=images,
        num_inference_steps=3,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **spec.pipeline_call(adapter, inputs, spec.guidance),
    ).images
    expected = spec.pipeline_latents(adapter, latents).float().reshape(ro.latents[:, -1].shape)
    torch.testing.assert_close(ro.latents[:, -1], expected, rtol=0, atol=1e-5)
    assert ro.cond.reference.shape[1] == 2 * ro.latents.shape[2]


@pytest.mark.parametrize("name", [*NAMES, "flux2_klein_inpaint"])
def test_on_policy_ratio_is_exactly_one_with_each_items_own_references(name, model_root):
    adapter = _adapter(name, model_root)
    references = torch.stack([_references(adapter, 3, seed) for seed in range(len(PROMPTS))])  # [B, 3, 3, H, W]
    inputs = ImageInputs(reference=references)
    if name == "flux2_klein_inpaint":
        side = adapter.resolution
        inputs.image, inputs.mask = torch.rand(2, 3, side, side), (torch.rand(2, 1, side, side) > 0.5).float()
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(len(PROMPTS)),
        _settings(name, 1.0),
        torch.Generator().manual_seed(1),
        inputs,
    )
    assert ro.cond.reference.shape[1] == 3 * ro.latents.shape[2]  # three references' tokens per item
    step = adapter.step_function(ro.kind, ro.sigmas)
    with torch.no_grad():
        for i in ro.trainable_steps().tolist():
            out = adapter.predict(
                adapter.denoiser, ro.latents[:, i], ro.sigmas[i].expand(len(PROMPTS)), ro.cond, ro.guidance_scale
            )
            _, log_prob, _, _ = step(
                out, ro.latents[:, i], torch.full((len(PROMPTS),), i), ro.noise_level, prev_sample=ro.latents[:, i + 1]
            )
            assert torch.equal(torch.exp(log_prob - ro.log_probs[:, i]), torch.ones(len(PROMPTS)))


def test_references_it_cannot_take_are_refused(model_root):
    adapter = _adapter("flux2", model_root)
    side = adapter.resolution
    with pytest.raises(
        ValueError,
        match=r"^ImageInputs.reference holds 11 images per item; the flux2 adapter takes "
        r"1 to 10 \(Flux2Pipeline\)",
    ):
        adapter.encode_prompts(PROMPTS, ImageInputs(reference=torch.rand(2, 11, 3, side, side)))
    with pytest.raises(ValueError, match=r"ImageInputs.reference is \(16, 16\) pixels; .*model.resolution"):
        adapter.encode_prompts(PROMPTS, ImageInputs(reference=torch.rand(2, 3, 16, 16)))
    with pytest.raises(ValueError, match=r"takes no ImageInputs.mask \(it uses reference\)"):
        adapter.encode_prompts(PROMPTS, ImageInputs(mask=torch.rand(2, 1, side, side)))
