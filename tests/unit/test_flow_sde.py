"""The flow SDE step against closed forms (ALGORITHMS.md section 1)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from trainer.kernels import KernelCounter
from trainer.samplers import STEP_FUNCTIONS, flow_step
from trainer.samplers.flow_sde import cps_step_with_logprob, eta_step_with_logprob, sde_step_with_logprob


def _inputs(batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, 4, 4, generator=g)
    v = torch.randn(batch, 2, 4, 4, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.2])[:batch]
    sigma_next = torch.tensor([0.8, 0.4, 0.1])[:batch]
    return x, v, sigma, sigma_next


def reference_sde_step(v, x, sigma, sigma_next, a, prev_sample=None, generator=None, sigma_max=None):
    """Flow-GRPO's SDE step in plain tensor code, the oracle the fast path (per-step constants, fused
    kernels) is checked against. sigma, sigma_next: [B]; returns (x_next, log_prob [B], mean, std_dev_t)."""
    s = sigma.float().view(-1, *[1] * (x.ndim - 1))
    s_next = sigma_next.float().view_as(s)
    dt = s_next - s
    s_safe = torch.where(s == 1, torch.as_tensor(sigma_max, dtype=torch.float32), s) if sigma_max is not None else s
    std_dev_t = a * torch.sqrt(s / (1 - s_safe))
    score = -(x + (1 - s) * v) / s  # of x_sigma = (1 - sigma) x0 + sigma eps, with v = eps - x0
    mean = x + (v - std_dev_t**2 / 2 * score) * dt
    scale = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        prev_sample = mean + scale * torch.randn(x.shape, generator=generator)
    log_density = -((prev_sample - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    return prev_sample, log_density.mean(dim=tuple(range(1, x.ndim))), mean, std_dev_t


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 1.0])
def test_the_fast_step_matches_the_plain_reference_step(noise_level):
    """Every step of a shifted schedule, the first (sigma = 1, sigma_max in its place) included: the scheduled
    step and the per-sample function draw the reference's sample from the same generator and score a given
    sample as the reference does."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    schedule = scheduler.sigmas.to(torch.float32)
    fast = flow_step("sde", schedule)
    x, v, _, _ = _inputs()
    other = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    for i in range(5):  # the last step (sigma_next = 0) is deterministic only at noise level 0
        sigma, sigma_next = schedule[i].expand(3), schedule[i + 1].expand(3)
        expected = reference_sde_step(
            v, x, sigma, sigma_next, noise_level, generator=torch.Generator().manual_seed(i), sigma_max=schedule[1]
        )
        by_index = fast(v, x, i, noise_level, generator=torch.Generator().manual_seed(i))
        by_sigma = sde_step_with_logprob(
            v, x, sigma, sigma_next, noise_level, sigma_max=schedule[1], generator=torch.Generator().manual_seed(i)
        )
        for got in (by_index, by_sigma):
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        _, reference_score, _, _ = reference_sde_step(
            v, x, sigma, sigma_next, noise_level, prev_sample=other, sigma_max=schedule[1]
        )
        torch.testing.assert_close(
            fast(v, x, i, noise_level, prev_sample=other)[1], reference_score, rtol=1e-5, atol=1e-5
        )


def test_log_prob_is_the_averaged_closed_form_gaussian_density():
    x, v, sigma, sigma_next = _inputs()
    prev, log_prob, mean, std = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=0.7, generator=torch.Generator().manual_seed(1)
    )
    dt = (sigma_next - sigma).view(-1, 1, 1, 1)
    s = sigma.view(-1, 1, 1, 1)
    expected_std = 0.7 * torch.sqrt(s / (1 - s))
    expected_mean = x * (1 + expected_std**2 / (2 * s) * dt) + v * (1 + expected_std**2 * (1 - s) / (2 * s)) * dt
    torch.testing.assert_close(std, expected_std)
    torch.testing.assert_close(mean, expected_mean)
    scale = expected_std * torch.sqrt(-dt)
    closed = -((prev - expected_mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(log_prob, closed.mean(dim=(1, 2, 3)))
    by_torch = torch.distributions.Normal(expected_mean, scale).log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, by_torch)


def test_mean_equals_the_score_form_of_the_reverse_sde():
    x, v, sigma, sigma_next = _inputs()
    _, _, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=0.5)
    s = sigma.view(-1, 1, 1, 1)
    dt = (sigma_next - sigma).view(-1, 1, 1, 1)
    score = -(x + (1 - s) * v) / s
    torch.testing.assert_close(mean, x + (v - std**2 / 2 * score) * dt)


