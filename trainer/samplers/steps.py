"""What every sampler step shares: a linear-Gaussian step x_next = mean + std * eps, scored by its
log-density averaged over elements, run on per-step constants precomputed for a whole schedule.

A step kind (flow_sde.py, ddim.py) brings two things: a function from a schedule's noise levels to a
NamedTuple of per-step constants ([N] tensors, with fields std, kl_std, lp_scale, lp_const), and a
``mean(constants, model_output, sample)`` in float32. ``ScheduledStep`` binds them to a schedule; a step
then runs only its full-size kernels (mean, draw, difference, dot product).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer.samplers.noise import standard_normal

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A per-sample [B] tensor (or a scalar) as float32 [B, 1, ...], broadcasting over ``like``'s non-batch dims."""
    value = torch.as_tensor(value, device=like.device, dtype=torch.float32)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def log_prob_constants(std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lp_scale, lp_const) = (-1 / (2 std^2), -log std - log sqrt(2 pi)), so that the mean over n elements of
    log N(x; mean, std^2) is lp_scale * (d . d) / n + lp_const with d = x - mean. Both are 0 where std = 0: a
    deterministic step has no density, scores 0 and must not be trained on (the trainers never select it)."""
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    lp_scale = torch.where(positive, -0.5 / safe_std**2, torch.zeros_like(std))
    lp_const = torch.where(positive, -torch.log(safe_std) - _LOG_SQRT_2PI, torch.zeros_like(std))
    return lp_scale, lp_const


def shaped_coefficients(coefficients: NamedTuple, like: torch.Tensor) -> NamedTuple:
    """Per-sample constants ([B] or scalars) as float32 tensors that broadcast in the step: [B, 1, ...] over
    ``like``, except lp_scale and lp_const: [B, 1]."""
    return type(coefficients)(
        *(
            per_sample(c, like).reshape(-1, 1) if name.startswith("lp_") else per_sample(c, like)
            for name, c in zip(coefficients._fields, coefficients, strict=True)
        )
    )


def shaped_step(
    mean_fn: Callable[[NamedTuple, torch.Tensor, torch.Tensor], torch.Tensor],
    c: NamedTuple,
    output: torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear-Gaussian step on shaped constants ``c``: draws ``prev_sample`` ~ N(mean, std^2) unless given,
    with mean = ``mean_fn(c, output, sample)``, and returns (prev_sample in sample's dtype, log_prob [B], mean
    float32, kl_std [B, 1, ...]), log_prob = lp_scale * mean_elements((prev_sample - mean)^2) + lp_const.
    After the mean: three full-size passes (noise, difference, dot product) and one draw."""
    mean = mean_fn(c, output, sample)
    if prev_sample is None:
        noise = standard_normal(mean.shape, generator, mean.device)
        prev_sample = torch.addcmul(mean, noise, c.std, out=noise).to(sample.dtype)  # in place: one buffer
    d = (prev_sample.float() - mean).reshape(mean.shape[0], 1, -1)
    squares = torch.bmm(d, d.transpose(1, 2)).reshape(-1, 1)
    log_prob = torch.addcmul(c.lp_const, squares, c.lp_scale, value=1 / d.shape[-1])
    return prev_sample, log_prob.reshape(-1), mean, c.kl_std


class ScheduledStep:
    """A step bound to a schedule t[0..T] and called with step indices: ``constants(noise_level)`` gives its
    per-step constants for all T steps at once (a NamedTuple of [T] tensors), gathered by index and shaped by
    ``shaped_coefficients``; ``mean(shaped, output, sample)`` computes the step's mean from them and
    ``shaped_step`` draws and scores around it. Computing the constants per call would add some 35 small
    kernels to a step's 7; for an int index the shaped views are kept too, so a step spends no host time
    shaping them (at small models on a GPU, launches and host time are the cost).
    """

    def __init__(
        self,
        constants: Callable[[float], NamedTuple],
        mean: Callable[[NamedTuple, torch.Tensor, torch.Tensor], torch.Tensor],
    ):
        self._constants, self._mean = constants, mean
        self._tables: dict[float, tuple[type, torch.Tensor]] = {}
        self._shaped: dict[tuple, NamedTuple] = {}
        """Rollout steps (an int index): the shaped views per (noise level, index, batch, ndim)."""

    def __call__(
        self,
        output: torch.Tensor,
        sample: torch.Tensor,
        index: int | torch.Tensor,
        noise_level: float,
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ):
        """``index``: the step (an int, or [B] per sample); returns (prev_sample, log_prob [B], mean, kl_std)."""
        return shaped_step(
            self._mean, self._shaped_constants(index, noise_level, sample), output, sample, prev_sample, generator
        )

    def mean(
        self, output: torch.Tensor, sample: torch.Tensor, index: int | torch.Tensor, noise_level: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, kl_std) of the step alone, without drawing or scoring a sample (a reference's KL term)."""
        c = self._shaped_constants(index, noise_level, sample)
        return self._mean(c, output, sample), c.kl_std

    def std(self, index: int | torch.Tensor, noise_level: float, like: torch.Tensor) -> torch.Tensor:
        """The step's standard deviation (x_next = mean + std eps), [B, 1, ...] float32 over ``like``."""
        return self._shaped_constants(index, noise_level, like).std

    def _shaped_constants(self, index: int | torch.Tensor, noise_level: float, sample: torch.Tensor) -> NamedTuple:
        key = (noise_level, index, sample.shape[0], sample.ndim) if isinstance(index, int) else None
        coefficients = self._shaped.get(key) if key is not None else None
        if coefficients is None:
            coefficients = shaped_coefficients(self._rows(index, noise_level, sample.shape[0]), sample)
            if key is not None:
                self._shaped[key] = coefficients
        return coefficients

    def check_noise_level(self, noise_level: float) -> None:
        """Raise now the ValueError that the first step at ``noise_level`` would raise (DDIM: eta outside
        [0, 1]), e.g. before a warm-up that would delay that step; the step's constants are kept."""
        self._table(noise_level)

    def _table(self, noise_level: float) -> tuple[type, torch.Tensor]:
        if noise_level not in self._tables:
            constants = self._constants(noise_level)
            self._tables[noise_level] = type(constants), torch.stack(tuple(constants), dim=1)
        return self._tables[noise_level]

    def _rows(self, index: int | torch.Tensor, noise_level: float, batch: int) -> NamedTuple:
        kind, table = self._table(noise_level)
        rows = table[index if isinstance(index, int) else index.to(table.device)]  # an int: a view, no kernel
        return kind(*rows.reshape(-1, len(kind._fields)).expand(batch, -1).unbind(1))
