"""MixGRPO: GRPO on mixed ODE-SDE rollouts whose SDE window slides over the denoising steps as training goes.

Rollouts take SDE steps (recording log-probs) only inside a window of w = ``sampler.sde_window`` steps,
[l, l + w), and deterministic ODE steps elsewhere; only the window's steps are trained, with GRPO's
clipped loss. The window starts at the first (noisiest) step and moves by ``stride`` every ``shift_every``
RL epochs, stopping at the last start whose window ends before the final step (never trained):
    l(epoch) = min(stride floor(epoch / shift_every), T - w - 1)     (with ``wrap``: modulo T - w)
MixGRPO-Flash (``configs/algorithms/mixgrpo_flash.yaml``) is two sampler options: ``sampler.ode_order=2`` takes
DPM-Solver++(2M) steps after the window (x0 = x - sigma v, lambda = log((1 - sigma) / sigma)),
    x_next = (sigma_next / sigma) x + (1 - sigma_next)(1 - e^-h)(x0 + (x0 - x0_prev) / (2 r))
(trainer/samplers/multistep.py), and ``sampler.ode_compress`` keeps that fraction of those steps; the window's
steps and log-probs are untouched, so the on-policy ratio stays 1.
Departures from the paper: the window moves per RL epoch rather than per optimizer iteration; the step
kind is the sampler's ("eta" is the DanceGRPO SDE the paper builds on); Flash's compressed steps are a subset of
the model's own schedule (the paper builds a new shifted linspace, int(r (n + 1)) - 1 steps for n; we take
round(r n)), and steps before the window stay Euler, as in the paper's "post" strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainer.algorithms.base import LossContext
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.config.fields import PositiveInt
from trainer.rollout import SamplerSettings


def window_start(epoch: int, stride: int, shift_every: int, num_starts: int, wrap: bool) -> int:
    """l = stride floor(epoch / shift_every), clamped to the last of ``num_starts`` starts (or modulo them)."""
    start = stride * (epoch // shift_every)
    return start % num_starts if wrap else min(start, num_starts - 1)


@dataclass
class MixGRPOConfig(GRPOConfig):
    """MixGRPO hyper-parameters: GRPO's, with the sliding window's size (``sampler.sde_window``) and pace."""

    name: str = "mixgrpo"
    shift_every: PositiveInt = 1
    """RL epochs between two moves of the window (the paper's tau, in epochs)."""
    stride: PositiveInt = 1
    """Denoising steps the window moves by at each move (the paper's s)."""
    wrap: bool = False
    """Start over at the first step after the last window, instead of staying there."""
    sampler: SamplerSettings = field(default_factory=lambda: SamplerSettings(sde_window=2))
    """Rollout sampling; ``sde_window`` is the window's size, its start is this algorithm's (``window_range``
    is set per epoch)."""

    def __post_init__(self):
        super().__post_init__()
        if self.sampler.sde_window == 0:
            raise ValueError("mixgrpo needs algorithm.sampler.sde_window > 0: the size of its sliding SDE window")


class MixGRPO(GRPO):
    """GRPO whose SDE window slides from the first denoising step towards the last as training goes."""

    config_class = MixGRPOConfig

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        settings = self.config.sampler
        num_starts = settings.num_steps - settings.sde_window  # a window ends before the last step
        start = window_start(epoch, self.config.stride, self.config.shift_every, num_starts, self.config.wrap)
        self.sampler = dataclasses.replace(settings, window_range=(start, start + 1))
