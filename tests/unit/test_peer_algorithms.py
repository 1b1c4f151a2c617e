"""The losses of GRPO-Guard, MixGRPO, AWM and DGPO on fixed tensors with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.core_algos import guard_log_ratio
from trainer.samplers.flow_sde import sde_step_with_logprob


def test_guard_log_ratio_hand_values():
    """x_next = (1, 3), old mean (0, 1), std 2: eps = (0.5, 1); mean - old mean = (0.2, -0.4):
    log r~ = mean(0.5 * 0.2, 1 * -0.4) = (0.1 - 0.4) / 2 = -0.15."""
    x_next = torch.tensor([[1.0, 3.0]])
    got = guard_log_ratio(x_next, torch.tensor([[0.2, 0.6]]), torch.tensor([[0.0, 1.0]]), torch.tensor([2.0]))
    torch.testing.assert_close(got, torch.tensor([-0.15]))


def test_guard_log_ratio_is_the_debiased_rescaled_gaussian_log_ratio():
    """log r~ = s (log p_theta - log p_old) + mean((mu_theta - mu_old)^2) / (2 s), s = std_dev_t sqrt(-dt),
    on the SDE step's own log-probabilities; at mu_theta = mu_old it is exactly 0."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.4, 0.1])
    x_next, logp_old, mean_old, std_dev_t = sde_step_with_logprob(v, x, sigma, sigma_next, 0.7, generator=g)
    _, logp, mean, _ = sde_step_with_logprob(
        v + 0.05 * torch.randn(v.shape, generator=g), x, sigma, sigma_next, 0.7, prev_sample=x_next
    )
    s = std_dev_t.reshape(-1) * torch.sqrt(sigma - sigma_next)
    expected = s * (logp - logp_old) + ((mean - mean_old) ** 2).mean(dim=(1, 2, 3)) / (2 * s)
    torch.testing.assert_close(guard_log_ratio(x_next, mean, mean_old, s), expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(guard_log_ratio(x_next, mean_old, mean_old, s), torch.zeros(3))
    # the plain log-ratio is biased below 0 (its first term); the normalised one is not, and is s times smaller
    assert bool((logp - logp_old < expected / s).all())


def test_guard_step_weight_is_one_over_minus_dt():
    """Schedule (1, 0.75, 0.25, 0): steps 0 and 1 have -dt = 0.25 and 0.5, so weights 4 and 2."""
    from trainer.algorithms.core_algos import guard_step_weight

    schedule = torch.tensor([1.0, 0.75, 0.25, 0.0])
    torch.testing.assert_close(guard_step_weight(schedule, torch.tensor([0, 1, 0])), torch.tensor([4.0, 2.0, 4.0]))


@pytest.mark.parametrize(
    ("wrap", "windows"),
    [
        (False, [(0, 3), (0, 3), (1, 3), (1, 3), (2, 2), (2, 2), (3, 1), (3, 1), (3, 1), (3, 1)]),
        (True, [(0, 3), (0, 3), (1, 3), (1, 3), (2, 2), (2, 2), (3, 1), (3, 1), (0, 3), (0, 3)]),
    ],
)
def test_mixgrpo_window_slides_by_stride_every_shift_shrinks_at_the_tail_and_stops_or_wraps(wrap, windows):
    """T = 6 steps, window w = 3: windows end before step T - 2 = 4, so starts 0..3, the last two shrunk to 2
    and 1 steps; one step every 2 epochs; with stride 2 the starts are 0 and 2."""
    from trainer.algorithms.mixgrpo import sde_window

    assert [sde_window(epoch, 3, 1, 2, 6, wrap) for epoch in range(10)] == windows
    assert [sde_window(epoch, 3, 2, 1, 6, wrap) for epoch in range(3)] == [(0, 3), (2, 2), (0, 3) if wrap else (2, 2)]


def test_awm_loss_hand_values_and_on_policy_gradient():
    """log p = -w mean((v - target)^2): sample 0 mse 1, sample 1 mse 0.25 (v_old's: 1 and 1). Uniform (w = 1):
    the log-ratios are 0 and 0.75; A = (1, 1), eps = 0.2: the first is unclipped (-1), the second clipped (-1.2).
    The sigma weighting (w = sigma) scales the on-policy gradient by sigma."""
    from trainer.algorithms.core_algos import awm_loss

    target = torch.zeros(2, 4)
    v_old = torch.ones(2, 4)
    v_theta = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    loss, stats = awm_loss(v_theta, v_old, target, torch.tensor([1.0, 1.0]), torch.ones(2), 0.2)
    assert loss.item() == pytest.approx((-1.0 - 1.2) / 2)
    assert stats["clip_frac"].item() == 0.5
    # on policy (v_theta = v_old) the ratio is 1 and the gradient is A w d mse / d v / B = A w 2 (v - target) / (n B)
    v = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    adv, w = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    loss, stats = awm_loss(v, v.detach(), target, adv, w, 1e-4, weighting="sigma")
    assert stats["ratio"].item() == 1.0
    loss.backward()
    torch.testing.assert_close(v.grad, (adv * w)[:, None] * 2 * v.detach() / (4 * 2))


def test_dgpo_loss_hand_values_and_gradient():
    """One group of two: A = (1, -1), deltas l_theta - l_ref = (0.01, -0.02), beta = 100:
    s = 100 / 2 (0.01 + 0.02) = 1.5, weight sigmoid(1.5). The authors' form: L = sigmoid(s) mean(A l_theta),
    gradient sigmoid(s) A / G on l_theta; softplus: L = log(1 + e^1.5), gradient beta times that. A second group
    at the reference (deltas 0) has weight 1/2 and softplus L = log 2."""
    from trainer.algorithms.core_algos import dgpo_loss

    loss_ref = torch.tensor([[0.5, 0.5], [0.3, 0.7]])
    adv = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    grads = {}
    for form in ("sigmoid_weighted", "softplus"):
        loss_theta = torch.tensor([[0.51, 0.48], [0.3, 0.7]], requires_grad=True)
        per_group, weight = dgpo_loss(loss_theta, loss_ref, adv, 100.0, form)
        torch.testing.assert_close(weight, torch.tensor([1 / (1 + math.exp(-1.5)), 0.5]))
        if form == "softplus":
            torch.testing.assert_close(per_group, torch.tensor([math.log(1 + math.exp(1.5)), math.log(2.0)]))
        else:
            torch.testing.assert_close(per_group, weight * (adv * loss_theta.detach()).mean(dim=1))
        per_group.sum().backward()
        grads[form] = loss_theta.grad
    torch.testing.assert_close(grads["sigmoid_weighted"], weight[:, None] * adv / 2)
    torch.testing.assert_close(grads["softplus"], 100.0 * grads["sigmoid_weighted"])


def test_dgpo_clip_detaches_the_losses_past_the_clip_in_their_advantages_direction():
    """ratio = exp(l_old - l): (1.05, 0.95, 1.05, 0.95) at eps 0.02; A = (1, 1, -1, -1): the first (A > 0, ratio
    above 1 + eps) and the fourth (A < 0, below 1 - eps) are detached, the others keep their gradient."""
    from trainer.algorithms.core_algos import clip_denoising_loss

    loss = torch.tensor([0.5, 0.5, 0.5, 0.5], requires_grad=True)
    old = 0.5 + torch.log(torch.tensor([1.05, 0.95, 1.05, 0.95]))
    clipped_loss, clipped = clip_denoising_loss(loss, old, torch.tensor([1.0, 1.0, -1.0, -1.0]), 0.02)
    assert clipped.tolist() == [True, False, False, True]
    clipped_loss.sum().backward()
    assert loss.grad.tolist() == [0.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [
        ("uniform", -0.25),
        ("sigma", -0.5 * 0.25),
        ("sigma**2", -0.25 * 0.25),
        ("huber", -0.5 * (math.sqrt(0.25 + 1e-10) - 1e-5)),
        ("ghuber", -0.5 * ((0.25 + 1e-10) ** 0.5 - 1e-5) / 0.5),
    ],
)
def test_awm_time_weightings_hand_values(weighting, expected):
    """log p = -w(sigma, e) at e = 0.25, sigma = 0.5 (ghuber with p = 1/2 is huber times 2)."""
    from trainer.algorithms.core_algos import matching_log_prob

    got = matching_log_prob(torch.tensor([0.25]), torch.tensor([0.5]), weighting, 0.5)
    assert got.item() == pytest.approx(expected, rel=1e-6)
