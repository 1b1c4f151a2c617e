"""Inpainting adapters that blend their known region with the rollout's initial noise (``reads_trajectory``,
FLUX.2 [klein] inpainting): beyond the conformance suite (their parity with the pipelines, on-policy ratios,
training, save/load and input checks), a rollout binds its noise and schedule to the conditioning, and the
known region (mask 0) is not the policy's: its velocity carries no gradient, the soft mask's band does."""

from __future__ import annotations

import pytest
import tiny_models as testing
import torch
from tiny_models import tiny_config

from trainer.models import MODELS, build_adapter
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]
NAMES = sorted(name for name, spec in MODELS.items() if spec.reads_trajectory and "mask" in testing.tiny(name).inputs)
"""The soft inpainting adapters (Wan 2.2 TI2V reads the trajectory too, to pin its first frame: no mask)."""


def test_some_adapter_reads_the_trajectory():
    assert "flux2_klein_inpaint" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_the_known_region_carries_no_gradient(name, tmp_path):
    adapter = build_adapter(tiny_config(name, tmp_path, dtype="float32"), "cpu")
    settings = SamplerSettings(num_steps=3, guidance_scale=testing.tiny(name).guidance, noise_level=1.0)
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(2),
        settings,
        torch.Generator().manual_seed(0),
        testing.image_inputs(adapter, len(PROMPTS)),
    )
    assert torch.equal(ro.cond.noise, ro.latents[:, 0]) and torch.equal(ro.cond.schedule[1], ro.sigmas)
    mask = ro.cond.mask.expand_as(ro.latents[:, 0])
    known, soft = mask == 0, (mask > 0) & (mask < 1)
    assert known.any() and soft.any()
    v = adapter.predict(adapter.denoiser, ro.latents[:, 1], ro.sigmas[1].expand(2), ro.cond, ro.guidance_scale)
    params = [p for p in adapter.denoiser.parameters() if p.requires_grad]
    outside = torch.autograd.grad(v[known].square().sum(), params, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in outside)
    band = torch.autograd.grad(v[soft].square().sum(), params, allow_unused=True)
    assert any(g is not None and g.any() for g in band)
