"""PPO with batch-normalised advantages: GRPO's clipped step loss without grouping.

    A_i = clip((r_i - mean(r)) / (std(r) + 1e-4), -c, c)     over the whole gathered batch
and the same clipped per-step objective (see ``policy_gradient``). Samples of one prompt (``group_size``
> 1 is allowed) are not compared with each other, so prompts that are easier than others get positive
advantages: that is the baseline GRPO's grouping removes, and the reason to compare the two. Departures from
DDPO's train.py: 1e-4 beside the std (its 1e-8; Flow-GRPO's form), and the last step is never trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import batch_advantages
from trainer.algorithms.policy_gradient import ClippedPolicyGradient, PolicyGradientConfig
from trainer.config.fields import PositiveInt


@dataclass
class PPOConfig(PolicyGradientConfig):
    """PPO hyper-parameters (batch advantages; every other field as in GRPO)."""

    name: str = "ppo"
    group_size: PositiveInt = 1


class PPO(ClippedPolicyGradient):
    """Clipped policy optimisation with batch-normalised advantages."""

    config_class = PPOConfig

    def advantages(self, rewards: Rewards) -> torch.Tensor:
        return rewards.local_rows(batch_advantages(rewards.all, self.config.adv_clip))
