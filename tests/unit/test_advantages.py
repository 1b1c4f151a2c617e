"""Advantage estimators and policy-loss terms on fixed tensors with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms.clean_sample import logit_normal_sigmas
from trainer.algorithms.core_algos import (
    batch_advantages,
    clipped_policy_loss,
    denoising_loss,
    gaussian_mean_kl,
    group_advantages,
    zero_std_share,
)


def test_group_advantages_per_group_std():
    r = torch.tensor([1.0, 3.0, 10.0, 10.0])
    g = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, g, global_std=False)
    # group 0: mean 2, std 1 -> (-1, 1) / (1 + 1e-4); group 1: no spread -> 0
    torch.testing.assert_close(adv, torch.tensor([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0]))


def test_group_advantages_global_std_and_clip():
    r = torch.tensor([0.0, 2.0, 4.0, 8.0])
    g = torch.tensor([0, 0, 1, 1])
    std = r.std(unbiased=False).item()  # sqrt(8.75)
    adv = group_advantages(r, g, global_std=True)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (std + 1e-4))
    clipped = group_advantages(torch.tensor([0.0, 0.0, 0.0, 100.0]), torch.zeros(4, dtype=torch.long), clip=1.5)
    assert clipped.max().item() == 1.5 and clipped.min().item() == pytest.approx(
        -1 / math.sqrt(3) / (1 + 1e-4 * 4 / 100 / math.sqrt(3)), rel=1e-3
    )


def test_failed_rewards_get_zero_advantage_and_are_left_out_of_the_statistics():
    r = torch.tensor([1.0, float("nan"), 3.0, 5.0])
    g = torch.tensor([0, 0, 0, 1])
    adv = group_advantages(r, g, global_std=False)
    assert adv[1].item() == 0.0
    torch.testing.assert_close(adv[[0, 2]], torch.tensor([-1.0, 1.0]) / 1.0001)
    assert adv[3].item() == 0.0  # a group of one has no spread


def test_failed_rewards_are_left_out_of_the_global_std():
    """GRPO's default (and PPO's batch) normalisation: the batch std is over the valid rewards alone.
    Valid rewards 1, 3, 2, 6: mean 3, squared deviations 4, 0, 1, 9, population std sqrt(14 / 4)."""
    nan = float("nan")
    r = torch.tensor([1.0, nan, 3.0, 2.0, 6.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    std = math.sqrt(3.5)
    adv = group_advantages(r, g, global_std=True)
    assert adv[1].item() == 0.0
    # group 0 (1, 3): mean 2; group 1 (2, 6): mean 4; both over the batch std
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0]) / (std + 1e-4))
    batch = batch_advantages(r)
    assert batch[1].item() == 0.0
    torch.testing.assert_close(batch, torch.tensor([-2.0, 0.0, 0.0, -1.0, 3.0]) / (std + 1e-4))


def test_batch_advantages_and_zero_std_share():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(1.25)
    torch.testing.assert_close(batch_advantages(r), (r - 2.5) / (std + 1e-4))
    assert zero_std_share(torch.tensor([1.0, 1.0, 2.0, 3.0]), torch.tensor([0, 0, 1, 1])) == 0.5


def test_clipped_policy_loss_hand_values():
    adv = torch.tensor([1.0, -1.0, 2.0])
    old = torch.zeros(3)
    new = torch.log(torch.tensor([1.5, 1.5, 0.5]))
    loss, stats = clipped_policy_loss(adv, new, old, clip_range=0.2)
    # sample 0: max(-1.5, -1.2) = -1.2; sample 1: max(1.5, 1.2) = 1.5; sample 2: max(-1.0, -1.6) = -1.0
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 1.0) / 3, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(1.0)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3, rel=1e-6)


def test_clipped_policy_loss_gradient_on_policy_is_minus_advantage():
    logp = torch.zeros(2, requires_grad=True)
    loss, stats = clipped_policy_loss(torch.tensor([2.0, -1.0]), logp, torch.zeros(2), clip_range=1e-4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 0.5]))
    assert stats["ratio"].item() == 1.0 and stats["clip_frac"].item() == 0.0


def test_clipped_policy_loss_gradient_is_zero_where_the_clip_binds():
    """The clip binds above 1 + eps for A > 0 and below 1 - eps for A < 0: no gradient there, and
    -A d(ratio)/d(logp) = -A ratio everywhere else (the other side of each, and A = 0 gives 0)."""
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0, 0.0])
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.5])
    logp = torch.log(ratio).requires_grad_()
    loss, _ = clipped_policy_loss(adv, logp, torch.zeros(5), clip_range=0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5, 0.0, 3.0, 0.0]) / 5)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.6 + 3.0 + 0.0) / 5, abs=1e-6)


def test_gaussian_mean_kl_drops_dt():
    mean = torch.ones(2, 1, 2, 2)
    ref = torch.zeros(2, 1, 2, 2)
    std = torch.tensor([0.5, 1.0]).view(2, 1, 1, 1)
    torch.testing.assert_close(gaussian_mean_kl(mean, ref, std), torch.tensor([1 / (2 * 0.25), 1 / 2]))


def test_denoising_loss_and_logit_normal():
    pred, target = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    target[1] = 3.0
    assert denoising_loss(pred, target).item() == pytest.approx((1 + 4) / 2)
    assert denoising_loss(pred, target, torch.tensor([3.0, 1.0])).item() == pytest.approx((3 + 4) / 4)
    s = logit_normal_sigmas(20000, 0.0, 1.0, torch.Generator().manual_seed(0))
    assert 0 < s.min() and s.max() < 1 and s.median().item() == pytest.approx(0.5, abs=0.02)


def test_clipped_policy_loss_with_weights_averages_over_the_kept_samples():
    """Flow-GRPO drops zero-advantage samples before averaging: weights 0 leave them out of the mean, so
    the loss (and gradient) is the kept samples' mean, 3/2 times the mean over all three here."""
    adv = torch.tensor([1.0, 0.0, -2.0])
    logp = torch.log(torch.tensor([1.5, 1.0, 0.5])).requires_grad_()
    loss, _ = clipped_policy_loss(adv, logp, torch.zeros(3), 0.2, weights=torch.tensor([1.0, 0.0, 1.0]))
    # sample 0: max(-1.5, -1.2) = -1.2; sample 2: max(1.0, 1.6) = 1.6
    assert loss.item() == pytest.approx((-1.2 + 1.6) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, 0.0]))  # both clipped
    kept, _ = clipped_policy_loss(adv, torch.zeros(3), torch.zeros(3), 0.2, weights=torch.tensor([1.0, 0.0, 1.0]))
    full, _ = clipped_policy_loss(adv, torch.zeros(3), torch.zeros(3), 0.2)
    assert kept.item() == pytest.approx(1.5 * full.item())
    empty, _ = clipped_policy_loss(adv, torch.zeros(3), torch.zeros(3), 0.2, weights=torch.zeros(3))
    assert empty.item() == 0.0


