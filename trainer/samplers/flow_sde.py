"""Stochastic reverse steps for flow-matching models that record log-probabilities.

Time runs from sigma = 1 (noise) to sigma = 0 (image); the model predicts a velocity v with
x_sigma = (1 - sigma) * x0 + sigma * eps and v = eps - x0. Every function here is pure: it takes tensors,
returns tensors, holds no state and imports no model code. All arithmetic runs in float32, whatever the
input dtype (bf16 overflows in the mean), and ``prev_sample`` is returned in the input dtype.

The log-probability is the per-element Gaussian log-density of ``prev_sample`` under
N(prev_sample_mean, (std_dev_t * sqrt(-dt))^2), AVERAGED over all non-batch dimensions (not summed):
that keeps the policy ratio near 1, which is why PPO clip ranges of 1e-4..1e-5 are used with it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from trainer.samplers.steps import (
    ScheduledStep,
    log_prob_constants,
    per_sample,
    shaped_coefficients,
    shaped_step,
)


class StepCoefficients(NamedTuple):
    """The constants of a linear-Gaussian flow step, per sample or per step of a schedule ([N] each):

        mean = c_x x + c_v v,   x_next = mean + std eps,
        log_prob = lp_scale * mean_elements((x_next - mean)^2) + lp_const

    with lp_scale = -1 / (2 std^2) and lp_const = -log std - log sqrt(2 pi), both 0 where std = 0 (a
    deterministic step has no density: see ``log_prob_constants``). ``kl_std`` is what the KL divides by
    (``std_dev_t``; see ``gaussian_mean_kl``).
    """

    c_x: torch.Tensor
    c_v: torch.Tensor
    std: torch.Tensor
    kl_std: torch.Tensor
    lp_scale: torch.Tensor
    lp_const: torch.Tensor


def _coefficients(c_x: torch.Tensor, c_v: torch.Tensor, std: torch.Tensor, kl_std: torch.Tensor) -> StepCoefficients:
    return StepCoefficients(c_x, c_v, std, kl_std, *log_prob_constants(std))


def _drift_coefficients(
    sigma: torch.Tensor, dt: torch.Tensor, std_dev_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The marginal-preserving drift's c_x = 1 + std_dev_t^2 dt / (2 sigma), c_v = (1 + std_dev_t^2 (1 - sigma) /
    (2 sigma)) dt. At std_dev_t = 0 they are 1 and dt: x + v dt, bit for bit diffusers' Euler step."""
    return 1 + std_dev_t**2 / (2 * sigma) * dt, (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt


def _below_one(sigma: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None) -> torch.Tensor:
    """``sigma`` with ``sigma_max`` (the scheduler's sigmas[1]) where sigma = 1, so that 1 - s is not 0."""
    if sigma_max is None:
        if noise_level > 0 and bool((sigma == 1).any()):
            raise ValueError("sde_step_with_logprob: sigma == 1 needs sigma_max (the scheduler's sigmas[1])")
        return sigma
    return torch.where(sigma == 1, torch.as_tensor(sigma_max, device=sigma.device, dtype=torch.float32), sigma)


def sde_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None = None
) -> StepCoefficients:
    """Flow-GRPO's SDE step from ``sigma`` to ``sigma_next`` ([N] each), a = ``noise_level``, dt = sigma_next - sigma:
    std_dev_t = a sqrt(sigma / (1 - s)),  s = sigma, or sigma_max where sigma = 1
    c_x, c_v = the drift's (``_drift_coefficients``),  std = std_dev_t sqrt(-dt),  kl_std = std_dev_t"""
    dt = sigma_next - sigma
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - _below_one(sigma, noise_level, sigma_max)))
    return _coefficients(*_drift_coefficients(sigma, dt, std_dev_t), std_dev_t * torch.sqrt(-dt), std_dev_t)


def cps_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None = None
) -> StepCoefficients:
    """Coefficient-preserving sampling, a = ``noise_level``: std = kl_std = sigma_next sin(a pi / 2) and
    r = sqrt(sigma_next^2 - std^2); the mean (1 - sigma_next) (x - sigma v) + r (x + (1 - sigma) v) gives
        c_x = 1 - sigma_next + r,  c_v = r (1 - sigma) - (1 - sigma_next) sigma"""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    r = torch.sqrt((sigma_next**2 - std**2).clamp_min(0))
    return _coefficients(1 - sigma_next + r, r * (1 - sigma) - (1 - sigma_next) * sigma, std, std)


def cps_mse_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None = None
) -> StepCoefficients:
    """The CPS step scored as Flow-GRPO and FlowCPS score it: log_prob = -mean_elements((x_next - mean)^2),
    i.e. lp_scale = -1 and lp_const = 0 where std > 0 (no 1 / (2 std^2), no normaliser); same mean and noise.
    Its log-ratios are 2 std^2 times the Gaussian ones, so a clip range tuned for their code transfers."""
    c = cps_coefficients(sigma, sigma_next, noise_level, sigma_max)
    stochastic = (c.std > 0).to(c.std.dtype)
    return c._replace(lp_scale=-stochastic, lp_const=torch.zeros_like(c.std))


def eta_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None = None
) -> StepCoefficients:
    """The SDE step with a constant std_dev_t = kl_std = eta = ``noise_level``:
    c_x, c_v = the drift's (``_drift_coefficients``),  std = eta sqrt(sigma - sigma_next)"""
    dt = sigma_next - sigma
    std_dev_t = torch.full_like(sigma, noise_level)
    return _coefficients(*_drift_coefficients(sigma, dt, std_dev_t), std_dev_t * torch.sqrt(-dt), std_dev_t)


