"""DDIM reverse step with log-probability for epsilon-prediction models (the DDPO formulation).

A DDIM step with eta > 0 is Gaussian: with abar_t = alphas_cumprod[t], abar_prev = alphas_cumprod[t_prev]
(``final_alpha_cumprod`` where t_prev < 0, as diffusers' DDIMScheduler does):
    x0_hat   = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)
    sigma_t  = eta * sqrt((1 - abar_prev) / (1 - abar_t) * (1 - abar_t / abar_prev))
    mean     = sqrt(abar_prev) x0_hat + sqrt(1 - abar_prev - sigma_t^2) eps
    x_prev   = mean + sigma_t z,  z ~ N(0, I)
The log-probability is the per-element Gaussian log-density averaged over non-batch dimensions, as in
``flow_sde``. With eta = 0 the step is diffusers' ``DDIMScheduler.step`` (eta 0) bit for bit: the per-step
constants (sqrt(1 - abar_t), sqrt(abar_t), sqrt(abar_prev), the direction's coefficient, sigma_t) are
computed as the scheduler computes them, and the full-size arithmetic runs in the scheduler's order, in
float32 whatever the input dtype. ``ddim_step`` binds the step to a schedule with those constants
precomputed for every step, as ``flow_step`` does for the flow steps. Departure from DDPO's
``ddim_step_with_logprob``: its clamp of t_prev makes the last step read alphas_cumprod[0] where we read
``final_alpha_cumprod`` (the same for SD1.5, whose scheduler does not set alpha to one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from trainer.samplers.steps import ScheduledStep, log_prob_constants, shaped_coefficients, shaped_step


class DDIMCoefficients(NamedTuple):
    """The constants of a DDIM step, per sample or per step of a schedule ([N] each):

        x0_hat = (x - sqrt_beta eps) / sqrt_alpha,   mean = sqrt_alpha_prev x0_hat + direction eps,
        x_prev = mean + std z,   log_prob = lp_scale * mean_elements((x_prev - mean)^2) + lp_const

    with sqrt_beta = sqrt(1 - abar_t), sqrt_alpha = sqrt(abar_t), sqrt_alpha_prev = sqrt(abar_prev),
    direction = sqrt(1 - abar_prev - std^2), std = sigma_t, and kl_std = sigma_t, what the KL divides by
    (``log_prob_constants`` for lp_*).
    """

    sqrt_beta: torch.Tensor
    sqrt_alpha: torch.Tensor
    sqrt_alpha_prev: torch.Tensor
    direction: torch.Tensor
    std: torch.Tensor
    kl_std: torch.Tensor
    lp_scale: torch.Tensor
    lp_const: torch.Tensor


def ddim_coefficients(
    t: torch.Tensor,
    t_prev: torch.Tensor,
    eta: float,
    alphas_cumprod: torch.Tensor,
    final_alpha_cumprod: float | torch.Tensor = 1.0,
) -> DDIMCoefficients:
    """``ddim_step_with_logprob``'s constants from timestep ``t`` to ``t_prev`` ([N] each, or scalars), each
    computed as ``DDIMScheduler.step`` computes it (``DDIMCoefficients`` has the formulas), with
        std = kl_std = sigma_t = eta sqrt((1 - abar_prev) / (1 - abar_t) (1 - abar_t / abar_prev))"""
    _check_eta(eta)
    alpha_t, alpha_prev = _alphas_cumprod_at(t, t_prev, alphas_cumprod, final_alpha_cumprod)
    beta_t = 1 - alpha_t
    beta_prev = 1 - alpha_prev
    std_dev_t = eta * ((beta_prev / beta_t) * (1 - alpha_t / alpha_prev)) ** (0.5)
    return DDIMCoefficients(
        beta_t ** (0.5),
        alpha_t ** (0.5),
        alpha_prev ** (0.5),
        (1 - alpha_prev - std_dev_t**2) ** (0.5),
        std_dev_t,
        std_dev_t,
        *log_prob_constants(std_dev_t),
    )


def _check_eta(eta: float) -> None:
    if not 0 <= eta <= 1:
        raise ValueError(
            f"algorithm.sampler.noise_level={eta}: with sampler.kind=ddim the noise level is DDIM's eta, "
            "which must be in [0, 1] (above 1 the step's variance exceeds 1 - abar_prev and the samples "
            "are NaN); set it to at most 1"
        )


def _alphas_cumprod_at(
    t: torch.Tensor, t_prev: torch.Tensor, alphas_cumprod: torch.Tensor, final_alpha_cumprod: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(abar_t, abar_prev) in float32: abar at the rounded timesteps, ``final_alpha_cumprod`` where t_prev < 0."""
    alphas_cumprod = alphas_cumprod.to(dtype=torch.float32)
    t = torch.as_tensor(t, device=alphas_cumprod.device).round().long()
    t_prev = torch.as_tensor(t_prev, device=alphas_cumprod.device).round().long()
    final = torch.as_tensor(final_alpha_cumprod, device=alphas_cumprod.device, dtype=torch.float32)
    return alphas_cumprod[t], torch.where(t_prev >= 0, alphas_cumprod[t_prev.clamp(min=0)], final)


