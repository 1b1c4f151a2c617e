"""The tiny SD3-architecture adapter against diffusers' own StableDiffusion3Pipeline, and on-policy checks."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusion3Pipeline

from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.algorithms.grpo_guard import GRPOGuard, GRPOGuardConfig
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    return SD3Adapter(TinyConfig(path=tiny_model_dir))


def _pipeline(adapter: SD3Adapter) -> StableDiffusion3Pipeline:
    """The plain diffusers pipeline over the adapter's own components. Our model is pixel space; the
    pipeline needs a VAE object only for its scale factor, so a one-block VAE (factor 1) is given and
    outputs are compared as latents."""
    vae = AutoencoderKL(
        block_out_channels=(4,),
        in_channels=1,
        out_channels=1,
        latent_channels=1,
        norm_num_groups=1,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        layers_per_block=1,
    ).eval()
    p = adapter.pipeline
    return StableDiffusion3Pipeline(
        transformer=adapter.denoiser,
        scheduler=adapter.scheduler,
        vae=vae,
        text_encoder=p.text_encoder,
        tokenizer=p.tokenizer,
        text_encoder_2=p.text_encoder_2,
        tokenizer_2=p.tokenizer_2,
        text_encoder_3=None,
        tokenizer_3=None,
    )


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_noise_level_zero_rollout_equals_the_diffusers_pipeline(adapter, guidance):
    steps, seed = 6, 11
    expected = _pipeline(adapter)(
        prompt=PROMPTS,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=16,
        width=16,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        max_sequence_length=adapter.config.max_sequence_length,
    ).images
    ours = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS,
        torch.arange(2),
        SamplerSettings(num_steps=steps, guidance_scale=guidance, noise_level=0.0),
        torch.Generator().manual_seed(seed),
    )
    assert ours.latents.shape == (2, steps + 1, 1, 16, 16)
    # Same ops in the same order: equal to float32 rounding (observed max difference 0).
    torch.testing.assert_close(ours.latents[:, -1], expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.images, (expected / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)


def test_sde_rollout_reevaluates_with_ratio_one_at_every_trained_step(adapter):
    settings = SamplerSettings(num_steps=5, noise_level=0.7)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS * 2, torch.tensor([0, 1, 0, 1]), settings, torch.Generator().manual_seed(0)
    )
    assert ro.stochastic.all() and torch.isfinite(ro.log_probs).all()
    algo = GRPO(GRPOConfig(group_size=2, timestep_fraction=1.0, micro_batch_size=4, sampler=settings))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, ro.group_ids, 0))
    ctx = LossContext(adapter, adapter.denoiser, None)
    (units,) = algo.plan(batch, torch.Generator().manual_seed(0))
    assert len(units) == len(ro.trainable_steps()) == 4  # the last step is never trained
    for unit in units:
        _, stats = algo.loss(ctx, unit)
        assert unit.on_policy and stats["ratio"].item() == 1.0 and stats["approx_kl"].item() == 0.0
        assert stats["logp_gap"].item() < 1e-6  # the rollout's own log-probs agree with the re-evaluation


@pytest.mark.parametrize("name", ["grpo", "grpo_guard"])
def test_log_p_old_is_the_training_forward_while_the_weights_are_the_rollouts(adapter, name):
    """A rollout whose recorded log-probs (and step means) are off, as a compiled bf16 rollout graph's round
    apart from the training graph's: the first optimizer step's ratio is still 1 exactly and ``logp_gap``
    reports the offset; a second pass reuses the recorded training values (ratio 1 again: no step in between);
    with two optimizer steps, the second step's samples have only the rollout's values: their ratio leaves the
    clip range without a step."""
    settings = SamplerSettings(num_steps=4, noise_level=0.7)
    ro = rollout(
        adapter,
        adapter.denoiser,
        PROMPTS * 2,
        torch.tensor([0, 1, 0, 1]),
        settings,
        torch.Generator().manual_seed(0),
        record_means=name == "grpo_guard",
    )
    ro.log_probs = ro.log_probs + 0.01 * torch.arange(4.0)[:, None]  # sample i off by 0.01 i
    if ro.means is not None:
        ro.means = ro.means + 0.1
    ctx = LossContext(adapter, adapter.denoiser, None)
    rewards = Rewards(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 1.0]), ro.group_ids, 0)
    for steps_per_epoch in (1, 2):
        kind, config = (GRPO, GRPOConfig) if name == "grpo" else (GRPOGuard, GRPOGuardConfig)
        algo = kind(config(group_size=2, micro_batch_size=1, sampler=settings, steps_per_epoch=steps_per_epoch))
        assert ("logp_gap" in algo.shown_metrics) == (steps_per_epoch == 2)
        batch = algo.make_batch(ro, rewards)
        for first_pass in (True, False):
            for s, units in enumerate(algo.plan(batch, torch.Generator().manual_seed(0))):
                for unit in units:
                    _, stats = algo.loss(ctx, unit)
                    assert unit.on_policy == (first_pass and s == 0)
                    if unit.on_policy:
                        assert stats["ratio"].item() == 1.0 and stats["clip_frac"].item() == 0.0
                        offset = 0.01 * float(unit.indices.max())
                        if name == "grpo":
                            assert stats["logp_gap"].item() == pytest.approx(offset, abs=1e-6)
                    elif s == 0:  # a second pass over the pairs the first step recorded
                        assert stats["ratio"].item() == 1.0
                    else:  # only the rollout's values: the offset shows (grpo_guard: the means' offset)
                        assert abs(stats["ratio"].item() - 1.0) > 1e-4 and "logp_gap" not in stats


def test_sde_window_makes_only_the_window_stochastic(adapter):
    settings = SamplerSettings(num_steps=8, sde_window=2, window_range=(0, 3))
    for seed in range(5):
        ro = rollout(adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(seed))
        steps = torch.nonzero(ro.stochastic).flatten().tolist()
        assert len(steps) == 2 and steps[1] == steps[0] + 1 and 0 <= steps[0] < 3
        assert torch.all(ro.log_probs[:, ~ro.stochastic] == 0)
        assert ro.trainable_steps().tolist() == steps


def test_save_pretrained_round_trip_reproduces_outputs(adapter, tmp_path):
    x = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.5)
    cond = adapter.encode_prompts(PROMPTS)
    before = adapter.predict(adapter.denoiser, x, sigma, cond, 2.0)
    adapter.trainable.save(str(tmp_path / "transformer"))
    from diffusers import SD3Transformer2DModel

    reloaded = SD3Transformer2DModel.from_pretrained(tmp_path / "transformer").eval()
    assert torch.equal(adapter.predict(reloaded, x, sigma, cond, 2.0), before)


def test_lora_adapter_trains_only_lora_and_reference_is_the_base(tiny_model_dir):
    from trainer.models.common import LoraSettings

    lora = SD3Adapter(TinyConfig(path=tiny_model_dir, lora=LoraSettings(rank=4, alpha=4)))
    names = [n for n, p in lora.denoiser.named_parameters() if p.requires_grad]
    assert names and all("lora" in n for n in names)
    base = SD3Adapter(TinyConfig(path=tiny_model_dir))
    x = base.prepare_latents(2, torch.Generator().manual_seed(0))
    cond = base.encode_prompts(PROMPTS)
    sigma = torch.full((2,), 0.7)
    with torch.no_grad():
        for p in lora.trainable.parameters():
            p.add_(0.5)
        torch.testing.assert_close(
            lora.predict(lora.trainable.reference(), x, sigma, cond, 1.0),
            base.predict(base.denoiser, x, sigma, cond, 1.0),
        )
        assert not torch.allclose(
            lora.predict(lora.denoiser, x, sigma, cond, 1.0), base.predict(base.denoiser, x, sigma, cond, 1.0)
        )


def test_sd3_adapter_refuses_a_directory_without_weights(tmp_path):
    with pytest.raises(ValueError, match="model.path"):
        from trainer.models.sd3 import SD3Adapter, SD3Config

        SD3Adapter(SD3Config(path=str(tmp_path)))


def test_image_inputs_are_refused_naming_the_adapter_the_user_chose(adapter):
    """The embedded model is the SD3 adapter under another name: its errors say the name the config gave."""
    from trainer.models.base import ImageInputs

    with pytest.raises(ValueError, match=r"^the tiny adapter takes no ImageInputs.mask \(it is a text-to-image"):
        adapter.encode_prompts(PROMPTS, ImageInputs(mask=torch.zeros(2, 1, 16, 16)))


def test_awm_takes_v_old_from_the_policy_itself_until_its_first_step(tiny_model_dir):
    """AWM's first optimizer step on a batch runs at the rollout's weights: its v_old is the policy's own
    forward, so the ratio is 1 exactly with no copy of the sampling policy read; a second pass reads that copy,
    taken before the rollout (here of a policy moved since, so its ratio leaves 1)."""
    from trainer.algorithms.awm import AWM, AWMConfig
    from trainer.distributed import SingleProcess

    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))  # its weights are moved below
    settings = SamplerSettings(num_steps=4, noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS * 2, torch.tensor([0, 1, 0, 1]), settings, torch.Generator().manual_seed(0)
    )
    algo = AWM(AWMConfig(group_size=2, micro_batch_size=2, inner_epochs=2, clip_range=1e-4, sampler=settings))
    ctx = LossContext(adapter, adapter.denoiser, None)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    algo.start_epoch(ctx, 0)  # the sampling policy's copy (and the EMA policy's start)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, ro.group_ids, 0))
    (units,) = algo.plan(batch, torch.Generator().manual_seed(0))
    for unit in units:
        _, stats = algo.loss(ctx, unit)
        assert unit.on_policy and stats["ratio"].item() == 1.0 and stats["clip_frac"].item() == 0.0
        assert stats["ema_kl"].item() == 0.0  # the EMA policy starts at the policy
    with torch.no_grad():
        for p in adapter.trainable.parameters():
            p.mul_(1.01)
    (units,) = algo.plan(batch, torch.Generator().manual_seed(0))
    ratios = [algo.loss(ctx, unit)[1]["ratio"].item() for unit in units]
    assert not any(unit.on_policy for unit in units) and all(abs(r - 1.0) > 1e-6 for r in ratios)