def test_critic_advantages_normalise_over_the_trained_steps_of_scored_samples():
    from trainer.algorithms.core_algos import critic_advantages

    rewards = torch.tensor([1.0, float("nan"), 0.0])
    values = torch.tensor([[0.0, 0.5], [0.2, 0.2], [0.0, 0.0]])
    adv, returns = critic_advantages(rewards, values, 1.0, torch.tensor([0]), clip=5.0)
    # lam = gamma = 1: A_t = r - V_t, so at step 0: 1 and 0 (mean 0.5, std 0.5); the failed sample gets 0
    scale = 0.5 + 1e-4
    expected = torch.tensor([[0.5 / scale, 0.0 / scale], [0.0, 0.0], [-0.5 / scale, -0.5 / scale]])
    assert torch.allclose(adv, expected)
    assert torch.equal(returns, torch.tensor([[1.0, 1.0], [0.2, 0.2], [0.0, 0.0]]))  # R = A + V; V where it failed


def test_reward_loss_and_clean_prediction_on_fixed_values():
    """-r and relu(2 - r); the flow clean prediction x - sigma v from the affine training target."""
    from trainer.algorithms.core_algos import predicted_clean, reward_loss

    rewards = torch.tensor([0.5, 2.0, 3.0, -1.0])
    assert reward_loss(rewards, "negative").tolist() == [-0.5, -2.0, -3.0, 1.0]
    assert reward_loss(rewards, "hinge", 2.0).tolist() == [1.5, 0.0, 0.0, 3.0]
    flow = lambda x0, noise, s: ((1 - s[:, None]) * x0 + s[:, None] * noise, noise - x0)  # noqa: E731
    x, v, sigma = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]]), torch.tensor([0.25])
    assert predicted_clean(flow, x, v, sigma).tolist() == [[0.875, 2.25]]
