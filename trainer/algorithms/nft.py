"""DiffusionNFT: policy optimisation on the forward (noising) process of the policy's clean samples.

No log-probabilities, so any sampler (the ODE one by default) and no CFG. Each clean sample x0 with
reward r gets an optimality probability from its group-relative advantage,
    r~ = 0.5 + 0.5 clip(A / s, -1, 1),
and at a random noise level sigma, x_sigma and the flow-matching target v come from the forward process:
    v+ = (1 - beta) v_old + beta v_theta,   v- = (1 + beta) v_old - beta v_theta
    L  = r~ ||v+ - v||^2 + (1 - r~) ||v- - v||^2
Good samples pull the policy towards their target, bad ones push it away, both relative to v_old, the
velocity of the old (sampling) policy: the reference, which follows the policy before every epoch's
rollout: old <- decay old + (1 - decay) policy (decay 0 copies it). Departures from the paper: noise
levels are logit-normal like the supervised loss; samples with a failed reward get weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.advantages import group_advantages, nft_loss, optimality_probability
from trainer.algorithms.base import LossContext, NoExtras, Rewards, refresh_reference
from trainer.algorithms.clean_sample import CleanSampleConfig, CleanUnit, policy_and_reference, weighted_plan
from trainer.config.fields import Decay, PositiveFloat
from trainer.rollout import Rollout


@dataclass
class NFTConfig(CleanSampleConfig):
    """DiffusionNFT hyper-parameters (the shared fields: ``CleanSampleConfig``)."""

    name: str = "nft"
    beta: PositiveFloat = 1.0
    """Mixing strength of the implicit positive / negative policies (the paper's beta)."""
    optimality_scale: PositiveFloat = 1.0
    """s in r~ = 0.5 + 0.5 clip(A / s, -1, 1): advantages (in group stds) that count as fully good/bad."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's."""
    old_decay: Decay = 0.0
    """The old policy's update before each epoch: old <- decay old + (1 - decay) policy."""


@dataclass
class NFTBatch:
    rollout: Rollout
    optimality: torch.Tensor  # [B] r~ of this rank's samples
    weights: torch.Tensor     # [B] 0 where the reward failed
    rewards: Rewards


class NFT(NoExtras):
    """DiffusionNFT on clean rollout samples."""

    config_class = NFTConfig
    needs_reference = True
    shown_metrics = ("nft_loss",)


    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        refresh_reference(ctx, self.config.old_decay)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> NFTBatch:
        adv = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std)
        mine = slice(rewards.offset, rewards.offset + len(rewards.local))
        return NFTBatch(rollout, optimality_probability(adv[mine], self.config.optimality_scale),
                        (~torch.isnan(rewards.local)).float(), rewards)

    def plan(self, batch: NFTBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """The batch's clean samples, weighted by reward (``clean_sample.weighted_plan``)."""
        return weighted_plan(batch, self.config, generator)

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, idx = unit.batch, unit.rows
        target, v_theta, v_old = policy_and_reference(ctx, unit)
        # optimality and weights come from the host-side rewards
        per_sample = nft_loss(v_theta.float(), v_old.float(), target.float(), batch.optimality[idx].to(v_theta.device),
                              self.config.beta)
        w = batch.weights[idx].to(per_sample)
        loss = (per_sample * w).sum() / w.sum().clamp_min(1.0)
        return loss * unit.share, {"nft_loss": loss.detach()}

    def batch_metrics(self, batch: NFTBatch) -> dict[str, float]:
        return {"optimality_mean": float(batch.optimality.mean()),
                "optimality_extreme_share": float(((batch.optimality - 0.5).abs() == 0.5).float().mean())}
