"""MixGRPO-Flash's ODE steps after the SDE window: DPM-Solver++(2M) against the closed-form probability-flow ODE
of Gaussian data (second order, where Euler is first), and the compressed schedule around a window."""

from __future__ import annotations

import pytest
import torch

from trainer.rollout import SamplerSettings
from trainer.samplers.multistep import compress_after_window, dpm_solver_2m_step, second_order_steps

MU, S = 0.7, 0.3
"""Data x0 ~ N(MU, S^2) per element: x_sigma = (1 - sigma) x0 + sigma eps is Gaussian with mean (1 - sigma) MU and
std(sigma) = sqrt((1 - sigma)^2 S^2 + sigma^2), and the ODE's flow keeps each point's standardised value."""


def _std(sigma: float) -> float:
    return ((1 - sigma) ** 2 * S**2 + sigma**2) ** 0.5


def _velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """The exact flow-matching velocity (x - E[x0 | x]) / sigma of Gaussian data."""
    x0 = MU + (1 - sigma) * S**2 / _std(sigma) ** 2 * (x - (1 - sigma) * MU)
    return (x - x0) / sigma


def _solve(num_steps: int, order: int, start: float = 0.8, end: float = 0.2) -> float:
    """Max error at sigma = ``end`` after ``num_steps`` even steps from the exact points at sigma = ``start``,
    against the closed form (the window ends below sigma = 1, where lambda is infinite)."""
    sigmas = torch.linspace(start, end, num_steps + 1, dtype=torch.float64).tolist()
    z = torch.linspace(-2, 2, 9)
    x, prev_x0 = (1 - start) * MU + _std(start) * z, None
    for i in range(num_steps):
        v = _velocity(x, sigmas[i])
        x_next = dpm_solver_2m_step(
            v, x, prev_x0 if order == 2 else None, sigmas[i - 1] if i else 1.0, sigmas[i], sigmas[i + 1]
        )
        prev_x0, x = x - sigmas[i] * v, x_next
    exact = (1 - end) * MU + _std(end) * z
    return float((x - exact).abs().max())


def test_second_order_on_gaussian_data_where_euler_is_first_order():
    """Halving the step divides DPM-Solver++(2M)'s error by about 4 (observed order 2) and Euler's by about 2."""
    steps = (10, 20, 40, 80)
    euler, multistep = [_solve(n, 1) for n in steps], [_solve(n, 2) for n in steps]
    assert all(1.8 < a / b < 2.2 for a, b in zip(euler, euler[1:], strict=False))
    assert all(3.6 < a / b < 5.5 for a, b in zip(multistep, multistep[1:], strict=False))
    assert multistep[0] < euler[0] / 8


def test_without_history_and_at_sigma_zero_the_step_is_euler():
    x, v = torch.randn(2, 3), torch.randn(2, 3)
    euler = x + (0.3 - 0.5) * v
    assert torch.allclose(dpm_solver_2m_step(v, x, None, 0.7, 0.5, 0.3), euler, atol=1e-6)
    assert torch.allclose(dpm_solver_2m_step(v, x, torch.randn(2, 3), 0.7, 0.5, 0.0), x - 0.5 * v, atol=1e-6)
    # with the history on a straight trajectory (x0 predictions equal) the correction is zero
    assert torch.allclose(dpm_solver_2m_step(v, x, x - 0.5 * v, 0.7, 0.5, 0.3), euler, atol=1e-6)


def test_compression_keeps_the_window_and_the_steps_before_it():
    sigmas = torch.linspace(1, 0, 11)
    stochastic = torch.tensor([i in (2, 3) for i in range(10)])
    short, mask = compress_after_window(sigmas, stochastic, 0.5)  # 6 steps after the window -> 3
    assert torch.equal(short, sigmas[[0, 1, 2, 3, 4, 6, 8, 10]])
    assert mask.tolist() == [False, False, True, True, False, False, False]
    assert second_order_steps(mask, 2).tolist() == [False] * 4 + [True, True, False]
    assert not second_order_steps(mask, 1).any()
    assert compress_after_window(sigmas, stochastic, 1.0)[0] is sigmas
    one, _ = compress_after_window(sigmas, stochastic, 0.01)  # at least one step: the jump to sigma = 0
    assert torch.equal(one, sigmas[[0, 1, 2, 3, 4, 10]])


def test_ode_options_need_an_sde_window():
    with pytest.raises(ValueError, match="set sampler.sde_window > 0"):
        SamplerSettings(ode_order=2)
    SamplerSettings(sde_window=2, ode_order=2, ode_compress=0.4)


def test_a_deterministic_rollout_takes_second_order_steps_throughout():
    """At noise_level 0 every step is an ODE step: ode_order 2 takes DPM-Solver++(2M) on all but the last (the
    first, without history, is first order); compressing needs a window still."""
    assert second_order_steps(torch.zeros(5, dtype=torch.bool), 2).tolist() == [True] * 4 + [False]
    SamplerSettings(ode_order=2, noise_level=0.0)
    with pytest.raises(ValueError, match="ode_compress=0.5 acts on the ODE steps after an SDE window"):
        SamplerSettings(ode_compress=0.5, noise_level=0.0)