def test_reevaluating_the_drawn_sample_gives_ratio_exactly_one():
    x, v, sigma, sigma_next = _inputs()
    prev, log_prob, _, _ = sde_step_with_logprob(v, x, sigma, sigma_next, generator=torch.Generator().manual_seed(3))
    _, again, _, _ = sde_step_with_logprob(v, x, sigma, sigma_next, prev_sample=prev)
    assert torch.equal(torch.exp(again - log_prob), torch.ones(3))


def test_noise_level_zero_is_the_diffusers_euler_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    x, v, _, _ = _inputs(batch=2)
    for i in (0, 4, 9):
        expected = scheduler.step(v, scheduler.timesteps[i], x, return_dict=False)[0]
        scheduler._step_index = None
        sigma = scheduler.sigmas[i].expand(2)
        sigma_next = scheduler.sigmas[i + 1].expand(2)
        prev, _, _, std = sde_step_with_logprob(v, x, sigma, sigma_next, noise_level=0.0, sigma_max=scheduler.sigmas[1])
        assert torch.equal(std, torch.zeros_like(std))
        torch.testing.assert_close(prev, expected, rtol=0, atol=1e-6)


def test_first_step_uses_sigma_max_and_refuses_without_it():
    x, v, _, _ = _inputs(batch=2)
    one, nxt = torch.ones(2), torch.full((2,), 0.9)
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, one, nxt)
    _, _, _, std = sde_step_with_logprob(v, x, one, nxt, noise_level=0.7, sigma_max=0.9)
    torch.testing.assert_close(std.flatten(), torch.full((2,), 0.7 * math.sqrt(1 / (1 - 0.9))))


def test_bf16_inputs_are_computed_in_float32():
    x, v, sigma, sigma_next = _inputs()
    prev16, logp16, mean16, _ = sde_step_with_logprob(
        v.bfloat16(), x.bfloat16(), sigma, sigma_next, generator=torch.Generator().manual_seed(0)
    )
    assert prev16.dtype == torch.bfloat16 and logp16.dtype == torch.float32 and mean16.dtype == torch.float32
    _, ref_logp, ref_mean, _ = sde_step_with_logprob(
        v.bfloat16().float(), x.bfloat16().float(), sigma, sigma_next, prev_sample=prev16.float()
    )
    torch.testing.assert_close(mean16, ref_mean)
    torch.testing.assert_close(logp16, ref_logp)


@pytest.mark.parametrize("step", [cps_step_with_logprob, eta_step_with_logprob])
def test_variants_reduce_to_euler_at_zero_noise_and_score_their_own_samples(step):
    x, v, sigma, sigma_next = _inputs()
    prev, _, _, _ = step(v, x, sigma, sigma_next, noise_level=0.0)
    torch.testing.assert_close(prev, x + v * (sigma_next - sigma).view(-1, 1, 1, 1))
    prev, log_prob, mean, std = step(
        v, x, sigma, sigma_next, noise_level=0.5, generator=torch.Generator().manual_seed(0)
    )
    _, again, _, _ = step(v, x, sigma, sigma_next, noise_level=0.5, prev_sample=prev)
    assert torch.equal(again, log_prob)
    assert torch.all(log_prob < 10) and torch.all(std > 0)


def test_cps_keeps_the_noise_coefficient():
    x, v, sigma, sigma_next = _inputs()
    _, _, mean, std = cps_step_with_logprob(v, x, sigma, sigma_next, noise_level=0.6)
    sn = sigma_next.view(-1, 1, 1, 1)
    torch.testing.assert_close(std, sn * math.sin(0.6 * math.pi / 2))
    x0, x1 = x - sigma.view(-1, 1, 1, 1) * v, x + (1 - sigma.view(-1, 1, 1, 1)) * v
    torch.testing.assert_close(mean, (1 - sn) * x0 + torch.sqrt(sn**2 - std**2) * x1)


