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

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample [B] tensor over the non-batch dims of ``like``, in float32."""
    value = torch.as_tensor(value, device=like.device, dtype=torch.float32)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over non-batch dims of log N(x; mean, std^2), elementwise density, for a per-sample ``std``
    ([B, 1, ...] or a scalar); returns [B] float32. With n elements per sample and d = x - mean:

        log_prob = -(d . d) / (n 2 std^2) - log std - log sqrt(2 pi)

    the average of the elementwise log-densities with the per-sample terms taken out of the mean, so that
    the elements are read twice (difference, dot product) rather than once per term.
    Where ``std`` is 0 (a deterministic step) the density is a point mass and no log-prob exists: 0 is
    returned for those samples, and such steps must not be trained on (the trainers never select them).
    """
    b = x.shape[0]
    std = torch.broadcast_to(torch.as_tensor(std, device=x.device, dtype=torch.float32),
                             (b,) + (1,) * (x.ndim - 1)).reshape(b)
    d = (x.float() - mean).reshape(b, 1, -1)
    squares = torch.bmm(d, d.transpose(1, 2)).reshape(b) / d.shape[-1]
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    log_prob = -squares / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    return torch.where(std > 0, log_prob, torch.zeros_like(log_prob))


def _finish_step(
    mean: torch.Tensor,
    scale: torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``prev_sample`` ~ N(mean, scale^2) unless given, and return it with its log-prob."""
    if prev_sample is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        prev_sample = noise.mul_(scale).add_(mean).to(sample.dtype)  # in place: no second full-size buffer
    return prev_sample, gaussian_log_prob(prev_sample, mean, scale)


def _drift(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, dt: torch.Tensor,
           std_dev_t: torch.Tensor) -> torch.Tensor:
    """x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt, with the
    per-sample coefficients formed first (at std_dev_t = 0 this is x + v dt, bit for bit diffusers' Euler step)."""
    return (x * (1 + std_dev_t**2 / (2 * sigma) * dt)).addcmul_(v, (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)


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
    x = sample.float()
    v = velocity.float()
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    dt = sigma_next - sigma

    if sigma_max is None:
        if noise_level > 0 and bool((sigma == 1).any()):
            raise ValueError("sde_step_with_logprob: sigma == 1 needs sigma_max (the scheduler's sigmas[1])")
        s = sigma
    else:
        s = torch.where(sigma == 1, _per_sample(sigma_max, x), sigma)
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - s))

    mean = _drift(x, v, sigma, dt, std_dev_t)
    prev_sample, log_prob = _finish_step(mean, std_dev_t * torch.sqrt(-dt), sample, prev_sample, generator)
    return prev_sample, log_prob, mean, std_dev_t


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
    x = sample.float()
    v = velocity.float()
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = (1 - sigma_next) * x0 + torch.sqrt((sigma_next**2 - std**2).clamp_min(0)) * x1
    prev_sample, log_prob = _finish_step(mean, std, sample, prev_sample, generator)
    return prev_sample, log_prob, mean, std


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
    x = sample.float()
    v = velocity.float()
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    dt = sigma_next - sigma
    std_dev_t = torch.full_like(sigma, noise_level)
    mean = _drift(x, v, sigma, dt, std_dev_t)
    prev_sample, log_prob = _finish_step(mean, std_dev_t * torch.sqrt(-dt), sample, prev_sample, generator)
    return prev_sample, log_prob, mean, std_dev_t


STEP_FUNCTIONS = {
    "sde": sde_step_with_logprob,
    "cps": cps_step_with_logprob,
    "eta": eta_step_with_logprob,
}
"""Registry of flow step functions, chosen by ``sampler.kind`` in the algorithm config."""
