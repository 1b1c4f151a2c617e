"""Flow-matching arithmetic the flow adapters share: CFG's combination, the rectified-flow target and the
shifted schedules of FLUX, Qwen-Image and SD3."""

from __future__ import annotations

import torch


def cfg_combine(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """uncond + scale * (cond - uncond), in float32: one ``lerp`` (its backward two multiplies), where the
    written-out form runs three kernels forward and three backward. Rounding differs from the pipelines'
    written-out form by an ulp or so of the result."""
    return torch.lerp(uncond.float(), cond.float(), scale)


def inpaint_velocity(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor,
    known: torch.Tensor,
    mask: torch.Tensor,
    noise: torch.Tensor | None = None,
    schedule: torch.Tensor | None = None,
) -> torch.Tensor:
    """The velocity that reproduces an inpainting pipeline's blend after each step, x' <- (1 - m) k(sigma') +
    m x', with k(s) = s noise + (1 - s) known and a mask m in [0, 1] (1 = repaint): m v + (1 - m) u, where u
    is the Euler step from x to k(sigma'). So a rollout at noise level 0 equals the pipeline, and where m = 0
    the velocity does not depend on the policy (no gradient, ratio 1).

    sigma' is the step after sigma on the trajectory's ``schedule`` [B, T + 1] (which ``noise``, its initial
    latents, starts); a sigma not on it (a supervised target's) or no trajectory takes sigma' = 0, where u =
    (x - known) / sigma, the velocity whose clean estimate is ``known``."""
    x, s = x.float(), sigma.float().reshape(-1, *([1] * (x.ndim - 1)))
    if noise is None or schedule is None:
        target, s_next = known, torch.zeros_like(s)
    else:
        on_step = schedule[:, :-1] == sigma.float()[:, None]  # [B, T]; no step matches off the schedule
        s_next = (schedule[:, 1:] * on_step).sum(1).reshape(s.shape)
        target = s_next * noise.float() + (1 - s_next) * known
    m = mask.to(v.dtype)
    return m * v + (1 - m) * ((target - x) / (s_next - s))


def rectified_flow_target(
    x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x_sigma = (1 - sigma) x0 + sigma noise and the velocity target noise - x0 (flow models)."""
    s = sigma.float().reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise, noise - x0


def dynamic_shift_mu(scheduler, image_seq_len: int, default_max_shift: float = 1.15) -> float:
    """The pipelines' mu = calculate_shift(image_seq_len) from the scheduler's config, where a key it lacks
    takes the pipeline's default (max_shift: 1.15 for FLUX and Qwen-Image, 1.16 for SD3)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", default_max_shift),
    )


def shifted_flow_sigmas(
    scheduler, num_steps: int, image_seq_len: int, device: torch.device, base: list[float] | None = None
) -> torch.Tensor:
    """FLUX / Qwen-Image schedule, set as their pipelines set it: sigmas linspace(1, 1/T, T) (or ``base``, a
    checkpoint's own grid of T sigmas) shifted by mu = calculate_shift(image_seq_len) under the scheduler's dynamic
    shifting; returns sigmas[0..T]."""
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

    retrieve_timesteps(
        scheduler,
        num_steps,
        device,
        sigmas=np.linspace(1.0, 1 / num_steps, num_steps) if base is None else base,
        mu=dynamic_shift_mu(scheduler, image_seq_len),
    )
    return scheduler.sigmas.to(torch.float32)