def ddim_mean(c: DDIMCoefficients, eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """The step's mean on ``shaped_coefficients``: six full-size kernels in the scheduler's order (no fused
    multiply-add), so that eta = 0 stays bit for bit the scheduler's step."""
    x, eps = sample.float(), eps.float()
    x0 = (x - c.sqrt_beta * eps) / c.sqrt_alpha
    return c.sqrt_alpha_prev * x0 + c.direction * eps


def ddim_step_with_logprob(
    eps: torch.Tensor,
    sample: torch.Tensor,
    t: torch.Tensor,
    t_prev: torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    alphas_cumprod: torch.Tensor,
    final_alpha_cumprod: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DDIM step from integer timestep ``t`` to ``t_prev`` (per sample [B] or scalars).

    Args:
        eps: the model's noise prediction, [B, ...].
        sample: x_t, [B, ...].
        t, t_prev: training timesteps (indices into ``alphas_cumprod``); ``t_prev < 0`` means the end of
            the chain, where ``final_alpha_cumprod`` is used.
        eta: DDIM's eta, in [0, 1]; 0 is the deterministic DDIM step.
        prev_sample: if given, it is scored instead of drawn (the policy-ratio re-evaluation).
        generator: for the draw of z.
        alphas_cumprod: the scheduler's cumulative alphas [N], float32.
        final_alpha_cumprod: abar used for t_prev < 0 (1.0 with ``set_alpha_to_one``, else abar_0).

    Returns:
        (prev_sample in sample's dtype, log_prob [B] float32, prev_sample_mean float32,
         sigma_t [B, 1, ...] float32).
    """
    coefficients = ddim_coefficients(t, t_prev, eta, alphas_cumprod.to(sample.device), final_alpha_cumprod)
    return shaped_step(ddim_mean, shaped_coefficients(coefficients, sample), eps, sample, prev_sample, generator)


def ddim_step(
    timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, final_alpha_cumprod: float | torch.Tensor = 1.0
) -> ScheduledStep:
    """``ddim_step_with_logprob`` bound to training timesteps t[0..T] (t[T]: the end of the chain), called
    with step indices and eta as the noise level: index i steps t[i] -> t[i] - N // T, N = len(alphas_cumprod)
    (num_train_timesteps), as ``DDIMScheduler.step`` does. That is t[i + 1] only for "leading" timestep
    spacing; with "trailing" or "linspace" the scheduler's step lands elsewhere, and so does this one."""
    alphas_cumprod = alphas_cumprod.to(device=timesteps.device, dtype=torch.float32)
    t = timesteps[:-1]
    t_prev = t - alphas_cumprod.shape[0] // t.shape[0]
    return ScheduledStep(lambda eta: ddim_coefficients(t, t_prev, eta, alphas_cumprod, final_alpha_cumprod), ddim_mean)
