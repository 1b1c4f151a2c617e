"""Z-Image's two CFG options, as ZImagePipeline runs them: ``cfg_normalization`` (each image's guided prediction
clamped to k times its conditional one's norm) and ``cfg_truncation`` (no CFG where 1 - sigma is past it): the
formulas against their closed forms, and rollouts at noise 0 against the pipeline with both on."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models as testing
import torch

from trainer.models import build_adapter
from trainer.models.z_image import guided_rows, z_image_cfg
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]
STEPS = 4
GUIDANCE = 3.0
TRUNCATION = 0.2
"""The tiny schedule (shift 3) has 1 - sigma = 0, 0.1, 0.25, 0.5: CFG at the first two steps, not the last two."""


def test_normalization_clamps_each_images_norm_to_k_times_its_conditional_ones():
    torch.manual_seed(0)
    cond, uncond = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    uncond[2] = cond[2] * 0.999  # a guided prediction barely longer than the conditional one: k = 2 leaves it
    written_out = cond + GUIDANCE * (cond - uncond)  # the pipeline's form, per image
    torch.testing.assert_close(z_image_cfg(cond, uncond, GUIDANCE, 0.0), written_out, rtol=1e-6, atol=1e-6)
    got = z_image_cfg(cond, uncond, GUIDANCE, 2.0)
    for i in range(3):
        limit = 2.0 * cond[i].norm()
        expected = written_out[i] * (limit / written_out[i].norm()) if written_out[i].norm() > limit else written_out[i]
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got[0].norm(), 2.0 * cond[0].norm()) and torch.equal(
        got[2], z_image_cfg(cond, uncond, GUIDANCE, 0.0)[2]
    )


def test_a_zero_prediction_keeps_finite_gradients_under_normalization():
    cond = torch.zeros(1, 2, 3, 3, requires_grad=True)
    uncond = torch.zeros(1, 2, 3, 3, requires_grad=True)
    z_image_cfg(cond, uncond, GUIDANCE, 1.0).sum().backward()
    assert torch.isfinite(cond.grad).all() and torch.isfinite(uncond.grad).all()


def test_truncation_compares_the_pipelines_time_in_float64():
    t = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float32)
    assert guided_rows(t, 1.0) is True and guided_rows(t, 0.75) is True and guided_rows(t, 0.1) is False
    assert guided_rows(t, 0.5).tolist() == [True, True, False]
    # 0.1 is not a float32: its nearest float32 is above it, so a float32 comparison would call that time guided
    near = torch.tensor([0.1], dtype=torch.float32)
    assert float(near) > 0.1 and guided_rows(near, 0.1) is False


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return testing.tiny_config("z_image", tmp_path_factory.mktemp("z"), dtype="float32")


def _rollout_and_pipeline(config, **options):
    adapter = build_adapter(dataclasses.replace(config, **options), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    settings = SamplerSettings(num_steps=STEPS, guidance_scale=GUIDANCE, kind="sde", noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(len(PROMPTS)), settings, torch.Generator().manual_seed(0)
    )
    expected = testing.run_pipeline(adapter, PROMPTS, None, STEPS, GUIDANCE, torch.Generator().manual_seed(0))
    return adapter, ro, expected.float().reshape(ro.latents[:, -1].shape)


def test_rollout_at_noise_zero_equals_the_pipeline_with_normalization_and_truncation(config):
    _, plain, plain_pipeline = _rollout_and_pipeline(config)
    adapter, ro, expected = _rollout_and_pipeline(config, cfg_normalization=1.0, cfg_truncation=TRUNCATION)
    torch.testing.assert_close(ro.latents[:, -1], expected, rtol=0, atol=1e-5)
    # both options act here: the pipeline's own output moved, and the schedule crosses the cut-off
    assert (expected - plain_pipeline).abs().max() > 1e-3
    t = 1 - ro.sigmas[:-1].double()
    assert bool((t <= TRUNCATION).any()) and bool((t > TRUNCATION).any()), ro.sigmas
    torch.testing.assert_close(plain.latents[:, -1], plain_pipeline, rtol=0, atol=1e-5)


def test_a_batch_across_the_cut_off_predicts_each_row_as_its_own_step_does(config):
    """Training units mix steps: a row past the cut-off takes the conditional prediction, the others CFG."""
    adapter = build_adapter(dataclasses.replace(config, cfg_normalization=1.0, cfg_truncation=TRUNCATION), "cpu")
    sigmas = adapter.sigmas(STEPS)
    late, early = STEPS - 1, 0  # 1 - sigma above and below the cut-off
    assert 1 - float(sigmas[late]) > TRUNCATION > 1 - float(sigmas[early])
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        mixed = adapter.predict(adapter.denoiser, x, sigmas[[early, late]], cond, GUIDANCE)
        alone = [
            adapter.predict(adapter.denoiser, x[i : i + 1], sigmas[[s]], cond.select(torch.tensor([i])), GUIDANCE)
            for i, s in enumerate((early, late))
        ]
        unguided = adapter.predict(adapter.denoiser, x[1:], sigmas[[late]], cond.select(torch.tensor([1])), 0.0)
    torch.testing.assert_close(mixed, torch.cat(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone[1], unguided, rtol=0, atol=0)
