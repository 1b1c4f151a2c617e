"""Deterministic steps after a rollout's SDE window (MixGRPO-Flash): a second-order multistep ODE solver and a
compressed schedule. They record no log-probability: only the window's steps are ever trained.

Flow matching is the diffusion x_sigma = alpha x0 + sigma eps with alpha = 1 - sigma, so DPM-Solver++ applies with
lambda = log(alpha / sigma) and the data prediction x0 = x - sigma v. Pure functions; float32 arithmetic.
"""

from __future__ import annotations

import torch


def dpm_solver_2m_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    prev_x0: torch.Tensor | None,
    sigma_prev: float,
    sigma: float,
    sigma_next: float,
) -> torch.Tensor:
    """One DPM-Solver++(2M) step (multistep, midpoint form, as diffusers' ``dpmsolver++``) from ``sigma`` to
    ``sigma_next``, with ``prev_x0`` the data prediction made at ``sigma_prev`` (the step before):
        x0 = x - sigma v,  h = lambda(sigma_next) - lambda(sigma),  r = (lambda(sigma) - lambda(sigma_prev)) / h
        D  = x0 + (x0 - prev_x0) / (2 r)
        x_next = (sigma_next / sigma) x + (1 - sigma_next) (1 - exp(-h)) D
    With D = x0 (no ``prev_x0``, or sigma_next = 0 where h is infinite: first order) it is the Euler step
    x + (sigma_next - sigma) v. Returns x_next in ``sample``'s dtype."""
    x, v = sample.float(), velocity.float()
    x0 = x - sigma * v
    if sigma_next == 0 or prev_x0 is None or sigma_prev >= 1:  # first order: lambda is infinite at 0 and 1
        return (x + (sigma_next - sigma) * v).to(sample.dtype)
    lam = lambda s: torch.log(torch.tensor((1 - s) / s, dtype=torch.float64))  # noqa: E731
    h = lam(sigma_next) - lam(sigma)
    r = float((lam(sigma) - lam(sigma_prev)) / h)
    d = x0 + (x0 - prev_x0.float()) / (2 * r)
    return (sigma_next / sigma * x + (1 - sigma_next) * float(-torch.expm1(-h)) * d).to(sample.dtype)


def compress_after_window(
    sigmas: torch.Tensor, stochastic: torch.Tensor, ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule t[0..T] with its n ODE steps after the last stochastic step cut to max(1, round(ratio n)),
    keeping those of the model's own noise levels that lie nearest to evenly spaced step indices (the window and
    every step before it are unchanged, so trained steps keep their kernels). Returns (sigmas, stochastic)."""
    if ratio >= 1 or not bool(stochastic.any()):
        return sigmas, stochastic
    end = int(torch.nonzero(stochastic).max()) + 1  # the first step after the window
    steps = len(stochastic) - end
    keep = max(1, round(ratio * steps))
    picked = torch.round(torch.linspace(0, steps, keep + 1, dtype=torch.float64)).long() + end
    sigmas = torch.cat([sigmas[:end], sigmas[picked.to(sigmas.device)]])
    return sigmas, torch.cat([stochastic[:end], torch.zeros(keep, dtype=torch.bool)])


def second_order_steps(stochastic: torch.Tensor, order: int) -> torch.Tensor:
    """[T] bool: the steps that take ``dpm_solver_2m_step`` at ``order`` 2: after the last stochastic step (every
    step where none is: the first one is then first order, having no history), but not the final step (first
    order there, as DPM-Solver++ does: its h is infinite at sigma = 0)."""
    multistep = torch.zeros_like(stochastic)
    if order == 2:
        start = int(torch.nonzero(stochastic).max()) + 1 if bool(stochastic.any()) else 0
        multistep[start:-1] = True
    return multistep
