"""What the conformance suite does not ask of the LTX-2 adapter: the video size checks, the refusals (audio output,
image inputs, another model's folder), and how the audio stream runs along: drawn and stepped as the pipeline does,
needed by the video, but outside the log-probability and every gradient."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models as testing
import torch
from tiny_models import tiny_config
from video_checks import video_size_test

from trainer.algorithms.core_algos import per_sample_mse
from trainer.models import build_adapter
from trainer.models.base import ImageInputs
from trainer.models.ltx2 import LTX2Config
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ltx2")


@pytest.fixture(scope="module")
def adapter(root):
    adapter = build_adapter(tiny_config("ltx2", root, dtype="float32"), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


test_video_sizes_are_checked_as_the_adapter_loads = video_size_test("ltx2")


def test_audio_output_is_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"^model\.audio=true: ltx2 generates and trains video only .*unset model\.audio$"
    ):
        LTX2Config(path="/models/LTX-2", audio=True)


def test_an_image_input_is_refused(adapter):
    with pytest.raises(ValueError, match="image"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=torch.rand(2, 3, 32, 32)))


def test_a_wan_folder_is_refused_and_names_the_fix(root):
    wan = tiny_config("wan", root)
    with pytest.raises(ValueError, match=r"holds a WanTransformer3DModel in transformer/.*set model\.name"):
        build_adapter(dataclasses.replace(tiny_config("ltx2", root), path=wan.path), "cpu")


def test_decode_gives_frames_and_encode_inverts_its_layout(adapter):
    """Frames [B, F, C, H, W] in [0, 1]; supervised targets are [video; audio at 0] in the rollout's layout."""
    frames = adapter.decode(adapter.prepare_latents(2, torch.Generator().manual_seed(0)))
    assert frames.shape == (2, 5, 3, 32, 32) and 0 <= float(frames.min()) <= float(frames.max()) <= 1
    x0 = adapter.encode_images(frames)
    assert x0.shape == (2, *adapter.latent_shape) and not x0[:, adapter.split :].any()


def test_the_audio_stream_is_state_the_video_needs_but_never_trained(adapter):
    """At noise level 1 the video steps are stochastic and the audio ones the pipeline's Euler steps; the
    log-probability ignores the audio part; the video's velocity depends on the audio latents; the audio velocity
    carries no gradient."""
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, noise_level=1.0)
    ro = rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(1))
    step, n = adapter.step_function(ro.kind, ro.sigmas), adapter.split
    with torch.no_grad():
        v = adapter.predict(adapter.denoiser, ro.latents[:, 1], ro.sigmas[1].expand(2), ro.cond, 3.0)
        dt = ro.sigmas[2] - ro.sigmas[1]
        torch.testing.assert_close(ro.latents[:, 2, n:], ro.latents[:, 1, n:] + dt * v[:, n:], rtol=0, atol=0)
        moved = ro.latents[:, 2].clone()
        moved[:, n:] += 1.0
        logp = [step(v, ro.latents[:, 1], 1, 1.0, prev_sample=x)[1] for x in (ro.latents[:, 2], moved)]
        assert torch.equal(logp[0], logp[1]) and torch.equal(logp[0], ro.log_probs[:, 1])
        other = ro.latents[:, 1].clone()
        other[:, n:] = torch.randn(2, other.shape[1] - n, generator=torch.Generator().manual_seed(2))
        w = adapter.predict(adapter.denoiser, other, ro.sigmas[1].expand(2), ro.cond, 3.0)
        assert not torch.allclose(w[:, :n], v[:, :n])
    out = adapter.predict(adapter.denoiser, ro.latents[:, 1], ro.sigmas[1].expand(2), ro.cond, 3.0)
    out[:, n:].square().sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in adapter.denoiser.parameters())
    adapter.denoiser.zero_grad(set_to_none=True)
    out = adapter.predict(adapter.denoiser, ro.latents[:, 1], ro.sigmas[1].expand(2), ro.cond, 3.0)
    out[:, :n].square().sum().backward()
    assert any(p.grad is not None and p.grad.any() for p in adapter.denoiser.parameters())
    adapter.denoiser.zero_grad(set_to_none=True)


def test_a_velocity_loss_scales_the_videos_gradient_by_its_share_of_the_latent(adapter):
    """The regression losses average over the [video; audio] pair (docs/departures.md): the audio's error carries
    no gradient, so the gradient is the video-only mean's (LTX-2's trainer's) times the video's share."""
    gen = torch.Generator().manual_seed(3)
    x0, noise = (torch.randn(2, *adapter.latent_shape, generator=gen) for _ in range(2))
    sigma = torch.tensor([0.3, 0.7])
    x_t, target = adapter.training_target(x0, noise, sigma)
    cond, n = adapter.encode_prompts(PROMPTS), adapter.split
    grads = []
    for part in (slice(None), slice(0, n)):
        v = adapter.predict(adapter.denoiser, x_t, sigma, cond, 1.0)
        per_sample_mse(v[:, part], target[:, part]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in adapter.denoiser.parameters() if p.grad is not None]))
        adapter.denoiser.zero_grad(set_to_none=True)
    share = n / adapter.latent_shape[0]
    assert 0.5 < share < 1 and grads[1].any()
    torch.testing.assert_close(grads[0], share * grads[1], rtol=1e-4, atol=1e-6 * float(grads[1].abs().max()))


def test_rollout_without_guidance_equals_the_pipeline(root):
    """Guidance 1 on both streams (the audio's scale None: the video's): one forward per step, no CFG, as the
    pipeline runs it then."""
    plain = build_adapter(tiny_config("ltx2", root, dtype="float32", audio_guidance_scale=None), "cpu")
    plain.pipeline.set_progress_bar_config(disable=True)
    settings = SamplerSettings(num_steps=3, guidance_scale=1.0, noise_level=0.0)
    ro = rollout(plain, plain.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0))
    expected = testing.run_pipeline(plain, PROMPTS, None, 3, 1.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(ro.latents[:, -1], expected, rtol=0, atol=1e-5)
