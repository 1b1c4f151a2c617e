"""GRPO for flow models (Flow-GRPO): group-relative advantages and a PPO-clip loss per denoising step.

Per prompt, ``group_size`` images are sampled with the SDE sampler, which records log p(x_{t+1} | x_t).
    A_i   = clip((r_i - mean_group(r)) / (std + 1e-4), -c, c)      std per group or over the batch, ddof 0 or 1
    ratio = exp(log p_theta(x_{t+1} | x_t) - log p_old(x_{t+1} | x_t))
    L     = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))) + beta KL(pi_theta || pi_ref)
with the KL between the two Gaussian steps in the Flow-GRPO latent-mean form (no dt factor; see
``gaussian_mean_kl``). Departures from Flow-GRPO's train_sd3.py (docs/departures.md): trained timesteps are
a random subset per sample (``timestep_fraction``) of the stochastic steps, the last excluded; samples of zero
advantage stay in the mean (``drop_zero_advantage`` drops them, as theirs); groups are group ids, not prompt texts.
With tree rollouts (``sampler.tree``) the advantages are BranchGRPO's per depth of each prompt's tree
(``tree_advantages``): A_{i,t} is that of the node step t leads leaf i to, among the tree's nodes at that depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import group_advantages, tree_advantages
from trainer.algorithms.policy_gradient import (
    ClippedPolicyGradient,
    PolicyGradientBatch,
    PolicyGradientConfig,
    trainable_steps,
)
from trainer.rollout import Rollout
from trainer.samplers.branching import widths


@dataclass
class GRPOConfig(PolicyGradientConfig):
    """GRPO hyper-parameters; defaults follow the Flow-GRPO reference recipe where it has one."""

    name: str = "grpo"
    global_std: bool = True
    """Normalise by the std of the whole gathered batch (reference recipe) instead of each group's."""
    unbiased_std: bool = False
    """Normalise by the unbiased std (ddof 1: MixGRPO's torch.std) instead of the population one (ddof 0:
    Flow-GRPO's np.std)."""

    def __post_init__(self):
        super().__post_init__()
        if self.group_size < 2:
            raise ValueError("algorithm.group_size must be >= 2 for group-relative advantages")


class GRPO(ClippedPolicyGradient):
    """Group relative policy optimisation on SDE rollouts."""

    config_class = GRPOConfig

    def advantages(self, rewards: Rewards) -> torch.Tensor:
        cfg = self.config
        ddof = int(cfg.unbiased_std)
        return rewards.local_rows(
            group_advantages(rewards.all, rewards.group_ids_all, cfg.global_std, cfg.adv_clip, ddof)
        )

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> PolicyGradientBatch:
        """Per-sample advantages at every step, or on a tree rollout BranchGRPO's per-node ones."""
        sampler = self.config.sampler
        if not sampler.tree:
            return super().make_batch(rollout, rewards)
        nodes = widths(len(rollout.stochastic), sampler.branch_plan(rollout.stochastic, self.config.group_size))
        adv = rewards.local_rows(tree_advantages(rewards.all, rewards.group_ids_all, nodes, self.config.adv_clip))
        return PolicyGradientBatch(rollout, adv.to(rollout.log_probs.device), trainable_steps(rollout), rewards)
