"""MixGRPO: GRPO on mixed ODE-SDE rollouts whose SDE window slides over the denoising steps as training goes.

Rollouts take SDE steps (recording log-probs) only inside a window of w = ``sampler.sde_window`` steps,
[l, l + w), and deterministic ODE steps elsewhere; only the window's steps are trained, with GRPO's
clipped loss. The window starts at the first (noisiest) step and moves by ``stride`` every ``shift_every``
RL epochs, stopping at the last start whose window ends before the final step (never trained):
    l(epoch) = min(stride floor(epoch / shift_every), T - w - 1)     (with ``wrap``: modulo T - w)
Departures from the paper: the window moves per RL epoch rather than per optimizer iteration; the step
kind is the sampler's ("eta" is the DanceGRPO SDE the paper builds on); MixGRPO-Flash's higher-order ODE
steps outside the window are not offered (a rollout step here is a one-step Markov kernel).
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
