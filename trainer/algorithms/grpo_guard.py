"""GRPO-Guard: GRPO whose importance ratio is normalised per denoising step (regulated clipping).

With the step's Gaussian x_{t+1} = mu_old + s_t eps under the sampling policy, the Flow-GRPO log-ratio is
    log r = -mean((mu_theta - mu_old)^2) / (2 s_t^2) - mean(eps (mu_old - mu_theta)) / s_t:
its mean is shifted below 0 and its spread grows as 1 / s_t, so the clip misses positive-advantage samples
and late steps dominate. GRPO-Guard uses instead
    log r~ = s_t (log p_theta - log p_old) + mean((mu_theta - mu_old)^2) / (2 s_t) = mean(eps (mu_theta - mu_old))
(ratio normalisation: zero mean, one scale at every step), and its gradient mean(eps d mu_theta) is the
plain one times s_t (the timestep gradient reweighting); the loss is GRPO's clipped one on r~.
Departures from the paper: both parts are this one formula (as in Flow-Factory's implementation), computed
from the old policy's step means (the rollout records them; ``step_loss`` replaces them with the training
forward's own while the weights are the rollout's), so it holds for every Gaussian step kind and log-prob convention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import LossContext
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.algorithms.policy_gradient import StepUnit, step_loss


def guard_log_ratio(x_next: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log r~ = mean over elements of eps (mean - old_mean), eps = (x_next - old_mean) / std, per sample [B]
    (std: [B] or [B, 1, ...]); equal to s (log p - log p_old) + mean((mean - old_mean)^2) / (2 s) for the
    Gaussian log-densities."""
    std = std.reshape(-1, *[1] * (x_next.ndim - 1))
    eps = (x_next.float() - old_mean.float()) / std
    return (eps * (mean.float() - old_mean.float())).mean(dim=tuple(range(1, x_next.ndim)))


@dataclass
class GRPOGuardConfig(GRPOConfig):
    """GRPO-Guard hyper-parameters: GRPO's; ``clip_range`` bounds the normalised ratio r~."""

    name: str = "grpo_guard"


class GRPOGuard(GRPO):
    """GRPO with the per-step normalised (and so reweighted) importance ratio."""

    config_class = GRPOGuardConfig
    records_means = True

    def loss(self, ctx: LossContext, unit: StepUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = step_loss(ctx, unit, self.config, guard_log_ratio)
        return loss * unit.share, stats
