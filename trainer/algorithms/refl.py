"""ReFL (ImageReward's reward feedback learning): score the one-step clean-sample prediction from a late step.

Per sample a step m ~ U{lo..hi} (``step_range``; by default the last quarter, as the authors' 30..39 of 40); from
the rollout's x_m, one forward with gradient:
    x0_hat = x_m - sigma_m v_theta(x_m, sigma_m, c)        (flow; ``core_algos.predicted_clean``)
    L = mean relu(margin - r(decode(x0_hat), c))           margin 2 (the authors'); ``loss: negative``: -r
As THUDM/ImageReward's ReFL.py (tests/parity/test_reward_backprop.py). Departures (docs/departures.md): no
``grad_scale`` factor (theirs 1e-3, a constant Adam ignores up to its epsilon); the forward at step m takes step m's
noise level and predicts x0 at it (theirs passes the index m as the timestep and the previous step's timestep to
the scheduler); the gradient-free prefix is the epoch's rollout (``reward_backprop``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.algorithms.base import LossContext
from trainer.algorithms.core_algos import predicted_clean
from trainer.algorithms.reward_backprop import RewardBackprop, RewardBackpropConfig, RewardUnit
from trainer.config.fields import NonNegativeInt


@dataclass
class ReFLConfig(RewardBackpropConfig):
    """ReFL: score the one-step clean prediction from a late step; the authors' hinge loss by default."""

    name: str = "refl"
    loss: Literal["negative", "hinge"] = "hinge"
    step_range: tuple[NonNegativeInt, NonNegativeInt] = (0, 0)
    """[lo, hi] (inclusive) of the step m whose latent x_m predicts the clean sample; (0, 0): the last quarter of
    ``sampler.num_steps``, [T - max(1, T // 4), T - 1], as ImageReward's 30..39 of 40 steps."""

    def __post_init__(self):
        super().__post_init__()
        lo, hi = self.steps()
        if not lo <= hi < self.sampler.num_steps:
            raise ValueError(
                f"algorithm.step_range={tuple(self.step_range)} must satisfy lo <= hi < sampler.num_steps="
                f"{self.sampler.num_steps}"
            )

    def steps(self) -> tuple[int, int]:
        """[lo, hi] of the drawn step (``step_range``, or its default for (0, 0))."""
        num = self.sampler.num_steps
        return tuple(self.step_range) if tuple(self.step_range) != (0, 0) else (num - max(1, num // 4), num - 1)


class ReFL(RewardBackprop):
    """One forward with gradient at a random late step; its clean-sample prediction is scored."""

    config_class = ReFLConfig
    reproduces_rollout = False

    def draw_steps(self, num_samples: int, num_steps: int, generator: torch.Generator) -> torch.Tensor:
        lo, hi = self.config.steps()
        return torch.randint(lo, hi + 1, (num_samples,), generator=generator)

    def final_latents(self, ctx: LossContext, unit: RewardUnit) -> torch.Tensor:
        ro = unit.batch.rollout
        device = ro.latents.device
        steps = unit.steps.to(device)
        x = ro.latents[unit.rows.to(device), steps]
        v = self.forward(ctx, ro, x, steps, ro.cond.select(unit.rows))
        return predicted_clean(ctx.adapter.training_target, x, v.float(), ro.sigmas[steps])