def test_eta_step_std_is_eta_sqrt_sigma_gap():
    x, v, sigma, sigma_next = _inputs()
    prev, log_prob, mean, std = eta_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=0.3, generator=torch.Generator().manual_seed(0)
    )
    scale = 0.3 * torch.sqrt(sigma - sigma_next).view(-1, 1, 1, 1)
    expected = torch.distributions.Normal(mean, scale).log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected)


def test_eta_step_mean_and_std_closed_form():
    """At eta = 0.3 (not 0, where the drift's correction vanishes): std_dev_t = eta, so
        mean   = x (1 + eta^2 dt / (2 sigma)) + v (1 + eta^2 (1 - sigma) / (2 sigma)) dt
        x_next = mean + eta sqrt(sigma - sigma_next) eps
    with dt = sigma_next - sigma, and eps the generator's standard normal draw."""
    x, v, sigma, sigma_next = _inputs()
    eta = 0.3
    prev, log_prob, mean, std = eta_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=eta, generator=torch.Generator().manual_seed(0)
    )
    s = sigma.view(-1, 1, 1, 1)
    dt = (sigma_next - sigma).view(-1, 1, 1, 1)
    expected_mean = x * (1 + eta**2 * dt / (2 * s)) + v * (1 + eta**2 * (1 - s) / (2 * s)) * dt
    torch.testing.assert_close(mean, expected_mean)
    # the score correction is not negligible here: the plain Euler mean is well outside the tolerance
    assert (mean - (x + v * dt)).abs().max() > 1e-2
    torch.testing.assert_close(std, torch.full_like(std, eta))
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    scale = eta * torch.sqrt(-dt)
    torch.testing.assert_close(prev, expected_mean + scale * eps)
    closed = -((prev - expected_mean) ** 2) / (2 * scale**2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(log_prob, closed.mean(dim=(1, 2, 3)))


@pytest.mark.parametrize("kind", sorted(STEP_FUNCTIONS))
def test_scheduled_step_equals_the_step_at_the_schedules_sigmas(kind):
    """``flow_step`` precomputes each step's constants: per-step (int) and per-sample ([B]) indices give the
    per-sample function's values at sigma = t[i], sigma_next = t[i + 1], the first step (sigma = 1) included."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    schedule = scheduler.sigmas.to(torch.float32)
    scheduled = flow_step(kind, schedule)
    x, v, _, _ = _inputs()
    for i in range(5):
        sigma, sigma_next = schedule[i].expand(3), schedule[i + 1].expand(3)
        draw = dict(generator=torch.Generator().manual_seed(i))
        expected = STEP_FUNCTIONS[kind](v, x, sigma, sigma_next, 0.7, sigma_max=schedule[1], **draw)
        got = scheduled(v, x, i, 0.7, generator=torch.Generator().manual_seed(i))
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        _, again, _, _ = scheduled(v, x, i, 0.7, prev_sample=got[0])
        assert torch.equal(again, got[1])  # the rollout's log-prob is re-evaluated exactly
    steps = torch.tensor([0, 3, 1])
    _, per_sample, mean, _ = scheduled(v, x, steps, 0.7, prev_sample=x)
    for j, i in enumerate(steps.tolist()):
        _, one, one_mean, _ = scheduled(v[j : j + 1], x[j : j + 1], i, 0.7, prev_sample=x[j : j + 1])
        torch.testing.assert_close(per_sample[j : j + 1], one, rtol=0, atol=0)
        torch.testing.assert_close(mean[j : j + 1], one_mean, rtol=0, atol=0)
    kernels = []
    for index in (2, steps):  # the mean alone (a reference's KL term): the step's, in 2 kernels (+ 1 gather)
        with KernelCounter() as counter:
            alone, kl_std = scheduled.mean(v, x, index, 0.7)
        kernels.append(counter.kernels)
        _, _, full, full_std = scheduled(v, x, index, 0.7, prev_sample=x)
        assert torch.equal(alone, full) and torch.equal(kl_std, full_std)
    assert kernels == [2, 3]
    zero, logp, _, std = scheduled(v, x, 4, 0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(zero, x + v * (schedule[5] - schedule[4]))
    assert torch.equal(logp, torch.zeros(3)) and torch.equal(std, torch.zeros_like(std))


def test_an_unknown_step_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="sampler.kind='ode'"):
        flow_step("ode", torch.linspace(1, 0, 5))


def test_a_rollout_step_is_seven_kernels_and_scoring_five():
    """Once a step's constants are shaped (first call per index, noise level and layout), a rollout step
    runs mean (2), draw and scale (2), difference, dot product and log-prob; scoring a given sample skips
    the draw. diffusers' deterministic Euler step runs 6."""
    schedule = torch.linspace(1, 0, 5)
    step = flow_step("sde", schedule)
    x, v, _, _ = _inputs()
    step(v, x, 1, 0.7, generator=torch.Generator().manual_seed(0))
    with KernelCounter() as drawn:
        sample, _, _, _ = step(v, x, 1, 0.7, generator=torch.Generator().manual_seed(0))
    with KernelCounter() as scored:
        step(v, x, 1, 0.7, prev_sample=sample)
    assert (drawn.kernels, scored.kernels) == (7, 5)


def test_shaped_constants_are_kept_per_layout():
    """The same step index on a sample of another rank or batch size gets its own constants."""
    step = flow_step("sde", torch.linspace(1, 0, 5))
    x, v, _, _ = _inputs()
    flat = step(v.reshape(3, 2, 16), x.reshape(3, 2, 16), 2, 0.7, prev_sample=x.reshape(3, 2, 16))
    nested = step(v, x, 2, 0.7, prev_sample=x)
    single = step(v[:1], x[:1], 2, 0.7, prev_sample=x[:1])
    torch.testing.assert_close(flat[1], nested[1], rtol=0, atol=0)
    torch.testing.assert_close(flat[2], nested[2].reshape(3, 2, 16), rtol=0, atol=0)
    torch.testing.assert_close(single[1], nested[1][:1], rtol=0, atol=0)


def test_cps_mse_scores_minus_the_mean_square_and_its_log_ratio_is_2_std_squared_times_the_gaussian():
    """Flow-GRPO's CPS convention: the same step (mean, noise, draw), scored by -mean((x_next - mean)^2). Its
    log-ratio between two means is the Gaussian one times 2 std^2 (std = sigma_next sin(a pi / 2))."""
    from trainer.samplers.flow_sde import cps_mse_step_with_logprob

    x, v, sigma, sigma_next = _inputs()
    draw = dict(generator=torch.Generator().manual_seed(0))
    prev, gaussian, mean, std = cps_step_with_logprob(v, x, sigma, sigma_next, 0.6, **draw)
    prev_mse, mse, mean_mse, std_mse = cps_mse_step_with_logprob(
        v, x, sigma, sigma_next, 0.6, generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(prev, prev_mse) and torch.equal(mean, mean_mse) and torch.equal(std, std_mse)
    torch.testing.assert_close(mse, -((prev - mean) ** 2).mean(dim=(1, 2, 3)))
    _, gaussian_other, _, _ = cps_step_with_logprob(v + 0.1, x, sigma, sigma_next, 0.6, prev_sample=prev)
    _, mse_other, _, _ = cps_mse_step_with_logprob(v + 0.1, x, sigma, sigma_next, 0.6, prev_sample=prev)
    scale = 2 * (sigma_next * math.sin(0.6 * math.pi / 2)) ** 2
    torch.testing.assert_close(mse_other - mse, scale * (gaussian_other - gaussian), rtol=1e-4, atol=1e-6)
    # a deterministic step scores 0, as every kind's does
    _, zero, _, _ = cps_mse_step_with_logprob(v, x, sigma, sigma_next, 0.0)
    assert torch.equal(zero, torch.zeros(3))
