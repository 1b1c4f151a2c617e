"""GRPO-Guard: GRPO whose importance ratio is normalised per denoising step and whose per-step loss is
reweighted by 1 / |dt| (regulated clipping).

With the step's Gaussian x_{t+1} = mu_old + s_t eps under the sampling policy, the Flow-GRPO log-ratio is
    log r = -mean((mu_theta - mu_old)^2) / (2 s_t^2) - mean(eps (mu_old - mu_theta)) / s_t:
its mean is shifted below 0 and its spread grows as 1 / s_t, so the clip misses positive-advantage samples.
Ratio normalisation uses instead
    log r~ = s_t (log p_theta - log p_old) + mean((mu_theta - mu_old)^2) / (2 s_t) = mean(eps (mu_theta - mu_old))
(zero mean, one scale at every step). Its gradient mean(eps d mu_theta) still carries the step's d mu / d v,
proportional to dt (on SD3's shift-3 schedule the last trained step's is 5x the first's), so the gradient
reweighting divides each step's loss by -dt = t_i - t_{i+1}:
    L = mean over (sample, step) of max(-A r~, -A clamp(r~, 1 - eps, 1 + eps)) / (-dt) + beta KL
(``reweight``; false: no reweighting, as Flow-Factory's implementation).
Departures from the paper (no code of its authors is public; verl-omni's and Flow-Factory's implement it):
r~ is computed from the old policy's step means (the rollout records them; ``step_loss`` replaces them with the
training forward's own while the weights are the rollout's) and the step's own std, so it holds for every
Gaussian step kind and log-prob convention (both implementations scale by std_dev_t sqrt(-dt), wrong on CPS
steps); docs/departures.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import LossContext
from trainer.algorithms.core_algos import guard_log_ratio, guard_step_weight
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.algorithms.policy_gradient import StepUnit, step_loss


@dataclass
class GRPOGuardConfig(GRPOConfig):
    """GRPO-Guard hyper-parameters: GRPO's; ``clip_range`` bounds the normalised ratio r~."""

    name: str = "grpo_guard"
    reweight: bool = True
    """Divide each step's policy loss by its -dt (the paper's gradient reweighting, verl-omni's); false: no
    reweighting (Flow-Factory's), where a step's gradient grows with its dt."""


class GRPOGuard(GRPO):
    """GRPO with the per-step normalised importance ratio and the 1 / |dt| step reweighting."""

    config_class = GRPOGuardConfig
    records_means = True

    def loss(self, ctx: LossContext, unit: StepUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weight = guard_step_weight if self.config.reweight else None
        loss, stats = step_loss(ctx, unit, self.config, guard_log_ratio, weight)
        return loss * unit.share, stats