def linear_gaussian_step(
    coefficients: StepCoefficients,
    velocity: torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply per-sample ``coefficients`` ([B] each): draw ``prev_sample`` ~ N(mean, std^2) unless given and
    return (prev_sample in sample's dtype, log_prob [B] float32, mean float32, kl_std [B, 1, ...]).

    Four full-size passes (mean, noise, difference, dot product) and one draw; the per-sample work is
    already in ``coefficients``, so a step costs the same few kernels whatever the variant.
    """
    return shaped_step(flow_mean, shaped_coefficients(coefficients, sample), velocity, sample, prev_sample, generator)


def flow_mean(c: StepCoefficients, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """c_x x + c_v v in float32 (two kernels), on ``shaped_coefficients``."""
    return (sample.float() * c.c_x).addcmul_(velocity.float(), c.c_v)


def _step(coefficients_fn, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max):
    sigma = per_sample(sigma, sample).reshape(-1)
    sigma_next = per_sample(sigma_next, sample).reshape(-1)
    return linear_gaussian_step(
        coefficients_fn(sigma, sigma_next, noise_level, sigma_max), velocity, sample, prev_sample, generator
    )


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Euler-Maruyama step of the marginal-preserving reverse SDE (Flow-GRPO).

    With dt = sigma_next - sigma (< 0) and a = ``noise_level``:
        std_dev_t = a * sqrt(sigma / (1 - s)),  s = sigma, or s = sigma_max where sigma == 1
        mean      = x * (1 + std_dev_t^2 * dt / (2 sigma)) + v * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt
        x_next    = mean + std_dev_t * sqrt(-dt) * eps,  eps ~ N(0, I)
    Equivalently x + [v - std_dev_t^2 / 2 * score] dt with score = -(x + (1 - sigma) v) / sigma. With a = 0
    this is the deterministic Euler step x + v dt.

    Args:
        velocity: model output v, [B, ...].
        sample: current x at ``sigma``, [B, ...].
        sigma, sigma_next: per-sample noise levels, shape [B] (or scalars).
        noise_level: a, the SDE noise scale.
        prev_sample: if given, it is not drawn but scored: its log-prob under this step is returned
            (the re-evaluation used by the policy ratio).
        generator: for the draw of eps.
        sigma_max: the scheduler's sigmas[1]; used in place of sigma in (1 - s) where sigma == 1, which
            would otherwise divide by zero. Required when any sigma equals 1 and noise_level > 0.

    Returns:
        (prev_sample [B, ...] in sample's dtype, log_prob [B] float32, prev_sample_mean [B, ...] float32,
         std_dev_t [B, 1, ...] float32).
    """
    return _step(sde_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max)


def cps_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficient-preserving sampling (CPS) step.

        std = sigma_next * sin(a * pi / 2),  x0 = x - sigma v,  x1 = x + (1 - sigma) v
        mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1,  x_next = mean + std * eps
    The injected noise replaces part of the predicted noise, so the total noise coefficient stays
    sigma_next. Returns the same 4-tuple as ``sde_step_with_logprob``; the 4th item is ``std``.
    ``sigma_max`` is accepted for a common signature and not needed (nothing divides by 1 - sigma).
    """
    return _step(cps_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max)


def cps_mse_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cps_step_with_logprob`` with Flow-GRPO's CPS log-probability, -mean((x_next - mean)^2) (not a density;
    see ``cps_mse_coefficients``). The Gaussian "cps" stays the default: its log-ratios mean the same as
    every other kind's, so one clip range and KL weight hold across step kinds and noise levels."""
    return _step(
        cps_mse_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max
    )


def eta_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Constant-eta variant of the SDE step: the step's standard deviation is eta * sqrt(sigma - sigma_next).

    Written as ``sde_step_with_logprob`` with std_dev_t = eta, so that std_dev_t * sqrt(-dt) =
    eta * sqrt(sigma - sigma_next) and the drift keeps the marginal-preserving score correction.
    ``sigma_max`` is accepted for a common signature and not needed (nothing divides by 1 - sigma).
    """
    return _step(eta_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max)


STEP_FUNCTIONS = {
    "sde": sde_step_with_logprob,
    "cps": cps_step_with_logprob,
    "eta": eta_step_with_logprob,
    "cps_mse": cps_mse_step_with_logprob,
}
"""Registry of flow step functions, chosen by ``sampler.kind`` in the algorithm config."""

COEFFICIENTS = {
    "sde": sde_coefficients,
    "cps": cps_coefficients,
    "eta": eta_coefficients,
    "cps_mse": cps_mse_coefficients,
}
"""The same steps' constants, for ``scheduled_flow_step``."""


def scheduled_flow_step(
    kind: str, schedule: torch.Tensor, sigma_max: float | torch.Tensor | None = None
) -> ScheduledStep:
    """``STEP_FUNCTIONS[kind]`` bound to ``schedule``: index i steps sigma = t[i] -> sigma_next = t[i + 1]."""
    schedule, coefficients = schedule.to(torch.float32), COEFFICIENTS[kind]
    return ScheduledStep(
        lambda noise_level: coefficients(schedule[:-1], schedule[1:], noise_level, sigma_max), flow_mean
    )
