"""Online DPO: Diffusion-DPO on preference pairs from the policy's own samples, against a reference that
is refreshed from the policy every ``ref_refresh_every`` RL epochs.

From each group of ``group_size`` samples of one prompt the best and the worst (by reward) form a pair
(w, l). With the denoising loss l(theta, x) = ||model_theta(x_sigma, sigma, c) - target||^2 (mean over
elements) at a noise level and noise shared by the two samples of a pair:
    L = -log sigmoid(-beta/2 [(l_theta(w) - l_ref(w)) - (l_theta(l) - l_ref(l))])
The clean sample x of a rollout is its final latent. Departures from Diffusion-DPO (offline, fixed
reference): pairs are on-policy and the reference moves ("online"); groups whose rewards do not differ
give no pair; noise levels are logit-normal like the supervised loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import (
    AlgorithmDefaults,
    LossContext,
    Rewards,
    balanced_local,
    refresh_reference,
    set_shares,
)
from trainer.algorithms.clean_sample import CleanSampleConfig, NoiseDraws, split_units
from trainer.algorithms.core_algos import best_and_worst, diffusion_dpo_loss, per_sample_mse, weighted_mean
from trainer.config.fields import PositiveFloat, PositiveInt
from trainer.rollout import Rollout


@dataclass
class DPOConfig(CleanSampleConfig):
    """Online DPO hyper-parameters (the shared fields: ``CleanSampleConfig``)."""

    name: str = "dpo"
    micro_batch_size: PositiveInt = 16
    beta: PositiveFloat = 500.0
    """Strength of the preference (inverse temperature); large because denoising-loss differences are small."""
    ref_refresh_every: PositiveInt = 1
    """Copy the policy into the reference every N RL epochs (1: the reference is last epoch's policy)."""


@dataclass
class DPOBatch:
    rollout: Rollout
    pairs: torch.Tensor  # [P, 2] local (winner, loser) sample indices
    weights: torch.Tensor  # [P] 1 real pair, 0 padding (equal pair counts on every rank)
    rewards: Rewards


@dataclass
class DPOUnit:
    batch: DPOBatch
    pairs: torch.Tensor  # [m] rows of batch.pairs
    sigma: torch.Tensor  # [m]
    noise: torch.Tensor  # [m, *latent_shape]
    share: float = 0.0  # the unit's share of its optimizer step's loss (``set_shares``)
    step_weight: float = 0.0  # this rank's total unit weight in that step (``balance_ranks``)


class DPO(AlgorithmDefaults):
    """Online Diffusion-DPO on best-vs-worst pairs of each group."""

    config_class = DPOConfig
    needs_reference = True
    local_groups = True
    shown_metrics = ("dpo_margin",)

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        # Epoch 0 too: after a LoRA warm-up the LoRA-disabled base is not the policy RL starts from.
        if epoch % self.config.ref_refresh_every == 0:
            refresh_reference(ctx)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> DPOBatch:
        _, best, worst = best_and_worst(rewards.all, rewards.group_ids_all)
        pairs, weights = balanced_local(torch.stack([best, worst], dim=1).reshape(-1, 2), rewards)
        return DPOBatch(rollout, pairs, weights, rewards)

    def plan(self, batch: DPOBatch, generator: torch.Generator) -> list[list[DPOUnit]]:
        """No steps where no group (of any rank: the selection is the same everywhere) has a reward spread."""
        if len(batch.pairs) == 0:
            return []
        x0 = batch.rollout.latents[:, -1]
        draws = NoiseDraws.draw(
            self.config.noise_draws, x0[batch.pairs[:, 0]], self.config.logit_mean, self.config.logit_std, generator
        )
        units = [
            DPOUnit(batch, rows, draws.sigma[d, rows], draws.noise[d, rows])
            for d in range(self.config.noise_draws)
            for rows in torch.randperm(len(batch.pairs), generator=generator).split(self.config.micro_batch_size)
        ]
        return set_shares(
            split_units(units, self.config.steps_per_epoch), lambda unit: float(batch.weights[unit.pairs].sum())
        )

    def loss(self, ctx: LossContext, unit: DPOUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ro = unit.batch.rollout
        samples = unit.batch.pairs[unit.pairs].T.reshape(-1)  # winners then losers
        sigma, noise = unit.sigma.repeat(2), torch.cat([unit.noise, unit.noise])
        x_t, target = ctx.adapter.training_target(ro.latents[samples, -1], noise, sigma)
        cond = ro.cond.select(samples)
        policy = per_sample_mse(ctx.adapter.predict(ctx.policy, x_t, sigma, cond, 1.0), target)
        with torch.no_grad():
            ref = per_sample_mse(ctx.adapter.predict(ctx.reference, x_t, sigma, cond, 1.0), target)
        m = len(unit.pairs)
        loss, stats = diffusion_dpo_loss(
            policy[:m], policy[m:], ref[:m], ref[m:], self.config.beta, unit.batch.weights[unit.pairs]
        )
        stats["dpo_loss"] = loss.detach()
        real = unit.batch.weights[unit.pairs].to(policy).repeat(2)
        stats["denoise_loss"] = weighted_mean(policy.detach(), real)
        return loss * unit.share, stats

    def batch_metrics(self, batch: DPOBatch) -> dict[str, float]:
        real = batch.pairs[batch.weights > 0]
        gap = batch.rewards.local[real[:, 0]] - batch.rewards.local[real[:, 1]] if len(real) else torch.zeros(1)
        return {"pairs": float(len(real)), "pair_reward_gap": float(gap.mean())}
