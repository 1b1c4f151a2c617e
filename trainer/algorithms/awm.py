"""AWM (Advantage Weighted Matching): the flow-matching loss on the policy's own clean samples, weighted by
their advantages, in PPO's clipped form.

Each clean sample x0 of a rollout (any sampler: the deterministic one by default) gets a group-relative
advantage A. At a random noise level sigma with noise eps, x_sigma and the target v come from the forward
process (``adapter.training_target``: v = eps - x0 for flow models), and the weighted matching loss stands
in for the log-likelihood of x0:
    log p_theta(x0) ~ -w(sigma) mean((v_theta(x_sigma, sigma, c) - v)^2),    w = 1 or sigma
    ratio = exp(log p_theta - log p_old),  L = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))
with p_old the sampling policy (the reference, copied from the policy before each epoch's rollout). On
policy the gradient is A w(sigma) grad mean((v_theta - v)^2): pretraining's loss, weighted by advantages.
Until the first optimizer step on a batch, v_old is v_theta itself, detached: the ratio is 1 exactly (no-grad
and grad compiled graphs round apart) and no reference is run; at one optimizer step per batch (the default)
none is kept either.
Departures from the paper: noise levels are logit-normal like the supervised loss; no KL term to a
reference or EMA policy (the clip against the sampling policy bounds an epoch's move); samples with a
failed reward get weight 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from trainer.algorithms.advantages import clipped_policy_loss, group_advantages
from trainer.algorithms.base import LossContext, NoExtras, Rewards, mark_on_policy, refresh_reference
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    per_sample_mse,
    policy_and_reference,
    policy_prediction,
    weighted_plan,
)
from trainer.config.fields import Bounds
from trainer.rollout import Rollout


def awm_loss(v_theta: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, advantages: torch.Tensor,
             time_weight: torch.Tensor, clip_range: float,
             weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss on matching log-likelihoods log p = -w mean((v - target)^2) per sample ([B]
    each: ``advantages``, ``time_weight`` w, ``weights`` 0 for samples left out); returns (loss, stats)."""
    log_prob = -time_weight * per_sample_mse(v_theta, target)
    old_log_prob = -time_weight * per_sample_mse(v_old, target)
    return clipped_policy_loss(advantages, log_prob, old_log_prob, clip_range, weights)


@dataclass
class AWMConfig(CleanSampleConfig):
    """AWM hyper-parameters (the shared fields: ``CleanSampleConfig``)."""

    name: str = "awm"
    clip_range: Annotated[float, Bounds(0, math.inf, low_open=True)] = 1e-3
    """PPO ratio clip eps on the matching log-likelihood ratio (inf: no clipping)."""
    adv_clip: Annotated[float, Bounds(0, math.inf, low_open=True)] = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip]."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's."""
    time_weighting: Literal["uniform", "sigma"] = "uniform"
    """w(sigma) in the matching log-likelihood: 1, or sigma (weights noisier levels more)."""


@dataclass
class AWMBatch:
    rollout: Rollout
    advantages: torch.Tensor  # [B] this rank's samples
    weights: torch.Tensor     # [B] 0 where the reward failed
    rewards: Rewards
    plans: int = 0            # plans made of this batch: the first one's first optimizer step is on policy


class AWM(NoExtras):
    """Advantage weighted matching on clean rollout samples."""

    config_class = AWMConfig
    shown_metrics = ("matching_loss", "clip_frac")

    def __init__(self, config: AWMConfig):
        super().__init__(config)
        self.needs_reference = config.inner_epochs > 1 or config.steps_per_epoch > 1  # steps after the first

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        if self.needs_reference:
            refresh_reference(ctx)  # p_old: the policy that samples this epoch

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> AWMBatch:
        adv = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std, self.config.adv_clip)
        mine = slice(rewards.offset, rewards.offset + len(rewards.local))
        return AWMBatch(rollout, adv[mine], (~torch.isnan(rewards.local)).float(), rewards)

    def plan(self, batch: AWMBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """The batch's clean samples, weighted by reward (``clean_sample.weighted_plan``)."""
        return mark_on_policy(batch, weighted_plan(batch, self.config, generator))

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, idx, draw = unit.batch, unit.rows, unit.draw
        if unit.on_policy:
            target, v_theta = policy_prediction(ctx, unit)
            v_old = v_theta.detach()
        else:
            target, v_theta, v_old = policy_and_reference(ctx, unit)
        time_weight = draw.sigma.float() if self.config.time_weighting == "sigma" else torch.ones_like(draw.sigma)
        weights = batch.weights[idx].to(v_theta.device)  # host-side rewards
        loss, stats = awm_loss(v_theta, v_old, target, batch.advantages[idx].to(v_theta.device),
                               time_weight.to(v_theta.device), self.config.clip_range, weights)
        with torch.no_grad():
            stats["matching_loss"] = (per_sample_mse(v_theta, target) * weights).sum() / weights.sum().clamp_min(1.0)
        return loss * unit.share, stats

    def batch_metrics(self, batch: AWMBatch) -> dict[str, float]:
        adv = batch.advantages
        return {"adv_abs_mean": float(adv.abs().mean()), "adv_max": float(adv.abs().max())}
