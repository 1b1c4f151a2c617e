"""Best-of-group SFT (rejection sampling fine-tuning): the denoising regression loss on the policy's own
best sample of each group, optionally weighted by how much better than its group it is.

Per group g, b = argmax_i r_i; with the weight w_g = 1 ("uniform") or w_g = max(A_b, 0) where A is the
group-relative advantage ("advantage"; a group without spread then gives no update):
    L = sum_g w_g ||model(x_sigma(b), sigma, c) - target||^2 / sum_g w_g,   sigma ~ logit-normal
The clean sample is the rollout's final latent. Departures from RAFT: one best per group rather than a
top fraction of the whole batch. Departures from Flow-GRPO's SFT (train_sd3_sft.py, uniform weights): its loss
is a mean over every sample (ours over the chosen ones: N / chosen times theirs); it trains every sample tied
for a group's best, a flat group's all (ours: the first best, none of a flat group); its noise levels are
SD3's shift-3 grid (ours unshifted, as the warm-up's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.algorithms.base import AlgorithmDefaults, LossContext, Rewards, balanced_local, set_shares
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    NoiseDraws,
    split_units,
)
from trainer.algorithms.core_algos import best_and_worst, denoising_loss, group_advantages
from trainer.rollout import Rollout


@dataclass
class BestOfGroupConfig(CleanSampleConfig):
    """Best-of-group SFT hyper-parameters (the shared fields: ``CleanSampleConfig``)."""

    name: str = "sft_best"
    weighting: Literal["uniform", "advantage"] = "uniform"
    """Weight of each group's best sample: 1 (as Flow-GRPO's SFT and RAFT), or its (positive) group-relative
    advantage."""


@dataclass
class BestBatch:
    rollout: Rollout
    samples: torch.Tensor  # [M] local indices of the chosen samples (padded)
    weights: torch.Tensor  # [M] loss weights, 0 for padding
    rewards: Rewards


class BestOfGroupSFT(AlgorithmDefaults):
    """Supervised fine-tuning on each group's best sample."""

    config_class = BestOfGroupConfig
    needs_reference = False
    local_groups = True
    shown_metrics = ("sft_loss",)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> BestBatch:
        groups, best, _ = best_and_worst(rewards.all, rewards.group_ids_all)
        if self.config.weighting == "advantage":
            adv = group_advantages(rewards.all, rewards.group_ids_all, global_std=False)
            gathered_weights = adv[best].clamp_min(0.0)
        else:
            gathered_weights = torch.ones(len(best))
        rows, real = balanced_local(best[:, None], rewards)
        mine = rewards.is_local(best)
        weights = torch.cat([gathered_weights[mine], torch.zeros(len(rows) - int(mine.sum()))]) * real
        return BestBatch(rollout, rows[:, 0], weights, rewards)

    def plan(self, batch: BestBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """Each optimizer step's loss is the weighted mean over all of its chosen samples (every draw). No steps
        where no group (of any rank: the selection is the same everywhere) has a reward spread."""
        if len(batch.samples) == 0:
            return []
        x0 = batch.rollout.latents[batch.samples, -1]
        draws = NoiseDraws.draw(self.config.noise_draws, x0, self.config.logit_mean, self.config.logit_std, generator)
        units = [
            CleanUnit(batch, rows, NoiseDraws(draws.sigma[d, rows], draws.noise[d, rows]))
            for d in range(self.config.noise_draws)
            for rows in torch.arange(len(batch.samples)).split(self.config.micro_batch_size)
        ]
        return set_shares(
            split_units(units, self.config.steps_per_epoch), lambda unit: float(batch.weights[unit.rows].sum())
        )

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, draw = unit.batch, unit.draw
        samples = batch.samples[unit.rows]
        ro = batch.rollout
        x_t, target = ctx.adapter.training_target(ro.latents[samples, -1], draw.noise, draw.sigma)
        pred = ctx.adapter.predict(ctx.policy, x_t, draw.sigma, ro.cond.select(samples), 1.0)
        # A micro-batch of only zero weights (share 0) still runs its backward (every rank runs the same count).
        loss = denoising_loss(pred, target, batch.weights[unit.rows]) if unit.share > 0 else 0.0 * pred.sum()
        return loss * unit.share, {"sft_loss": loss.detach()}

    def batch_metrics(self, batch: BestBatch) -> dict[str, float]:
        real = batch.weights > 0
        chosen = batch.rewards.local[batch.samples[real]]
        return {"chosen": float(real.sum()), "chosen_reward": float(chosen.mean()) if len(chosen) else 0.0}
