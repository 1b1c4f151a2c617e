"""The estimators and losses of PPO-with-critic, online DPO, best-of-group SFT and DiffusionNFT, and the
EMA and reference refresh, on fixed tensors with hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.algorithms.base import LossContext, Rewards, balanced_local, refresh_reference, shares_weights
from trainer.algorithms.core_algos import (
    best_and_worst,
    diffusion_dpo_loss,
    gae,
    nft_loss,
    optimality_probability,
)
from trainer.algorithms.nft import NFTConfig, old_decay, schedule_draws, x0_error_scale
from trainer.algorithms.ppo_critic import ValueNetwork, condition_vector
from trainer.ema import EMA
from trainer.kernels import KernelCounter
from trainer.models.base import Conditioning
from trainer.models.flow import rectified_flow_target
from trainer.models.reference import ReferenceSpec


def test_gae_with_lambda_one_is_reward_minus_value():
    values = torch.tensor([[0.2, 0.5], [0.0, -1.0]])
    adv, returns = gae(torch.tensor([1.0, 2.0]), values, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5], [2.0, 3.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))


def test_gae_with_lambda_half():
    # delta_1 = r - V_1 = 0.5; delta_0 = V_1 - V_0 = 0.3; A_0 = 0.3 + 0.5 * 0.5 = 0.55
    adv, returns = gae(torch.tensor([1.0]), torch.tensor([[0.2, 0.5]]), lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.55, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[0.75, 1.0]]))


def test_diffusion_dpo_loss_hand_value_and_weights():
    # margin = (0.1 - 0.2) - (0.3 - 0.2) = -0.2; loss = -log sigmoid(-0.5 * 10 * -0.2) = log(1 + e^-1)
    loss, stats = diffusion_dpo_loss(
        torch.tensor([0.1]), torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.2]), beta=10.0
    )
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1)), rel=1e-6)
    assert stats["dpo_ranking_acc"].item() == 1.0 and stats["dpo_margin"].item() == pytest.approx(-0.2)
    # a padding pair (weight 0) changes nothing
    padded, _ = diffusion_dpo_loss(
        torch.tensor([0.1, 5.0]),
        torch.tensor([0.3, 0.0]),
        torch.tensor([0.2, 0.0]),
        torch.tensor([0.2, 0.0]),
        beta=10.0,
        weights=torch.tensor([1.0, 0.0]),
    )
    assert padded.item() == pytest.approx(loss.item(), rel=1e-6)
    # statistics over the real pairs alone, without reading a value back (a wait for the GPU per unit)
    with KernelCounter() as counter:
        _, stats = diffusion_dpo_loss(
            torch.tensor([0.1, 0.5, 5.0]),
            torch.tensor([0.3, 0.1, 0.0]),
            torch.tensor([0.2, 0.2, 0.0]),
            torch.tensor([0.2, 0.2, 0.0]),
            beta=10.0,
            weights=torch.tensor([1.0, 1.0, 0.0]),
        )
    assert stats["dpo_ranking_acc"].item() == 0.5 and stats["dpo_margin"].item() == pytest.approx((-0.2 + 0.4) / 2)
    assert not {"_local_scalar_dense", "nonzero"} & set(counter.ops)
    _, none = diffusion_dpo_loss(*torch.ones(4, 2), beta=1.0, weights=torch.zeros(2))
    assert none["dpo_ranking_acc"].item() == 0.0 and none["dpo_margin"].item() == 0.0
    # with the policy equal to the reference the loss is log 2 whatever the losses are
    same, _ = diffusion_dpo_loss(
        torch.tensor([0.4]), torch.tensor([0.9]), torch.tensor([0.4]), torch.tensor([0.9]), 1e3
    )
    assert same.item() == pytest.approx(math.log(2))


def test_best_and_worst_skips_failed_and_flat_groups():
    r = torch.tensor([0.1, 0.9, 0.5, float("nan"), 0.3, 0.3, 0.7, float("nan")])
    g = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    groups, best, worst = best_and_worst(r, g)
    assert groups.tolist() == [0] and best.tolist() == [1] and worst.tolist() == [0]


def test_nft_loss_hand_values_and_no_gradient_at_the_old_policy_for_neutral_samples():
    v_theta, v_old, v = torch.ones(1, 2), torch.zeros(1, 2), torch.full((1, 2), 2.0)
    # beta 0.5: v+ = 0.5 -> (0.5 - 2)^2 = 2.25; v- = -0.5 -> (-0.5 - 2)^2 = 6.25
    assert nft_loss(v_theta, v_old, v, torch.tensor([1.0]), 0.5).item() == pytest.approx(2.25)
    assert nft_loss(v_theta, v_old, v, torch.tensor([0.0]), 0.5).item() == pytest.approx(6.25)
    assert nft_loss(v_theta, v_old, v, torch.tensor([0.5]), 0.5).item() == pytest.approx(4.25)
    theta = torch.full((1, 2), 0.3, requires_grad=True)
    nft_loss(theta, theta.detach(), v, torch.tensor([0.5]), 1.0).sum().backward()
    assert theta.grad.abs().max().item() == pytest.approx(0.0, abs=1e-7)
    theta.grad = None  # a good sample pulls towards the target
    nft_loss(theta, theta.detach(), v, torch.tensor([1.0]), 1.0).sum().backward()
    assert (theta.grad < 0).all()


def test_nft_loss_adaptive_weight_divides_each_samples_error_by_its_own_mean_absolute_error():
    """With error scale k = 0.5 the clean-sample errors are e = 0.5 (v+- - v): l = mean(e^2) / mean|e|, the
    divisor held constant (no gradient through it), floored at 1e-5 (an exact prediction: loss 0, finite grads)."""
    v_theta, v_old, v = torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([[2.0, 4.0]])
    k = torch.tensor([0.5])
    # beta 0.5: e+ = 0.5 ([0.5, 0.5] - v) = [-0.75, -1.75]: 1.8125 / 1.25; e- = 0.5 ([-0.5, -0.5] - v): 3.3125 / 1.75
    assert nft_loss(v_theta, v_old, v, torch.tensor([1.0]), 0.5, k).item() == pytest.approx(1.45)
    assert nft_loss(v_theta, v_old, v, torch.tensor([0.0]), 0.5, k).item() == pytest.approx(3.3125 / 1.75)
    theta = v_theta.clone().requires_grad_()
    nft_loss(theta, v_old, v, torch.tensor([1.0]), 0.5, k).sum().backward()
    # d/dtheta mean(e^2) / 1.25 with de/dtheta = k beta = 0.25: 2 e 0.25 / (2 * 1.25)
    torch.testing.assert_close(theta.grad, torch.tensor([[-0.75, -1.75]]) * 0.25 / 1.25)
    exact = torch.full((1, 2), 2.0, requires_grad=True)
    loss = nft_loss(exact, exact.detach(), exact.detach(), torch.tensor([0.7]), 1.0, k)
    loss.sum().backward()
    assert loss.item() == 0.0 and torch.isfinite(exact.grad).all()


def test_x0_error_scale_is_sigma_for_flow_models_and_the_noise_ratio_for_epsilon_ones():
    sigma = torch.tensor([1.0, 0.6, 0.05])
    torch.testing.assert_close(x0_error_scale(rectified_flow_target, sigma), sigma)
    abar = torch.tensor([0.01, 0.5, 0.99])  # DDPM: x_t = sqrt(abar) x0 + sqrt(1 - abar) eps, target eps

    def ddpm(x0, eps, u):
        a = abar.reshape(-1, 1)
        return a.sqrt() * x0 + (1 - a).sqrt() * eps, eps

    torch.testing.assert_close(x0_error_scale(ddpm, sigma), ((1 - abar) / abar).sqrt())


def test_nft_trains_distinct_levels_of_the_rollout_schedule_per_sample():
    """9 of a 10-step schedule's levels (never its final 0) per sample, each once, in orders that differ between
    samples, with fresh noise per draw; more draws than levels: each level once."""
    sigmas = torch.linspace(1.0, 0.0, 11)
    x0 = torch.zeros(5, 3)
    assert schedule_draws(sigmas[::2], x0, 9, torch.Generator().manual_seed(0)).sigma.shape == (5, 5)
    draws = schedule_draws(sigmas, x0, 9, torch.Generator().manual_seed(0))
    assert draws.sigma.shape == (9, 5) and draws.noise.shape == (9, 5, 3)
    for column in draws.sigma.T:
        assert len(set(column.tolist())) == 9 and set(column.tolist()) <= set(sigmas[:-1].tolist())
    assert len({tuple(column.tolist()) for column in draws.sigma.T}) > 1


def test_nft_old_policy_decay_ramps_after_its_delay():
    config = NFTConfig(old_decay=0.9, old_decay_rate=0.1, old_decay_delay=3)
    assert [old_decay(config, n) for n in (0, 2, 3, 4, 8, 20)] == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.5, 0.9])
    assert old_decay(NFTConfig(old_decay=0.3, old_decay_rate=0.0), 1) == 0.3  # rate 0: the cap from the start


def test_optimality_probability():
    r = optimality_probability(torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0]), scale=1.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))


def test_balanced_local_pads_every_rank_to_the_largest_share():
    rewards = lambda rank: Rewards(torch.zeros(4), torch.zeros(8), torch.zeros(8, dtype=torch.long), 4 * rank)  # noqa: E731
    selected = torch.tensor([[1, 0], [2, 3], [6, 5]])
    rows0, w0 = balanced_local(selected, rewards(0))
    rows1, w1 = balanced_local(selected, rewards(1))
    assert rows0.tolist() == [[1, 0], [2, 3]] and w0.tolist() == [1.0, 1.0]
    assert rows1.tolist() == [[2, 1], [0, 0]] and w1.tolist() == [1.0, 0.0]


def test_refresh_reference_copies_then_averages():
    policy = nn.Linear(2, 1)
    ctx = LossContext(None, policy, ReferenceSpec().build(policy))  # a view of the policy's weights (LoRA-disabled)
    assert not ctx.reference.holds_weights and shares_weights(ctx.reference, policy)
    refresh_reference(ctx)
    assert ctx.reference.holds_weights and not shares_weights(ctx.reference, policy)
    assert torch.equal(ctx.reference.net.weight, policy.weight) and not ctx.reference.net.weight.requires_grad
    old = ctx.reference.net.weight.clone()
    with torch.no_grad():
        policy.weight.add_(1.0)
    refresh_reference(ctx, decay=0.75)
    torch.testing.assert_close(ctx.reference.net.weight, 0.75 * old + 0.25 * policy.weight.detach())


def test_ema_updates_every_k_steps_and_swaps_in_for_evaluation():
    w = torch.tensor([1.0, 2.0])
    ema = EMA([w], decay=0.5, every=2)
    w.add_(2.0)
    ema.step(1)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.0, 2.0]))  # not an update step
    ema.step(2)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([2.0, 3.0]))
    with ema.swapped():
        torch.testing.assert_close(w, torch.tensor([2.0, 3.0]))
    torch.testing.assert_close(w, torch.tensor([3.0, 4.0]))
    restored = EMA([torch.zeros(2)], decay=0.5, every=1)
    restored.load_state(ema.state())
    torch.testing.assert_close(restored.shadow[0], ema.shadow[0])
    with pytest.raises(ValueError, match=r"tensor 0 is \(2,\) where this rank's shard is \(1,\): .* parallel.backend"):
        EMA([torch.zeros(1)], decay=0.5, every=1).load_state(ema.state())  # a shard of another layout
    with pytest.raises(ValueError, match="ema_decay"):
        EMA([w], decay=1.0, every=1)


def test_value_network_input_shapes():
    cond = Conditioning(embeds={"prompt_embeds": torch.ones(3, 7, 5), "pooled": torch.full((3, 4), 2.0)})
    vec = condition_vector(cond)
    assert vec.shape == (3, 9) and vec[0, :4].eq(2.0).all() and vec[0, 4:].eq(1.0).all()  # sorted by name
    net = ValueNetwork(latent_numel=3 * 16 * 16, cond_dim=9, hidden=8, latent_features=64)
    assert net(torch.randn(3, 3, 16, 16), torch.rand(3), vec).shape == (3,)


def ragged_text(lengths: list[int], width: int = 2) -> Conditioning:
    """Qwen-Image-style conditioning: row i holds ``lengths[i]`` tokens of value i + 1, right-padded."""
    length = max(lengths)
    mask = (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()
    embeds = (torch.arange(len(lengths), dtype=torch.float32)[:, None, None] + 1) * mask[..., None].float()
    return Conditioning(
        embeds={"e": embeds.expand(-1, -1, width), "m": mask, "pooled": torch.ones(len(lengths), 3)},
        ragged=("e", "m"),
        text_mask="m",
        padded=min(lengths) < length,
    )


def test_ragged_text_concatenates_padded_and_pools_over_real_tokens():
    short, long = ragged_text([2, 2]), ragged_text([3, 5])
    assert not short.padded and long.padded
    whole = Conditioning.cat([short, long])
    assert whole.embeds["e"].shape == (4, 5, 2) and whole.embeds["m"].shape == (4, 5)
    assert whole.padded and whole.ragged == ("e", "m") and whole.text_mask == "m"
    assert whole.embeds["m"].sum(1).tolist() == [2, 2, 3, 5]
    assert whole.embeds["e"][:2, 2:].eq(0).all() and torch.equal(whole.embeds["e"][2:], long.embeds["e"])
    assert torch.equal(whole.embeds["pooled"], torch.ones(4, 3))
    assert Conditioning.cat([short, short]).padded is False
    rows = whole.select(torch.tensor([0, 1]))
    assert rows.padded and rows.text_mask == "m" and rows.embeds["e"].shape == (2, 5, 2)
    # the mean over real tokens is the row's value, whatever the padded length; the mask is no feature
    vec = condition_vector(whole)
    assert vec.shape == (4, 2 + 3)
    torch.testing.assert_close(vec[:, 0], torch.tensor([1.0, 2.0, 1.0, 2.0]))
    torch.testing.assert_close(condition_vector(short), vec[:2])


@pytest.mark.parametrize(
    ("units", "steps", "sizes"), [(8, 3, [2, 3, 3]), (4, 3, [1, 1, 2]), (2, 4, [1, 1]), (6, 1, [6]), (0, 2, [])]
)
def test_units_split_into_the_configured_steps_of_nearly_equal_size(units, steps, sizes):
    """4 units in 3 steps used to give 2 steps (of 2): chunks of ceil(4 / 3)."""
    from trainer.algorithms.clean_sample import split_units

    split = split_units(list(range(units)), steps)
    assert [len(s) for s in split] == sizes and [u for s in split for u in s] == list(range(units))
