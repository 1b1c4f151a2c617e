"""DDIM step with log-probability: closed-form density, on-policy ratio, and parity with diffusers at eta 0."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDIMScheduler

from trainer.samplers.ddim import ddim_step_with_logprob


def _scheduler(num_steps: int = 10) -> DDIMScheduler:
    """SD1.5's scheduler settings (leading spacing, steps_offset 1, no final alpha of one)."""
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    scheduler.set_timesteps(num_steps)
    return scheduler


def _inputs(seed: int = 0, shape=(3, 4, 8, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _step(scheduler: DDIMScheduler, eps, x, t, eta, **kwargs):
    t_prev = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    return ddim_step_with_logprob(eps, x, torch.full((x.shape[0],), t), torch.full((x.shape[0],), t_prev), eta,
                                  alphas_cumprod=scheduler.alphas_cumprod,
                                  final_alpha_cumprod=scheduler.final_alpha_cumprod, **kwargs)


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
    expected = (-((prev.double() - mean.double()) ** 2) / (2 * sigma**2) - math.log(sigma)
                - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
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
        eps.bfloat16(), x.bfloat16(), t, t - 100, 0.5, generator=torch.Generator().manual_seed(0),
        alphas_cumprod=scheduler.alphas_cumprod, final_alpha_cumprod=scheduler.final_alpha_cumprod)
    assert prev.dtype == torch.bfloat16 and mean.dtype == torch.float32 and log_prob.shape == (3,)
    for i in range(3):
        _, _, mean_i, _ = _step(scheduler, eps[i : i + 1].bfloat16().float(), x[i : i + 1].bfloat16().float(),
                                int(t[i]), 0.5)
        torch.testing.assert_close(mean[i : i + 1], mean_i, rtol=0, atol=0)
