"""What the conformance suite does not ask of the LTX-2 adapter: the video size checks, the refusals (audio output,
a bad first frame, another model's folder), image-to-video from a first frame (``LTX2ImageToVideoPipeline``'s
parity, the pinned frame outside the ratio and the gradients), and how the audio stream runs along: drawn and
stepped as the pipeline does, needed by the video, but outside the log-probability and every gradient."""

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


def test_a_first_frame_is_checked_in_one_line_and_other_inputs_refused(adapter):
    """The first frame is optional; one of another size or count, or an input ltx2 does not take, is refused in
    one line naming the fix."""
    frame = torch.rand(2, 3, 32, 32)
    with pytest.raises(
        ValueError,
        match=r"^ImageInputs\.image is \(16, 32\) pixels; the ltx2 adapter generates "
        r"\(32, 32\) \(model\.height x model\.width\): give it that size \(data\.image_size",
    ):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=frame[:, :, :16]))
    with pytest.raises(ValueError, match=r"^ImageInputs\.image has shape \(1, 3, 32, 32\); .*one per prompt\)$"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=frame[:1]))
    with pytest.raises(ValueError, match=r"^the ltx2 adapter takes no ImageInputs\.mask \(it uses image\)"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=frame, mask=frame[:, :1]))
    assert adapter.encode_prompts(PROMPTS).image is None


def image_to_video_pipeline(adapter):
    """``LTX2ImageToVideoPipeline`` on the adapter's components (the same weights serve both pipelines)."""
    from diffusers import LTX2ImageToVideoPipeline

    p = adapter.pipeline
    names = ("scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer")
    i2v = LTX2ImageToVideoPipeline(vocoder=None, **{name: getattr(p, name) for name in names})
    i2v.set_progress_bar_config(disable=True)
    return i2v


def test_a_first_frame_rollout_equals_the_image_to_video_pipeline(adapter):
    """With ``ImageInputs.image`` the noise-0 rollout is ``LTX2ImageToVideoPipeline``'s (video and audio latents,
    its extra guidance off and ``image_crf=0``): the frame's latents pinned as the first latent frame at timestep
    0, which the final latents hold; without it, another video."""
    inputs = testing.image_inputs(adapter, 2, optional=True)
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0), inputs
    )
    spec = testing.tiny("ltx2")
    out = image_to_video_pipeline(adapter)(
        prompt=PROMPTS,
        image=inputs.image,
        image_crf=0,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        **spec.pipeline_call(adapter, None, 3.0),
    )
    torch.testing.assert_close(ro.latents[:, -1], spec.pipeline_outputs(adapter, out), rtol=0, atol=1e-5)
    first = adapter.first_frame_span[1]
    torch.testing.assert_close(ro.latents[:, -1, :first], ro.cond.image, rtol=0, atol=1e-6)
    plain = rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0))
    assert not torch.allclose(plain.latents[:, -1, first : adapter.split], ro.latents[:, -1, first : adapter.split])


def test_a_pinned_first_frame_is_outside_the_ratio_and_every_gradient(adapter):
    """At noise level 1 with a first frame: the on-policy ratio is exactly 1; the frame's velocity follows its
    known trajectory, so the frame's tokens carry no gradient (the others do)."""
    inputs = testing.image_inputs(adapter, 2, optional=True)
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, noise_level=1.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(1), inputs
    )
    step, first = adapter.step_function(ro.kind, ro.sigmas), adapter.first_frame_span[1]
    with torch.no_grad():
        for i in ro.trainable_steps().tolist():
            v = adapter.predict(adapter.denoiser, ro.latents[:, i], ro.sigmas[i].expand(2), ro.cond, 3.0)
            logp = step(v, ro.latents[:, i], torch.full((2,), i), 1.0, prev_sample=ro.latents[:, i + 1])[1]
            assert torch.equal(torch.exp(logp - ro.log_probs[:, i]), torch.ones(2))
    out = adapter.predict(adapter.denoiser, ro.latents[:, 1], ro.sigmas[1].expand(2), ro.cond, 3.0)
    params = [p for p in adapter.denoiser.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out[:, :first].square().sum(), params, allow_unused=True, retain_graph=True)
    assert all(g is None or not g.any() for g in grads)
    out[:, first : adapter.split].square().sum().backward()
    assert any(p.grad is not None and p.grad.any() for p in adapter.denoiser.parameters())
    adapter.denoiser.zero_grad(set_to_none=True)


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
