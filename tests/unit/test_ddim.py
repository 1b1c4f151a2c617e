"""DDIM step with log-probability: closed-form density, on-policy ratio, and parity with diffusers at eta 0."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDIMScheduler

from trainer.kernels import KernelCounter
from trainer.samplers.ddim import ddim_step, ddim_step_with_logprob


def _scheduler(num_steps: int = 10, spacing: str = "leading") -> DDIMScheduler:
    """SD1.5's scheduler settings (leading spacing, steps_offset 1, no final alpha of one)."""
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing=spacing,
    )
    scheduler.set_timesteps(num_steps)
    return scheduler


def _inputs(seed: int = 0, shape=(3, 4, 8, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _step(scheduler: DDIMScheduler, eps, x, t, eta, **kwargs):
    t_prev = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    return ddim_step_with_logprob(
        eps,
        x,
        torch.full((x.shape[0],), t),
        torch.full((x.shape[0],), t_prev),
        eta,
        alphas_cumprod=scheduler.alphas_cumprod,
        final_alpha_cumprod=scheduler.final_alpha_cumprod,
        **kwargs,
    )


@pytest.mark.parametrize("index", [0, 5, 9])
def test_eta_zero_equals_diffusers_ddim_step(index):
    scheduler = _scheduler()
    eps, x = _inputs()
    t = int(scheduler.timesteps[index])
    expected = scheduler.step(eps, t, x, eta=0.0).prev_sample
    prev, log_prob, mean, std = _step(scheduler, eps, x, t, 0.0)
    assert torch.equal(prev, expected)
    assert torch.equal(mean, expected)
    assert torch.all(std == 0) and torch.all(log_prob == 0)


def test_mean_and_std_match_diffusers_with_eta():
    """With eta > 0 the scheduler's sample is mean + std * z for the same z."""
    scheduler = _scheduler()
    eps, x = _inputs(1)
    t = int(scheduler.timesteps[3])
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    expected = scheduler.step(eps, t, x, eta=0.8, variance_noise=z).prev_sample
    _, _, mean, std = _step(scheduler, eps, x, t, 0.8)
    torch.testing.assert_close(mean + std * z, expected, rtol=0, atol=1e-6)


def test_log_prob_is_closed_form_gaussian_averaged():
    scheduler = _scheduler()
    eps, x = _inputs(2)
    t = int(scheduler.timesteps[2])
    prev, log_prob, mean, std = _step(scheduler, eps, x, t, 1.0, generator=torch.Generator().manual_seed(3))
    abar = scheduler.alphas_cumprod
    a_t, a_prev = abar[t].double(), abar[t - 100].double()
    sigma = math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
    assert float(std.flatten()[0]) == pytest.approx(sigma, rel=1e-5)
    expected = (
        -((prev.double() - mean.double()) ** 2) / (2 * sigma**2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
    ).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_on_policy_ratio_is_one():
    scheduler = _scheduler()
    eps, x = _inputs(3)
    t = int(scheduler.timesteps[1])
    prev, log_prob, _, _ = _step(scheduler, eps, x, t, 1.0, generator=torch.Generator().manual_seed(4))
    _, again, _, _ = _step(scheduler, eps, x, t, 1.0, prev_sample=prev)
    assert torch.equal(torch.exp(again - log_prob), torch.ones_like(log_prob))


def test_per_sample_timesteps_and_bf16_inputs():
    """Each sample may sit at its own timestep; bf16 inputs are computed in float32 and returned in bf16."""
    scheduler = _scheduler()
    eps, x = _inputs(4)
    t = scheduler.timesteps[[0, 4, 9]]
    prev, log_prob, mean, _ = ddim_step_with_logprob(
        eps.bfloat16(),
        x.bfloat16(),
        t,
        t - 100,
        0.5,
        generator=torch.Generator().manual_seed(0),
        alphas_cumprod=scheduler.alphas_cumprod,
        final_alpha_cumprod=scheduler.final_alpha_cumprod,
    )
    assert prev.dtype == torch.bfloat16 and mean.dtype == torch.float32 and log_prob.shape == (3,)
    for i in range(3):
        _, _, mean_i, _ = _step(
            scheduler, eps[i : i + 1].bfloat16().float(), x[i : i + 1].bfloat16().float(), int(t[i]), 0.5
        )
        torch.testing.assert_close(mean[i : i + 1], mean_i, rtol=0, atol=0)


def test_scheduled_step_equals_the_step_at_the_schedules_timesteps():
    """``ddim_step`` precomputes each step's constants: an int index (rollout) and [B] indices (training)
    give ``ddim_step_with_logprob`` at t = t[i], t_prev = t[i] - 1000 // 5, the last step (t_prev < 0)
    included, and at eta 0 the scheduler's step bit for bit."""
    scheduler = _scheduler(5)
    timesteps = torch.cat([scheduler.timesteps, scheduler.timesteps[-1:] - 200]).float()
    step = ddim_step(timesteps, scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
    eps, x = _inputs(5)
    for i in range(5):
        t, t_prev = int(timesteps[i]), int(timesteps[i]) - 200
        expected = ddim_step_with_logprob(
            eps,
            x,
            torch.full((3,), t),
            torch.full((3,), t_prev),
            0.7,
            generator=torch.Generator().manual_seed(i),
            alphas_cumprod=scheduler.alphas_cumprod,
            final_alpha_cumprod=scheduler.final_alpha_cumprod,
        )
        got = step(eps, x, i, 0.7, generator=torch.Generator().manual_seed(i))
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(step(eps, x, i, 0.7, prev_sample=got[0])[1], got[1])
        assert torch.equal(step(eps, x, i, 0.0)[0], scheduler.step(eps, t, x, eta=0.0).prev_sample)
    steps = torch.tensor([4, 0, 2])
    _, per_sample, mean, std = step(eps, x, steps, 0.7, prev_sample=x)
    for j, i in enumerate(steps.tolist()):
        _, one, one_mean, one_std = step(eps[j : j + 1], x[j : j + 1], i, 0.7, prev_sample=x[j : j + 1])
        assert torch.equal(per_sample[j : j + 1], one) and torch.equal(mean[j : j + 1], one_mean)
        assert torch.equal(std[j : j + 1], one_std)
    alone, kl_std = step.mean(eps, x, steps, 0.7)
    assert torch.equal(alone, mean) and torch.equal(kl_std, std)


@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
def test_scheduled_step_at_eta_zero_is_diffusers_step_for_every_timestep_spacing(spacing):
    """The step from t[i] goes to t[i] - N // T as ``DDIMScheduler.step`` does, which is t[i + 1] only
    for leading spacing (trailing: t = 999, 666, 332 step to 666, 333, -1; linspace: t = 999, 500, 0 step
    to 666, 167, -333)."""
    scheduler = _scheduler(3, spacing)
    timesteps = torch.cat([scheduler.timesteps, scheduler.timesteps[-1:] - 1000 // 3]).float()
    step = ddim_step(timesteps, scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
    eps, x = _inputs(7)
    for i, t in enumerate(scheduler.timesteps):
        assert torch.equal(step(eps, x, i, 0.0)[0], scheduler.step(eps, t, x, eta=0.0).prev_sample)


def test_a_rollout_step_is_eleven_kernels_and_scoring_nine():
    """Once its constants are shaped: the mean in the scheduler's order (6), draw and scale (2), difference,
    dot product and log-prob (3); scoring a given sample skips the draw. diffusers' DDIM step with eta
    computes its constants per call: 26 kernels with diffusers 0.42."""
    scheduler = _scheduler(5)
    timesteps = torch.cat([scheduler.timesteps, scheduler.timesteps[-1:] - 200]).float()
    step = ddim_step(timesteps, scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
    eps, x = _inputs(6)
    step(eps, x, 1, 1.0, generator=torch.Generator().manual_seed(0))
    with KernelCounter() as drawn:
        sample, _, _, _ = step(eps, x, 1, 1.0, generator=torch.Generator().manual_seed(0))
    with KernelCounter() as scored:
        step(eps, x, 1, 1.0, prev_sample=sample)
    assert (drawn.kernels, scored.kernels) == (11, 9)


def test_eta_outside_zero_to_one_is_refused_before_the_first_step():
    """Above 1, 1 - abar_prev - sigma_t^2 < 0 and the step's mean is NaN: a ValueError naming the setting, from the
    step, from ``check_noise_level`` (which a trainer can call before its warm-up) and from the plain step."""
    scheduler = _scheduler(5)
    timesteps = torch.cat([scheduler.timesteps, scheduler.timesteps[-1:] - 200]).float()
    step = ddim_step(timesteps, scheduler.alphas_cumprod, scheduler.final_alpha_cumprod)
    eps, x = _inputs(8)
    message = r"algorithm.sampler.noise_level=1.5: .* DDIM's eta, which must be in \[0, 1\]"
    with pytest.raises(ValueError, match=message):
        step.check_noise_level(1.5)
    with pytest.raises(ValueError, match=message):
        step(eps, x, 0, 1.5, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        _step(scheduler, eps, x, int(timesteps[0]), 1.5)
    step.check_noise_level(1.0)
    assert all(
        torch.isfinite(step(eps, x, i, 1.0, generator=torch.Generator().manual_seed(i))[0]).all() for i in range(5)
    )
