"""DRTune (deep reward tuning): gradient from the final image to K evenly spaced steps, inputs detached.

Per sample K trained steps k = o + j T // K (o ~ U{0..T//K - 1}); the sampling chain runs with the denoiser's input
detached (sg(x_t)) and only the trained steps' outputs keep their gradient:
    x_{i+1} = x_i + dt_i v_theta(sg(x_i), sigma_i, c)        (v detached unless i is trained)
    L = -mean r(decode(x_T), c)
A flow step passes the gradient on unchanged (dx'/dx = I), so x_T = sg(x_T) + sum_k [step_k(v_k) - step_k(sg(v_k))]
gives the same value and gradient from K forwards instead of T. No code of the authors is public: the parity test
transcribes the paper's loop (arXiv 2405.00760). Not offered: the paper's early stop. Departure: the trajectory is
the epoch's rollout (``reward_backprop``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.algorithms.base import LossContext
from trainer.algorithms.reward_backprop import RewardBackprop, RewardBackpropConfig, RewardUnit
from trainer.config.fields import PositiveInt


@dataclass
class DRTuneConfig(RewardBackpropConfig):
    """DRTune: K evenly spaced trained steps, the denoiser's input detached at each."""

    name: str = "drtune"
    train_steps: PositiveInt = 2
    """K: trained steps per sample, T // K apart from a random offset in [0, T // K)."""

    def __post_init__(self):
        super().__post_init__()
        if self.train_steps > self.sampler.num_steps:
            raise ValueError(
                f"algorithm.train_steps={self.train_steps} exceeds sampler.num_steps={self.sampler.num_steps}"
            )


class DRTune(RewardBackprop):
    """Gradient reaches the trained steps' outputs through the sampler's update chain, never their inputs.

    With the input detached, a flow step x' = x + dt v passes the gradient on unchanged (dx'/dx = I), so the
    final latent's gradient to step k's output is dt_k: x_T = sg(x_T) + sum_k [step_k(v_k) - step_k(sg(v_k))]
    gives DRTune's value and gradient from K forwards instead of T (tests/parity/test_reward_backprop.py checks it
    against the paper's full loop)."""

    config_class = DRTuneConfig

    def draw_steps(self, num_samples: int, num_steps: int, generator: torch.Generator) -> torch.Tensor:
        interval = num_steps // self.config.train_steps
        offset = torch.randint(0, interval, (num_samples, 1), generator=generator)
        return offset + interval * torch.arange(self.config.train_steps)

    def final_latents(self, ctx: LossContext, unit: RewardUnit) -> torch.Tensor:
        ro = unit.batch.rollout
        cond, step_fn = ro.cond.select(unit.rows), ctx.adapter.step_function(ro.kind, ro.sigmas)
        rows = unit.rows.to(ro.latents.device)
        x_final = ro.latents[rows, -1].float()
        for k in unit.steps.T.to(ro.latents.device):  # [m] step indices, one trained step per sample at a time
            x = ro.latents[rows, k]
            v = self.forward(ctx, ro, x, k, cond)
            x_final = x_final + (step_fn.mean(v, x, k, 0.0)[0] - step_fn.mean(v.detach(), x, k, 0.0)[0])
        return x_final
