"""What the algorithms that train on clean latents with a denoising-type loss share (sft, and on their
rollouts' final latents dpo, sft_best, nft): the config fields, noise draws, micro-batch units, the loss.

    x_sigma = adapter.training_target(x0, eps, sigma),   sigma ~ logit-normal(m, s)
    per-sample loss = mean over elements of (model(x_sigma, sigma, c) - target)^2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.algorithms.base import set_shares
from trainer.config.fields import FiniteFloat, NonNegativeFloat, PositiveInt
from trainer.rollout import SamplerSettings


def logit_normal_sigmas(
    n: int, mean: float, std: float, generator: torch.Generator | None, shift: float = 1.0
) -> torch.Tensor:
    """sigma = shift u / (1 + (shift - 1) u), u = sigmoid(m + s * z), z ~ N(0, 1): SD3's training density over
    noise levels; ``shift`` 3 reads them as diffusers' SD3 training reads its shift-3 scheduler's grid."""
    u = torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    return u if shift == 1 else shift * u / (1 + (shift - 1) * u)


@dataclass
class CleanSampleConfig:
    """Fields every algorithm that trains on the clean samples of its rollouts with a denoising-type loss
    has (dpo, sft_best, nft); each algorithm's config adds its own."""

    name: str = ""
    """Registry name of the algorithm (``trainer.algorithms.ALGORITHMS``)."""
    group_size: PositiveInt = 8
    """Samples per prompt (a group); the algorithm compares samples within a group."""
    noise_draws: PositiveInt = 2
    """(noise level, noise) draws per trained sample per inner epoch."""
    inner_epochs: PositiveInt = 1
    """Passes over each epoch's samples."""
    steps_per_epoch: PositiveInt = 1
    """Optimizer steps per inner epoch: the micro-batches of every draw are split into this many (fewer when
    there are fewer micro-batches, e.g. DPO pairs in an epoch with little reward spread)."""
    micro_batch_size: PositiveInt = 32
    """Samples (DPO: pairs) per forward/backward."""
    logit_mean: FiniteFloat = 0.0
    """Mean of the logit-normal density of noise levels."""
    logit_std: NonNegativeFloat = 1.0
    """Std of the logit-normal density of noise levels."""
    sampler: SamplerSettings = field(default_factory=lambda: SamplerSettings(noise_level=0.0))
    """Rollout sampling; no log-probs are needed, so the deterministic sampler users deploy is the default."""

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError("algorithm.group_size must be >= 2: samples are compared within a group")


def split_units(units: list, steps: int) -> list[list]:
    """Loss units cut into ``steps`` optimizer steps whose unit counts differ by one at most (as many steps as
    there are units where there are fewer)."""
    steps = min(steps, len(units))
    return [units[len(units) * i // steps : len(units) * (i + 1) // steps] for i in range(steps)]


@dataclass
class NoiseDraws:
    """Noise levels and noises for denoising losses on given clean latents: [D, N] sigmas and
    [D, N, *latent_shape] noises for D draws of N samples (drawn in ``plan`` so a resumed run repeats them)."""

    sigma: torch.Tensor
    noise: torch.Tensor

    @staticmethod
    def draw(draws: int, x0: torch.Tensor, mean: float, std: float, generator: torch.Generator) -> NoiseDraws:
        sigma = logit_normal_sigmas(draws * len(x0), mean, std, generator).reshape(draws, len(x0))
        noise = torch.randn((draws, *x0.shape), generator=generator)
        return NoiseDraws(sigma.to(x0.device), noise.to(x0.device))

    @staticmethod
    def at_steps(sigmas: torch.Tensor, steps: torch.Tensor, x0: torch.Tensor, generator: torch.Generator) -> NoiseDraws:
        """The rollout schedule's noise levels ``sigmas[steps]`` (``steps`` [D, N] step indices) with fresh noise:
        the authors' training timesteps of DGPO and AWM, the sampler's own."""
        noise = torch.randn((steps.shape[0], *x0.shape), generator=generator)
        return NoiseDraws(sigmas.cpu()[steps].to(x0.device), noise.to(x0.device))


def stratified_steps(lo: int, hi: int, draws: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """[draws, n] step indices, draw d uniform in the d-th of ``draws`` strata of [lo, hi) (boundaries
    linspace(lo, hi, draws + 1) truncated to integers, as AWM's ``discrete`` time types cut them)."""
    bounds = torch.linspace(lo, hi, draws + 1).long()
    lower, width = bounds[:-1, None], (bounds[1:] - bounds[:-1])[:, None]
    return lower + (torch.rand((draws, n), generator=generator) * width).long()


def draw_units(
    x0: torch.Tensor,
    config: CleanSampleConfig,
    generator: torch.Generator,
    per_unit: int,
    make_unit: Callable[[torch.Tensor, NoiseDraws], Any],
    draws: NoiseDraws | None = None,
) -> list:
    """Loss units of every row of ``x0`` under each of ``config.noise_draws`` (noise level, noise) draws, in
    shuffled chunks of ``per_unit`` rows: ``make_unit(rows, their draw)`` for each chunk, draw after draw.
    ``draws``: given ones ([D, len(x0)]) instead of logit-normal levels."""
    if draws is None:
        draws = NoiseDraws.draw(config.noise_draws, x0, config.logit_mean, config.logit_std, generator)
    return [
        make_unit(rows, NoiseDraws(draws.sigma[d, rows], draws.noise[d, rows]))
        for d in range(len(draws.sigma))
        for rows in torch.randperm(len(x0), generator=generator).split(per_unit)
    ]


@dataclass
class CleanUnit:
    """One micro-batch of a clean-sample algorithm (sft_best, nft): rows of its batch with their noise draw."""

    batch: Any
    rows: torch.Tensor  # [m] rows of the batch
    draw: NoiseDraws  # the rows' noise levels and noises
    share: float = 0.0  # the unit's share of its optimizer step's loss (``set_shares``)
    step_weight: float = 0.0  # this rank's total unit weight in that step (``balance_ranks``)
    on_policy: bool = False  # no optimizer step since the rollout (the ratio-clipped ones: AWM)


def weighted_plan(
    batch: Any, config: CleanSampleConfig, generator: torch.Generator, draws: NoiseDraws | None = None
) -> list[list[CleanUnit]]:
    """Every clean sample of ``batch`` under each of ``noise_draws`` draws (or the given ``draws``), in shuffled
    micro-batches cut into ``steps_per_epoch`` optimizer steps; a step's loss is the mean over its samples,
    weighted by ``batch.weights`` (0: no reward)."""
    units = draw_units(
        batch.rollout.latents[:, -1],
        config,
        generator,
        config.micro_batch_size,
        lambda rows, draw: CleanUnit(batch, rows, draw),
        draws,
    )
    return set_shares(split_units(units, config.steps_per_epoch), lambda unit: float(batch.weights[unit.rows].sum()))
