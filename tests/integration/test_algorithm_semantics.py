"""What each algorithm's loss means, on the tiny real model: the KL penalty enters the policy-gradient loss
and its gradient, a rank's advantages are its own rows of the gathered batch's, and one optimizer step moves
the policy towards the samples its rewards favour."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from warm_start import tiny_trainer

from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import batch_advantages, gae, group_advantages, per_sample_mse
from trainer.rollout import Rollout
from trainer.trainer import Trainer


def _trainer(run_dir: Path, model_dir: str, algorithm: str, *extra: str) -> Trainer:
    """Two prompts of two samples each (unless ``extra`` says otherwise), sampled in four denoising steps."""
    return tiny_trainer(
        run_dir,
        model_dir,
        f"algorithm.name={algorithm}",
        "algorithm.group_size=2",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "data.prompts_per_epoch=2",
        "train.warmup_steps=0",
        "train.epochs=1",
        "eval.every=0",
        "logging.progress=false",
        *extra,
        log=False,
    )


def _rollout(trainer: Trainer) -> tuple[Rollout, torch.Tensor]:
    """The first epoch's rollout (after the algorithm's ``start_epoch``) and its group ids."""
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    trainer.algorithm.start_epoch(trainer.ctx, 0)
    ro, _, _ = trainer.sample_and_score(
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    return ro, group_ids


def _grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.adapter.trainable.parameters()]


# --- the KL penalty ---------------------------------------------------------------------------------


def test_the_kl_penalty_enters_the_policy_loss_and_its_gradient(tmp_path, tiny_model_dir):
    """Away from the reference (the policy's weights moved after the reference was taken), a unit's loss with
    kl_beta = b is its loss with kl_beta = 0 plus b * share * kl, and the difference of their gradients is the
    KL's: a small step against it brings the policy closer to the reference. At policy == reference, where
    every other test runs, the KL and its gradient are 0 and a loss without the term looks the same."""
    beta = 0.5
    trainer = _trainer(tmp_path, tiny_model_dir, "grpo", f"algorithm.kl_beta={beta}")
    algo = trainer.algorithm
    assert algo.needs_reference
    trainer._new_reference()  # as fit does when RL starts: a frozen copy of the (fully fine-tuned) policy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trainer.adapter.trainable.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = algo.plan(batch, torch.Generator().manual_seed(2))
    unit = units[0]
    assert 0 < unit.share < 1

    def loss_and_grads(kl_beta: float) -> tuple[torch.Tensor, dict, list[torch.Tensor]]:
        algo.config.kl_beta = kl_beta
        trainer.policy.zero_grad()
        loss, stats = algo.loss(trainer.ctx, unit)
        loss.backward()
        return loss.detach(), stats, _grads(trainer)

    with_kl, stats, grads_kl = loss_and_grads(beta)
    without, stats_0, grads_0 = loss_and_grads(0.0)
    kl = stats["kl"]
    assert "kl" not in stats_0 and float(kl) > 1e-3
    assert float(with_kl - without) == pytest.approx(beta * unit.share * float(kl), rel=1e-4)

    kl_grads = [(a - b) / (beta * unit.share) for a, b in zip(grads_kl, grads_0, strict=True)]
    norm = torch.sqrt(sum(gr.square().sum() for gr in kl_grads))
    assert norm > 0
    with torch.no_grad():
        for p, gr in zip(trainer.adapter.trainable.parameters(), kl_grads, strict=True):
            p.sub_(1e-2 * gr / norm)
        algo.config.kl_beta = beta
        _, after = algo.loss(trainer.ctx, unit)
    assert float(after["kl"]) < float(kl)


def test_dropping_zero_advantage_samples_averages_over_the_others(tmp_path, tiny_model_dir):
    """One of the two groups is flat (advantage 0): with ``drop_zero_advantage`` the step's loss is the mean
    over the other group's samples only, so its gradient is the default's (mean over all four) times 4 / 2,
    as in Flow-GRPO, which drops such samples before averaging."""
    trainer = _trainer(tmp_path, tiny_model_dir, "grpo", "algorithm.micro_batch_size=1")
    algo = trainer.algorithm
    ro, group_ids = _rollout(trainer)
    rewards = torch.where(group_ids == group_ids[0], 0.5, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    grads = []
    for drop in (False, True):
        algo.config.drop_zero_advantage = drop
        (units,) = algo.plan(
            algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0)), torch.Generator().manual_seed(2)
        )
        trainer.policy.zero_grad()
        sum(algo.loss(trainer.ctx, unit)[0] for unit in units).backward()
        grads.append(_grads(trainer))
    assert any(g.abs().sum() > 0 for g in grads[0])
    for kept, everything in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(kept, 2 * everything, rtol=1e-5, atol=1e-9)


# --- rank offsets -----------------------------------------------------------------------------------

EVERY = torch.tensor([0.0, 1.0, 0.7, 0.2, 0.4, 0.9, 0.5, 0.1, 0.3, 0.35, 0.8, 0.05])
GROUP_IDS_ALL = torch.arange(12) // 2


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "ppo_critic"])
def test_rank_1_gets_its_own_rows_of_the_gathered_advantages(tmp_path, tiny_model_dir, algorithm):
    """Rank 1 of two, with 6 samples each: its advantages are rows 6..11 of those of all 12 rewards (GRPO's
    groups and batch std, PPO's batch mean and std); rank 0's rows differ, so a slice from the start shows.
    PPO with a critic normalises its GAE advantages over this rank's own samples and steps: they come from
    this rank's rewards and values alone."""
    trainer = _trainer(tmp_path, tiny_model_dir, algorithm, "data.prompts_per_epoch=3")
    algo, config = trainer.algorithm, trainer.algorithm.config
    ro, _ = _rollout(trainer)
    assert ro.latents.shape[0] == 6
    batch = algo.make_batch(ro, Rewards(EVERY[6:12], EVERY, GROUP_IDS_ALL, 6))
    if algorithm == "ppo_critic":
        values = algo.values(ro)
        adv, _ = gae(EVERY[6:12], values, config.gae_lambda)
        trained = adv[:, batch.train_steps]
        expected = ((adv - trained.mean()) / (trained.std(unbiased=False) + 1e-4)).clamp(
            -config.adv_clip, config.adv_clip
        )
    else:
        if algorithm == "grpo":
            every = group_advantages(EVERY, GROUP_IDS_ALL, config.global_std, config.adv_clip)
        else:
            every = batch_advantages(EVERY, config.adv_clip)
        assert not torch.allclose(every[:6], every[6:])
        expected = every[6:12, None].expand(-1, ro.log_probs.shape[1])
    torch.testing.assert_close(batch.advantages, expected.to(batch.advantages))


# --- the direction of learning ---------------------------------------------------------------------


def _denoising_losses(trainer: Trainer, ro: Rollout, draws: int = 6) -> torch.Tensor:
    """[B]: each clean sample's denoising loss under the policy, averaged over fixed (noise level, noise) draws
    that are the same for every sample (one forward over all draws)."""
    x0 = ro.latents[:, -1]
    b = len(x0)
    sigma = torch.linspace(0.1, 0.9, draws).repeat_interleave(b)
    noise = torch.randn((draws, 1, *x0.shape[1:]), generator=torch.Generator().manual_seed(123))
    noise = noise.expand(-1, b, *x0.shape[1:]).reshape(draws * b, *x0.shape[1:])
    x_t, target = trainer.adapter.training_target(x0.repeat(draws, *[1] * (x0.ndim - 1)), noise, sigma)
    with torch.no_grad():
        v = trainer.adapter.predict(trainer.policy, x_t, sigma, ro.cond.select(torch.arange(b).repeat(draws)), 1.0)
    return per_sample_mse(v, target).reshape(draws, b).mean(0)


def _log_probs(trainer: Trainer, ro: Rollout, steps: torch.Tensor) -> torch.Tensor:
    """[B, K]: log p(x_{t+1} | x_t) of the rollout's own transitions at ``steps`` under the policy (one
    forward over all of them)."""
    b, k = ro.latents.shape[0], len(steps)
    rows, index = torch.arange(b).repeat(k), steps.repeat_interleave(b)
    x_t, x_next = ro.latents[rows, index], ro.latents[rows, index + 1]
    with torch.no_grad():
        v = trainer.adapter.predict(trainer.policy, x_t, ro.sigmas[index], ro.cond.select(rows), ro.guidance_scale)
        step_fn = trainer.adapter.step_function(ro.kind, ro.sigmas)
        log_prob = step_fn(v, x_t, index, ro.noise_level, prev_sample=x_next)[1]
    return log_prob.reshape(k, b).T


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
"""One better and one worse sample in each of the rollout's two groups (the sampler orders them 1, 0, 1, 0)."""


def _step_each_way(
    trainer: Trainer, ro: Rollout, group_ids: torch.Tensor, measure: Callable[[], torch.Tensor]
) -> tuple[list, list[torch.Tensor]]:
    """One optimizer step of the trainer on the rollout with ``REWARDS``, and one from the same weights (and
    fresh optimizer moments) with the rewards reversed (``1 - REWARDS``): the batches, and ``measure()`` after
    each step. Comparing the two cancels whatever a step does to every sample alike."""
    for g in torch.unique(group_ids):
        assert sorted(REWARDS[group_ids == g].tolist()) == [0.0, 1.0]
    start = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
    batches = [trainer.algorithm.make_batch(ro, Rewards(r, r, group_ids, 0)) for r in (REWARDS, 1 - REWARDS)]
    after = []
    for batch in batches:
        with torch.no_grad():
            for p, p0 in zip(trainer.adapter.trainable.parameters(), start, strict=True):
                p.copy_(p0)
        trainer.backend.reset_optimizer()
        stats = trainer._update(trainer.algorithm, batch, torch.Generator().manual_seed(2))
        assert stats["grad_norm"] > 0
        after.append(measure())
    return batches, after


def _pairs(group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(favoured, other) sample of each group under ``REWARDS``."""
    pairs = []
    for g in torch.unique(group_ids):
        members = torch.nonzero(group_ids == g).flatten()
        pairs.append(tuple(members[torch.argsort(REWARDS[members], descending=True)].tolist()))
    return pairs


@pytest.mark.parametrize("algorithm", ["dpo", "nft", "sft_best", "awm", "dgpo"])
def test_one_step_lowers_the_denoising_loss_of_the_favoured_samples(tmp_path, tiny_model_dir, algorithm):
    """In each group, one optimizer step lowers the denoising loss (at fixed noise) of the sample the rewards
    favour relative to the other's, more than the step on the reversed rewards does: DPO trains its pair's
    winner over its loser, NFT pulls towards samples of optimality above 1/2 and pushes from those below,
    best-of-group SFT regresses on the best, AWM weights the matching loss by the advantages, DGPO prefers
    the group's better part. (Within a group the two samples share a prompt, and a step towards one lowers
    the other's loss too: hence the comparison with the reversed step.)"""
    trainer = _trainer(tmp_path, tiny_model_dir, algorithm)
    if trainer.algorithm.needs_reference:
        trainer._new_reference()  # as RL starts (DGPO and NFT keep it; the others refresh it from the policy)
    ro, group_ids = _rollout(trainer)
    _, (favoured, reversed_) = _step_each_way(trainer, ro, group_ids, lambda: _denoising_losses(trainer, ro))
    change = favoured - reversed_
    for better, worse in _pairs(group_ids):
        assert change[better] < change[worse], (better, worse, change)


@pytest.mark.parametrize("algorithm", ["ppo", "ppo_critic", "grpo_guard"])
def test_one_step_raises_the_log_prob_of_positive_advantages(tmp_path, tiny_model_dir, algorithm):
    """In each group, one optimizer step raises the re-evaluated log-probability of the transitions (mean over
    the trained steps) of the sample with positive advantages relative to the other's, more than the step on
    the reversed rewards (which reverse the advantages' signs) does."""
    trainer = _trainer(tmp_path, tiny_model_dir, algorithm)
    ro, group_ids = _rollout(trainer)
    steps = trainer.algorithm.make_batch(ro, Rewards(REWARDS, REWARDS, group_ids, 0)).train_steps
    torch.testing.assert_close(_log_probs(trainer, ro, steps), ro.log_probs[:, steps])  # on policy
    batches, (favoured, reversed_) = _step_each_way(trainer, ro, group_ids, lambda: _log_probs(trainer, ro, steps))
    sign = 2 * REWARDS - 1  # +1 where REWARDS favours the sample
    for batch, s in zip(batches, (sign, -sign), strict=True):
        assert (batch.advantages[:, steps] * s[:, None] > 0).all()  # the rewards' order, step by step
    change = (favoured - reversed_).mean(1)
    for better, worse in _pairs(group_ids):
        assert change[better] > change[worse], (better, worse, change)


# --- DiffusionNFT's sampling policy -------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.5, 0.0])
def test_nft_samples_its_rollouts_with_the_old_policy(tmp_path, tiny_model_dir, decay):
    """After an optimizer step, the old policy is old <- d old + (1 - d) policy (d = old_decay from the first step
    at old_decay_rate 0): with d > 0 the epoch's rollout is the one the weights d start + (1 - d) stepped sample,
    not the stepped policy's, and the policy's weights are back unchanged after it. With d = 0 the old policy is
    the policy: its rollout, bit for bit (as the authors sample with their 'old' adapter, which then equals it).
    Before the hook, every rollout was the current policy's."""
    trainer = _trainer(tmp_path, tiny_model_dir, "nft", f"algorithm.old_decay={decay}", "algorithm.old_decay_rate=0")
    algo, params = trainer.algorithm, list(trainer.adapter.trainable.parameters())
    trainer._new_reference()  # the base model of the KL term, as RL starts
    ro, group_ids = _rollout(trainer)
    start = [p.detach().clone() for p in params]
    trainer._update(
        algo, algo.make_batch(ro, Rewards(REWARDS, REWARDS, group_ids, 0)), torch.Generator().manual_seed(2)
    )
    stepped = [p.detach().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(start, stepped, strict=True))
    algo.start_epoch(trainer.ctx, 1)
    assert algo.old_differs == (decay > 0)
    indices, group_ids = trainer.sampler.epoch(1)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]

    def sample() -> torch.Tensor:
        ro, _, _ = trainer.sample_and_score(
            prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        )
        return ro.latents

    rollout = sample()
    assert all(torch.equal(p, s) for p, s in zip(params, stepped, strict=True))
    algo.old_differs = False  # the policy's own rollout, with the weights written in by hand
    with torch.no_grad():
        for p, a, b in zip(params, start, stepped, strict=True):
            p.copy_(decay * a + (1 - decay) * b)
    by_hand = sample()
    with torch.no_grad():
        for p, s in zip(params, stepped, strict=True):
            p.copy_(s)
    policys = sample()
    torch.testing.assert_close(rollout, by_hand, rtol=1e-5, atol=1e-6)
    if decay > 0:
        assert (rollout - policys).abs().max() > 1e-3
    else:
        assert torch.equal(rollout, policys)
