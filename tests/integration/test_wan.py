"""What the conformance suite does not ask of the Wan adapters: the video size checks, the shift read from a
UniPC folder, Wan 2.2's routing of rows to its experts (with their own guidance) and training one expert alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_config
from video_checks import video_size_test

from trainer.models import build_adapter
from trainer.models.base import ImageInputs
from trainer.models.common import LoraSettings
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("wan")


test_video_sizes_are_checked_as_the_adapter_loads = video_size_test("wan")


def test_a_unipc_folder_runs_euler_steps_at_its_flow_shift(root):
    """The tiny folders save Wan's UniPC config (flow_shift 3); ``model.flow_shift`` replaces it."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = build_adapter(tiny_config("wan", root), "cpu")
    expected = FlowMatchEulerDiscreteScheduler(shift=3.0)
    expected.set_timesteps(4)
    assert torch.equal(adapter.sigmas(4), expected.sigmas)
    shifted = build_adapter(tiny_config("wan", root, flow_shift=5.0), "cpu")
    assert shifted.scheduler.shift == 5.0 and not torch.equal(shifted.sigmas(4), expected.sigmas)


def test_the_experts_run_their_own_rows_at_their_own_guidance(root):
    """A batch whose rows sit on both sides of the boundary predicts what each row predicts alone: the high
    noise expert at ``guidance_scale``, the low noise one at ``guidance_scale_2``."""
    adapter = build_adapter(tiny_config("wan22", root, dtype="float32"), "cpu")
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    sigma = adapter.sigmas(3)[:2]  # timesteps 1000 (high noise) and 751 (low noise; boundary 800)
    assert adapter.denoiser.high_noise(sigma * 1000).tolist() == [True, False]
    with torch.no_grad():
        both = adapter.predict(adapter.denoiser, x, sigma, cond, 3.0)
        alone = [
            adapter.predict(adapter.denoiser, x[i : i + 1], sigma[i : i + 1], cond.select([i]), 3.0) for i in (0, 1)
        ]
        by_expert = [
            adapter.predict(expert, x[i : i + 1], sigma[i : i + 1], cond.select([i]), scale)
            for i, expert, scale in ((0, adapter.denoiser.transformer, 3.0), (1, adapter.denoiser.transformer_2, 2.0))
        ]
    torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-6)
    torch.testing.assert_close(both, torch.cat(by_expert), rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora", [LoraSettings(rank=4, alpha=4), None], ids=["lora", "full"])
@pytest.mark.parametrize(("experts", "trained"), [("high_noise", "transformer."), ("low_noise", "transformer_2.")])
def test_one_expert_trains_and_the_other_stays_frozen(experts, trained, lora, root):
    """``model.experts`` names the expert that trains: only its weights require gradients (LoRA: only it has
    adapters), a rollout still runs both, and a training step changes only its weights."""
    adapter = build_adapter(tiny_config("wan22", root, dtype="float32", experts=experts, lora=lora), "cpu")
    names = {n for n, p in adapter.denoiser.named_parameters() if p.requires_grad}
    assert names and all(n.startswith(trained) for n in names)
    frozen = "transformer_2." if trained == "transformer." else "transformer."
    assert not any("lora" in n and n.startswith(frozen) for n, _ in adapter.denoiser.named_parameters())
    before = {k: v.clone() for k, v in adapter.denoiser.state_dict().items()}
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, kind="sde", noise_level=1.0)
    ro = rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(1))
    sigma = ro.sigmas[:2]  # one row per expert
    out = adapter.predict(adapter.denoiser, ro.latents[:, 0], sigma, ro.cond, 3.0)
    out.square().mean().backward()
    with torch.no_grad():
        for p in adapter.trainable.parameters():
            p.add_(p.grad.sign() * 1e-2)
    changed = {k for k, v in adapter.denoiser.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith(trained) for k in changed)


def test_wan22_needs_two_experts_and_wan_one(root):
    two, one = tiny_config("wan22", root), tiny_config("wan", root)
    with pytest.raises(ValueError, match=r"with two experts, and model\.name=wan runs one: .*model\.name=wan22"):
        build_adapter(dataclasses.replace(one, path=two.path), "cpu")
    with pytest.raises(ValueError, match=r"with one transformer, and model\.name=wan22 runs two: .*model\.name=wan"):
        build_adapter(dataclasses.replace(two, path=one.path, experts="both"), "cpu")


