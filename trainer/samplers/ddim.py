"""DDIM reverse step with log-probability for epsilon-prediction models (the DDPO formulation).

A DDIM step with eta > 0 is Gaussian: with abar_t = alphas_cumprod[t], abar_prev = alphas_cumprod[t_prev]
(``final_alpha_cumprod`` where t_prev < 0, as diffusers' DDIMScheduler does):
    x0_hat   = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t)
    sigma_t  = eta * sqrt((1 - abar_prev) / (1 - abar_t) * (1 - abar_t / abar_prev))
    mean     = sqrt(abar_prev) x0_hat + sqrt(1 - abar_prev - sigma_t^2) eps
    x_prev   = mean + sigma_t z,  z ~ N(0, I)
The log-probability is the per-element Gaussian log-density averaged over non-batch dimensions, as in
``flow_sde``. With eta = 0 the step is diffusers' ``DDIMScheduler.step`` (eta 0) bit for bit: the
arithmetic is written in the scheduler's order, in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from trainer.samplers.flow_sde import _finish_step, _per_sample


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
        eta: DDIM's eta; 0 is the deterministic DDIM step.
        prev_sample: if given, it is scored instead of drawn (the policy-ratio re-evaluation).
        generator: for the draw of z.
        alphas_cumprod: the scheduler's cumulative alphas [N], float32.
        final_alpha_cumprod: abar used for t_prev < 0 (1.0 with ``set_alpha_to_one``, else abar_0).

    Returns:
        (prev_sample in sample's dtype, log_prob [B] float32, prev_sample_mean float32,
         sigma_t [B, 1, ...] float32).
    """
    x = sample.float()
    eps = eps.float()
    alphas_cumprod = alphas_cumprod.to(device=x.device, dtype=torch.float32)
    t = torch.as_tensor(t, device=x.device).round().long()
    t_prev = torch.as_tensor(t_prev, device=x.device).round().long()
    alpha_t = _per_sample(alphas_cumprod[t], x)
    final = torch.as_tensor(final_alpha_cumprod, device=x.device, dtype=torch.float32)
    alpha_prev = _per_sample(torch.where(t_prev >= 0, alphas_cumprod[t_prev.clamp(min=0)], final), x)
    beta_t = 1 - alpha_t
    beta_prev = 1 - alpha_prev

    x0 = (x - beta_t ** (0.5) * eps) / alpha_t ** (0.5)
    variance = (beta_prev / beta_t) * (1 - alpha_t / alpha_prev)
    std_dev_t = eta * variance ** (0.5)
    mean = alpha_prev ** (0.5) * x0 + (1 - alpha_prev - std_dev_t**2) ** (0.5) * eps
    prev_sample, log_prob = _finish_step(mean, std_dev_t, sample, prev_sample, generator)
    return prev_sample, log_prob, mean, std_dev_t
