"""DGPO (Direct Group Preference Optimization): DPO between the better and the worse part of each group of
the policy's own clean samples. No stochastic policy is needed, so rollouts may be deterministic (ODE).

A group of G samples of one prompt gets group-relative advantages A_i. With the denoising losses
l(x_i) = mean((model(x_sigma, sigma, c) - target)^2) at a noise level and noise shared by the group, and
the implicit reward r_i = -beta (l_theta(x_i) - l_ref(x_i)), the group-level Bradley-Terry preference of
G+ (A > 0) over G- (A < 0), each sample weighted by |A_i| / G, has the log-likelihood
    log sigmoid(sum_i A_i r_i / G),   so   L_g = -log sigmoid(-beta / G sum_i A_i (l_theta(x_i) - l_ref(x_i)))
averaged over groups. Its gradient, sigmoid(beta / G sum_i A_i delta_i) beta / G sum_i A_i grad l_theta(x_i),
is an advantage-weighted denoising loss whose weight fades once the policy prefers the group's better part
more than the reference does (0.5 at the reference). Departures from the paper: the reference is the policy
as RL starts, or a copy of the policy every ``ref_refresh_every`` epochs; no PPO-style clip of the
denoising loss and no KL term (both in the authors' code); logit-normal noise levels (theirs: the
sampler's timesteps); a group's samples share a micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F

from trainer.algorithms.advantages import group_advantages
from trainer.algorithms.base import LossContext, NoExtras, Rewards, refresh_reference, set_shares
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    draw_units,
    per_sample_mse,
    split_units,
)
from trainer.config.fields import Bounds, NonNegativeInt, PositiveFloat
from trainer.rollout import Rollout


def dgpo_loss(loss_theta: torch.Tensor, loss_ref: torch.Tensor, advantages: torch.Tensor,
              beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ([M, G] inputs: M groups of G samples): L_g = -log sigmoid(-s_g) = softplus(s_g) with
    s_g = beta / G sum_i A_i (l_theta_i - l_ref_i). Returns (L [M], the preference weight sigmoid(s) [M])."""
    s = beta / loss_theta.shape[1] * (advantages * (loss_theta - loss_ref)).sum(dim=1)
    return F.softplus(s), torch.sigmoid(s.detach())


@dataclass
class DGPOConfig(CleanSampleConfig):
    """DGPO hyper-parameters (the shared fields: ``CleanSampleConfig``; ``micro_batch_size`` is rounded down
    to whole groups, at least one)."""

    name: str = "dgpo"
    beta: PositiveFloat = 100.0
    """DPO's inverse temperature on the group's advantage-weighted denoising-loss gap."""
    adv_clip: Annotated[float, Bounds(0, math.inf, low_open=True)] = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip]."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's."""
    ref_refresh_every: NonNegativeInt = 0
    """Copy the policy into the reference every N RL epochs; 0 keeps the reference made as RL starts."""


@dataclass
class DGPOBatch:
    rollout: Rollout
    groups: torch.Tensor      # [M, G] local sample indices of this rank's groups
    advantages: torch.Tensor  # [B] this rank's samples
    weights: torch.Tensor     # [M] 1 where a group has a reward, 0 where all of its rewards failed
    rewards: Rewards


class DGPO(NoExtras):
    """Direct group preference optimisation on clean rollout samples."""

    config_class = DGPOConfig
    needs_reference = True
    local_groups = True
    shown_metrics = ("dgpo_loss",)

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        every = self.config.ref_refresh_every
        if ctx.reference is None or (every and epoch % every == 0):  # none: RL not started by Trainer.fit
            refresh_reference(ctx)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> DGPOBatch:
        adv = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std, self.config.adv_clip)
        mine = slice(rewards.offset, rewards.offset + len(rewards.local))
        ids = rewards.group_ids_all[mine]
        groups = torch.stack([torch.nonzero(ids == g).flatten() for g in torch.unique(ids)])
        valid = ~torch.isnan(rewards.local)
        return DGPOBatch(rollout, groups, adv[mine], valid[groups].any(dim=1).float(), rewards)

    def plan(self, batch: DGPOBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """Every group under each of ``noise_draws`` draws (one noise level and noise per group), in shuffled
        micro-batches of whole groups, cut into ``steps_per_epoch`` optimizer steps; a step's loss is the mean
        over its groups."""
        per_unit = max(1, self.config.micro_batch_size // self.config.group_size)
        units = draw_units(batch.rollout.latents[batch.groups[:, 0], -1], self.config, generator, per_unit,
                           lambda rows, draw: CleanUnit(batch, rows, draw))
        return set_shares(split_units(units, self.config.steps_per_epoch),
                          lambda unit: float(batch.weights[unit.rows].sum()))

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, rows, draw = unit.batch, unit.rows, unit.draw
        ro = batch.rollout
        m, g = len(rows), batch.groups.shape[1]
        samples = batch.groups[rows].reshape(-1)
        sigma, noise = draw.sigma.repeat_interleave(g), draw.noise.repeat_interleave(g, dim=0)
        x_t, target = ctx.adapter.training_target(ro.latents[samples, -1], noise, sigma)
        cond = ro.cond.select(samples)
        policy = per_sample_mse(ctx.adapter.predict(ctx.policy, x_t, sigma, cond, 1.0), target)
        with torch.no_grad():
            ref = per_sample_mse(ctx.adapter.predict(ctx.reference, x_t, sigma, cond, 1.0), target)
        adv = batch.advantages[samples].to(policy.device).reshape(m, g)  # host-side rewards
        per_group, preference = dgpo_loss(policy.reshape(m, g), ref.reshape(m, g), adv, self.config.beta)
        w = batch.weights[rows].to(per_group.device)
        loss = (per_group * w).sum() / w.sum().clamp_min(1.0)
        stats = {"dgpo_loss": loss.detach(), "dgpo_weight": (preference * w).sum() / w.sum().clamp_min(1.0),
                 "denoise_loss": policy.detach().mean()}
        return loss * unit.share, stats

    def batch_metrics(self, batch: DGPOBatch) -> dict[str, float]:
        return {"adv_abs_mean": float(batch.advantages.abs().mean()), "groups": float(len(batch.groups))}