def test_decode_gives_frames_first_and_encode_inverts_its_layout(root):
    """The video convention: ``decode`` -> [B, F, C, H, W] in [0, 1]; ``encode_images`` takes that layout."""
    adapter = build_adapter(tiny_config("wan", root, dtype="float32"), "cpu")
    assert adapter.modality == "video" and (adapter.frames, adapter.fps) == (5, 16)
    frames = adapter.decode(adapter.prepare_latents(2, torch.Generator().manual_seed(0)))
    assert frames.shape == (2, 5, 3, 32, 32) and frames.dtype == torch.float32
    assert 0 <= float(frames.min()) <= float(frames.max()) <= 1
    assert adapter.encode_images(frames).shape == (2, *adapter.latent_shape)


def test_ti2v_from_a_first_frame_equals_the_image_to_video_pipeline(root):
    """Wan 2.2 TI2V-5B with a first frame is ``WanImageToVideoPipeline`` with ``expand_timesteps``: the frame's
    latents pinned as the first latent frame at timestep 0 (the noise-0 rollout equals it, that frame included),
    one pipeline call per image as the pipeline takes one."""
    from diffusers import WanImageToVideoPipeline
    from tiny_models import image_inputs

    adapter = build_adapter(tiny_config("wan_ti2v", root, dtype="float32"), "cpu")
    p = adapter.pipeline
    i2v = WanImageToVideoPipeline(
        tokenizer=p.tokenizer,
        text_encoder=p.text_encoder,
        vae=p.vae,
        scheduler=p.scheduler,
        transformer=p.transformer,
        expand_timesteps=True,
    )
    i2v.set_progress_bar_config(disable=True)
    inputs = image_inputs(adapter, 2, optional=True)
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, kind="sde", noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0), inputs
    )
    expected = torch.cat(
        [
            i2v(
                prompt=[prompt],
                image=inputs.image[i : i + 1],
                latents=ro.latents[i : i + 1, 0],
                height=adapter.height,
                width=adapter.width,
                num_frames=adapter.frames,
                num_inference_steps=3,
                guidance_scale=3.0,
                max_sequence_length=adapter.config.max_sequence_length,
                output_type="latent",
            ).frames
            for i, prompt in enumerate(PROMPTS)
        ]
    )
    torch.testing.assert_close(ro.latents[:, -1], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ro.latents[:, -1, :, :1], ro.cond.image, rtol=0, atol=1e-6)
    assert not torch.equal(
        ro.latents[:, -1],
        rollout(
            adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0)
        ).latents[:, -1],
    )


def test_an_image_to_video_model_needs_its_first_frame(root):
    adapter = build_adapter(tiny_config("wan22_i2v", root), "cpu")
    with pytest.raises(
        ValueError, match=r"needs ImageInputs\.image .* because it generates the video from that first frame"
    ):
        adapter.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match=r"ImageInputs\.image is \(16, 16\) pixels; .* generates \(32, 32\)"):
        adapter.encode_prompts(PROMPTS, ImageInputs(image=torch.rand(2, 3, 16, 16)))


def test_export_writes_both_experts_with_the_trained_ones_lora_merged(root, tmp_path):
    """``trainer.export`` of Wan 2.2 (LoRA on the high noise expert): ``transformer/`` and ``transformer_2/`` load
    with diffusers and predict what the trained experts predict; the LoRA alone is under ``lora/transformer``."""
    from diffusers import WanTransformer3DModel

    from trainer.export import export_denoiser

    config = tiny_config("wan22", root, dtype="float32", experts="high_noise", lora=LoraSettings(rank=4, alpha=4))
    adapter = build_adapter(config, "cpu")
    with torch.no_grad():
        for name, p in adapter.denoiser.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    sigma = adapter.sigmas(3)[:2]  # one row per expert
    with torch.no_grad():
        expected = adapter.predict(adapter.denoiser, x, sigma, cond, 3.0)
    export_denoiser(adapter.denoiser, tmp_path / "out")
    assert (tmp_path / "out" / "lora" / "transformer").is_dir() and not (
        tmp_path / "out" / "lora" / "transformer_2"
    ).exists()
    loaded = [
        WanTransformer3DModel.from_pretrained(tmp_path / "out" / name) for name in ("transformer", "transformer_2")
    ]
    adapter.denoiser.transformer, adapter.denoiser.transformer_2 = loaded
    with torch.no_grad():
        torch.testing.assert_close(adapter.predict(adapter.denoiser, x, sigma, cond, 3.0), expected, rtol=0, atol=1e-5)
