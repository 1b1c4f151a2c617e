"""MixGRPO: GRPO on mixed ODE-SDE rollouts whose SDE window slides over the denoising steps as training goes.

Rollouts take SDE steps (recording log-probs) only inside a window [l, l + size) and deterministic ODE steps
elsewhere; only the window's steps are trained, with GRPO's clipped loss. As the authors' progressive schedule
(their GRPOTrainingStates with prog_overlap and roll_back), the window of w = ``sampler.sde_window`` steps starts
at the first (noisiest) step, moves by s = ``stride`` every ``shift_every`` RL epochs, ends before step T - 2
(shrinking there) and, with ``wrap``, rolls back to the first step after its last start:
    l(epoch) = s (floor(epoch / shift_every) mod n),  n = ceil((T - 2) / s),  size = min(w, T - 2 - l)
(without ``wrap`` it stays at the last start, n - 1). An RL epoch is their training iteration (one rollout batch
and its optimizer steps), so ``shift_every`` is their iters_per_group.
MixGRPO-Flash (``configs/algorithms/mixgrpo_flash.yaml``) is two sampler options: ``sampler.ode_order=2`` takes
DPM-Solver++(2M) steps after the window (x0 = x - sigma v, lambda = log((1 - sigma) / sigma)),
    x_next = (sigma_next / sigma) x + (1 - sigma_next)(1 - e^-h)(x0 + (x0 - x0_prev) / (2 r))
(trainer/samplers/multistep.py), and ``sampler.ode_compress`` keeps that fraction of those steps; the window's
steps and log-probs are untouched, so the on-policy ratio stays 1.
Departures from the paper: where s divides T - 2 their schedule also visits l = T - 2, an empty window (their
training loop then fails), which we skip, as we stay at the last non-empty start without ``wrap`` (theirs clips
to the empty one); the step kind is the sampler's (their recipe's flow_grpo_sampling is "sde"); Flash's
compressed steps are a subset of the model's own schedule (the paper builds a new shifted linspace,
int(r (n + 1)) - 1 steps for n; we take round(r n)), and steps before the window stay Euler, as in the paper's
"post" strategy; docs/departures.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainer.algorithms.base import LossContext
from trainer.algorithms.grpo import GRPO, GRPOConfig
from trainer.config.fields import PositiveInt
from trainer.rollout import SamplerSettings


def sde_window(epoch: int, size: int, stride: int, shift_every: int, num_steps: int, wrap: bool) -> tuple[int, int]:
    """(l, size) of ``epoch``'s SDE window [l, l + size) over T = ``num_steps`` steps: l = stride m with
    m = floor(epoch / shift_every) modulo (``wrap``) or clamped to the n = ceil((T - 2) / stride) starts below
    T - 2, and size = min(``size``, T - 2 - l), the window shrinking as it reaches step T - 2."""
    limit = num_steps - 2
    num_starts = -(-limit // stride)
    move = epoch // shift_every
    start = stride * (move % num_starts if wrap else min(move, num_starts - 1))
    return start, min(size, limit - start)


@dataclass
class MixGRPOConfig(GRPOConfig):
    """MixGRPO hyper-parameters: GRPO's, with the sliding window's size (``sampler.sde_window``) and pace; the
    authors' FLUX recipe slides a window of 4 by 1 step every 25 epochs
    (configs/presets/flux_mixgrpo_multi_reward.yaml)."""

    name: str = "mixgrpo"
    shift_every: PositiveInt = 1
    """RL epochs between two moves of the window (the paper's tau, their iters_per_group)."""
    stride: PositiveInt = 1
    """Denoising steps the window moves by at each move (the paper's s, their prog_overlap_step)."""
    wrap: bool = True
    """Roll back to the first step after the last window (their roll_back); false: stay at the last window."""
    sampler: SamplerSettings = field(default_factory=lambda: SamplerSettings(sde_window=2))
    """Rollout sampling; ``sde_window`` is the window's size w, its start (and its size at the tail) this
    algorithm's (``window_range`` is set per epoch)."""

    def __post_init__(self):
        super().__post_init__()
        if self.sampler.sde_window == 0:
            raise ValueError("mixgrpo needs algorithm.sampler.sde_window > 0: the size of its sliding SDE window")
        if self.sampler.num_steps < 3:
            raise ValueError(
                f"algorithm.sampler.num_steps={self.sampler.num_steps}: mixgrpo's windows end before step "
                "T - 2, so they need num_steps >= 3"
            )


class MixGRPO(GRPO):
    """GRPO whose SDE window slides from the first denoising step towards the last as training goes."""

    config_class = MixGRPOConfig

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        c, settings = self.config, self.config.sampler
        start, size = sde_window(epoch, settings.sde_window, c.stride, c.shift_every, settings.num_steps, c.wrap)
        self.sampler = dataclasses.replace(settings, sde_window=size, window_range=(start, start + 1))
