"""Stochastic reverse steps for flow-matching models that record log-probabilities.

Time runs from sigma = 1 (noise) to sigma = 0 (image); the model predicts a velocity v with
x_sigma = (1 - sigma) * x0 + sigma * eps and v = eps - x0. Every function here is pure: it takes tensors,
returns tensors, holds no state and imports no model code. All arithmetic runs in float32, whatever the
input dtype (bf16 overflows in the mean), and ``prev_sample`` is returned in the input dtype.

The log-probability is the per-element Gaussian log-density of ``prev_sample`` under
N(prev_sample_mean, (std_dev_t * sqrt(-dt))^2), AVERAGED over all non-batch dimensions (not summed):
that keeps the policy ratio near 1, which is why PPO clip ranges of 1e-4..1e-5 are used with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from trainer.samplers.noise import standard_normal

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _per_sample(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample [B] tensor over the non-batch dims of ``like``, in float32."""
    value = torch.as_tensor(value, device=like.device, dtype=torch.float32)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.reshape(-1, *([1] * (like.ndim - 1)))


class StepCoefficients(NamedTuple):
    """The constants of a linear-Gaussian flow step, per sample or per step of a schedule ([N] each):

        mean = c_x x + c_v v,   x_next = mean + std eps,
        log_prob = lp_scale * mean_elements((x_next - mean)^2) + lp_const

    with lp_scale = -1 / (2 std^2) and lp_const = -log std - log sqrt(2 pi), both 0 where std = 0 (a
    deterministic step has no density: see ``log_prob_constants``). ``kl_std`` is what the KL divides by
    (``std_dev_t``; see ``gaussian_mean_kl``).
    """

    c_x: torch.Tensor
    c_v: torch.Tensor
    std: torch.Tensor
    kl_std: torch.Tensor
    lp_scale: torch.Tensor
    lp_const: torch.Tensor


