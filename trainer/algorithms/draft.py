"""DRaFT-K: backpropagate the reward through the last K deterministic sampling steps and the decoder.

From the rollout's x_{T-K}, the last K Euler steps are redone with gradient through each step's output and input:
    x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v_theta(x_i, sigma_i, c),  i = T-K .. T-1
    L = -mean r(decode(x_T), c)
Each step's forward is checkpointed (``checkpointing``). Google's DRaFT code is not public; the transcription is
AlignProp's fixed truncated backpropagation in TRL (``pipeline_step_with_grad``), the same method
(tests/parity/test_reward_backprop.py). DRaFT-LV is not offered. Departure: the gradient-free prefix is the epoch's
rollout (``reward_backprop``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import LossContext
from trainer.algorithms.reward_backprop import RewardBackprop, RewardBackpropConfig, RewardUnit
from trainer.config.fields import PositiveInt


@dataclass
class DRaFTConfig(RewardBackpropConfig):
    """DRaFT-K: backpropagate through the last K sampling steps."""

    name: str = "draft"
    backprop_steps: PositiveInt = 1
    """K: the last steps redone with gradient (DRaFT-1 is the paper's strongest cheap setting)."""

    def __post_init__(self):
        super().__post_init__()
        if self.backprop_steps > self.sampler.num_steps:
            raise ValueError(
                f"algorithm.backprop_steps={self.backprop_steps} exceeds sampler.num_steps={self.sampler.num_steps}"
            )


class DRaFT(RewardBackprop):
    """The last K deterministic steps redone with gradient (through their inputs too), then decoded."""

    config_class = DRaFTConfig

    def final_latents(self, ctx: LossContext, unit: RewardUnit) -> torch.Tensor:
        ro = unit.batch.rollout
        num_steps, cond = len(ro.sigmas) - 1, ro.cond.select(unit.rows)
        step_fn = ctx.adapter.step_function(ro.kind, ro.sigmas)
        x = ro.latents[unit.rows, num_steps - self.config.backprop_steps]
        for i in range(num_steps - self.config.backprop_steps, num_steps):
            v = self.forward(ctx, ro, x, torch.full((len(x),), i, device=ro.sigmas.device), cond)
            x = step_fn.mean(v, x, i, 0.0)[0]
        return x