def log_prob_constants(std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lp_scale, lp_const) = (-1 / (2 std^2), -log std - log sqrt(2 pi)) of a Gaussian step with ``std``, so
    that the mean over n elements of log N(x; mean, std^2) is lp_scale * (d . d) / n + lp_const, d = x - mean
    (the elements are read twice, for the difference and the dot product, rather than once per term).
    Where std = 0 (a deterministic step) the density is a point mass and no log-prob exists: both are 0,
    so such steps score 0, and they must not be trained on (the trainers never select them)."""
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    lp_scale = torch.where(positive, -0.5 / safe_std**2, torch.zeros_like(std))
    lp_const = torch.where(positive, -torch.log(safe_std) - _LOG_SQRT_2PI, torch.zeros_like(std))
    return lp_scale, lp_const


def _coefficients(c_x: torch.Tensor, c_v: torch.Tensor, std: torch.Tensor, kl_std: torch.Tensor) -> StepCoefficients:
    return StepCoefficients(c_x, c_v, std, kl_std, *log_prob_constants(std))


def _drift_coefficients(sigma: torch.Tensor, dt: torch.Tensor, std_dev_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """c_x = 1 + std_dev_t^2 dt / (2 sigma), c_v = (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt (at std_dev_t = 0:
    1 and dt, so the mean is x + v dt, bit for bit diffusers' Euler step)."""
    return 1 + std_dev_t**2 / (2 * sigma) * dt, (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt


def sde_coefficients(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
                     sigma_max: float | torch.Tensor | None = None) -> StepCoefficients:
    """``sde_step_with_logprob``'s constants for noise levels ``sigma`` -> ``sigma_next`` ([N] each)."""
    dt = sigma_next - sigma
    if sigma_max is None:
        if noise_level > 0 and bool((sigma == 1).any()):
            raise ValueError("sde_step_with_logprob: sigma == 1 needs sigma_max (the scheduler's sigmas[1])")
        s = sigma
    else:
        s = torch.where(sigma == 1, torch.as_tensor(sigma_max, device=sigma.device, dtype=torch.float32), sigma)
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - s))
    return _coefficients(*_drift_coefficients(sigma, dt, std_dev_t), std_dev_t * torch.sqrt(-dt), std_dev_t)


def cps_coefficients(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
                     sigma_max: float | torch.Tensor | None = None) -> StepCoefficients:
    """``cps_step_with_logprob``'s constants: with r = sqrt(sigma_next^2 - std^2), the mean
    (1 - sigma_next) (x - sigma v) + r (x + (1 - sigma) v) has c_x = 1 - sigma_next + r and
    c_v = r (1 - sigma) - (1 - sigma_next) sigma."""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    r = torch.sqrt((sigma_next**2 - std**2).clamp_min(0))
    return _coefficients(1 - sigma_next + r, r * (1 - sigma) - (1 - sigma_next) * sigma, std, std)


def eta_coefficients(sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float,
                     sigma_max: float | torch.Tensor | None = None) -> StepCoefficients:
    """``eta_step_with_logprob``'s constants: the SDE drift with std_dev_t = eta."""
    dt = sigma_next - sigma
    std_dev_t = torch.full_like(sigma, noise_level)
    return _coefficients(*_drift_coefficients(sigma, dt, std_dev_t), std_dev_t * torch.sqrt(-dt), std_dev_t)


def linear_gaussian_step(
    coefficients: StepCoefficients,
    velocity: torch.Tensor,
    sample: torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply per-sample ``coefficients`` ([B] each): draw ``prev_sample`` ~ N(mean, std^2) unless given and
    return (prev_sample in sample's dtype, log_prob [B] float32, mean float32, kl_std [B, 1, ...]).

    Four full-size passes (mean, noise, difference, dot product) and one draw; the per-sample work is
    already in ``coefficients``, so a step costs the same few kernels whatever the variant.
    """
    return shaped_step(flow_mean, shaped_coefficients(coefficients, sample), velocity, sample, prev_sample, generator)


def shaped_coefficients(coefficients: NamedTuple, like: torch.Tensor) -> NamedTuple:
    """Per-sample constants ([B] or scalars; ``StepCoefficients`` or another step's) as float32 tensors that
    broadcast in the step: [B, 1, ...] over ``like``, except lp_scale and lp_const: [B, 1]."""
    return type(coefficients)(*(_per_sample(c, like).reshape(-1, 1) if name.startswith("lp_") else _per_sample(c, like)
                                for name, c in zip(coefficients._fields, coefficients, strict=True)))


def flow_mean(c: StepCoefficients, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """c_x x + c_v v in float32 (two kernels), on ``shaped_coefficients``."""
    return (sample.float() * c.c_x).addcmul_(velocity.float(), c.c_v)


def shaped_step(mean_fn: Callable[[NamedTuple, torch.Tensor, torch.Tensor], torch.Tensor], c: NamedTuple,
                output: torch.Tensor, sample: torch.Tensor, prev_sample: torch.Tensor | None,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear-Gaussian step on shaped constants ``c`` (fields std, kl_std, lp_scale, lp_const and what
    ``mean_fn(c, output, sample)`` reads): draws ``prev_sample`` ~ N(mean, std^2) unless given and returns
    (prev_sample in sample's dtype, log_prob [B], mean float32, kl_std [B, 1, ...]), with
    log_prob = lp_scale * mean_elements((prev_sample - mean)^2) + lp_const. After the mean: three full-size
    passes (noise, difference, dot product) and one draw."""
    mean = mean_fn(c, output, sample)
    if prev_sample is None:
        noise = standard_normal(mean.shape, generator, mean.device)
        prev_sample = torch.addcmul(mean, noise, c.std, out=noise).to(sample.dtype)  # in place: one buffer
    d = (prev_sample.float() - mean).reshape(mean.shape[0], 1, -1)
    squares = torch.bmm(d, d.transpose(1, 2)).reshape(-1, 1)
    log_prob = torch.addcmul(c.lp_const, squares, c.lp_scale, value=1 / d.shape[-1])
    return prev_sample, log_prob.reshape(-1), mean, c.kl_std


def _step(coefficients_fn, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator, sigma_max):
    sigma = _per_sample(sigma, sample).reshape(-1)
    sigma_next = _per_sample(sigma_next, sample).reshape(-1)
    return linear_gaussian_step(coefficients_fn(sigma, sigma_next, noise_level, sigma_max), velocity, sample,
                                prev_sample, generator)


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Euler-Maruyama step of the marginal-preserving reverse SDE (Flow-GRPO).

    With dt = sigma_next - sigma (< 0) and a = ``noise_level``:
        std_dev_t = a * sqrt(sigma / (1 - s)),  s = sigma, or s = sigma_max where sigma == 1
        mean      = x * (1 + std_dev_t^2 * dt / (2 sigma)) + v * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt
        x_next    = mean + std_dev_t * sqrt(-dt) * eps,  eps ~ N(0, I)
    Equivalently x + [v - std_dev_t^2 / 2 * score] dt with score = -(x + (1 - sigma) v) / sigma. With a = 0
    this is the deterministic Euler step x + v dt.

    Args:
        velocity: model output v, [B, ...].
        sample: current x at ``sigma``, [B, ...].
        sigma, sigma_next: per-sample noise levels, shape [B] (or scalars).
        noise_level: a, the SDE noise scale.
        prev_sample: if given, it is not drawn but scored: its log-prob under this step is returned
            (the re-evaluation used by the policy ratio).
        generator: for the draw of eps.
        sigma_max: the scheduler's sigmas[1]; used in place of sigma in (1 - s) where sigma == 1, which
            would otherwise divide by zero. Required when any sigma equals 1 and noise_level > 0.

    Returns:
        (prev_sample [B, ...] in sample's dtype, log_prob [B] float32, prev_sample_mean [B, ...] float32,
         std_dev_t [B, 1, ...] float32).
    """
    return _step(sde_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator,
                 sigma_max)


def cps_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficient-preserving sampling (CPS) step.

        std = sigma_next * sin(a * pi / 2),  x0 = x - sigma v,  x1 = x + (1 - sigma) v
        mean = (1 - sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1,  x_next = mean + std * eps
    The injected noise replaces part of the predicted noise, so the total noise coefficient stays
    sigma_next. Returns the same 4-tuple as ``sde_step_with_logprob``; the 4th item is ``std``.
    ``sigma_max`` is accepted for a common signature and not needed (nothing divides by 1 - sigma).
    """
    return _step(cps_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator,
                 sigma_max)


def eta_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: float = 0.7,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Constant-eta variant of the SDE step: the step's standard deviation is eta * sqrt(sigma - sigma_next).

    Written as ``sde_step_with_logprob`` with std_dev_t = eta, so that std_dev_t * sqrt(-dt) =
    eta * sqrt(sigma - sigma_next) and the drift keeps the marginal-preserving score correction.
    ``sigma_max`` is accepted for a common signature and not needed (nothing divides by 1 - sigma).
    """
    return _step(eta_coefficients, velocity, sample, sigma, sigma_next, noise_level, prev_sample, generator,
                 sigma_max)


STEP_FUNCTIONS = {
    "sde": sde_step_with_logprob,
    "cps": cps_step_with_logprob,
    "eta": eta_step_with_logprob,
}
"""Registry of flow step functions, chosen by ``sampler.kind`` in the algorithm config."""

COEFFICIENTS = {"sde": sde_coefficients, "cps": cps_coefficients, "eta": eta_coefficients}
"""The same steps' constants, for ``scheduled_flow_step``."""


class ScheduledStep:
    """A step bound to a schedule t[0..T] and called with step indices: ``constants(noise_level)`` gives its
    per-step constants for all T steps at once (a NamedTuple of [T] tensors), gathered by index and shaped by
    ``shaped_coefficients``; ``mean(shaped, output, sample)`` computes the step's mean from them and
    ``shaped_step`` draws and scores around it. So a rollout step runs only its full-size kernels (7 for the
    flow steps, where diffusers' Euler step runs 6, one a host sync) where computing the constants per call
    would add some 35 small ones; for an int index the shaped views are kept too, so the step spends no host
    time shaping them. On a GPU, at small models, launches and host time are the cost.
    """

    def __init__(self, constants: Callable[[float], NamedTuple],
                 mean: Callable[[NamedTuple, torch.Tensor, torch.Tensor], torch.Tensor]):
        self._constants, self._mean = constants, mean
        self._tables: dict[float, tuple[type, torch.Tensor]] = {}
        self._shaped: dict[tuple, NamedTuple] = {}
        """Rollout steps (an int index): the shaped views per (noise level, index, batch, ndim), so that a
        step spends no host time on the dozen reshapes that shaping takes."""

    def __call__(self, output: torch.Tensor, sample: torch.Tensor, index: int | torch.Tensor, noise_level: float,
                 prev_sample: torch.Tensor | None = None, generator: torch.Generator | None = None):
        """``index``: the step (an int, or [B] per sample); returns (prev_sample, log_prob [B], mean, kl_std)."""
        return shaped_step(self._mean, self._shaped_constants(index, noise_level, sample), output, sample,
                           prev_sample, generator)

    def mean(self, output: torch.Tensor, sample: torch.Tensor, index: int | torch.Tensor,
             noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, kl_std) of the step alone, without drawing or scoring a sample (a reference's KL term)."""
        c = self._shaped_constants(index, noise_level, sample)
        return self._mean(c, output, sample), c.kl_std

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


def scheduled_flow_step(kind: str, schedule: torch.Tensor, sigma_max: float | torch.Tensor | None = None) -> ScheduledStep:
    """``STEP_FUNCTIONS[kind]`` bound to ``schedule``: index i steps sigma = t[i] -> sigma_next = t[i + 1]."""
    schedule, coefficients = schedule.to(torch.float32), COEFFICIENTS[kind]
    return ScheduledStep(lambda noise_level: coefficients(schedule[:-1], schedule[1:], noise_level, sigma_max),
                         flow_mean)
