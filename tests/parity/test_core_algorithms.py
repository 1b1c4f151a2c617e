"""Parity of the core algorithms with the authors' training code: GRPO (Flow-GRPO), PPO (DDPO), PPO with a critic
(verl's GAE and value loss), online DPO (Diffusion-DPO), the supervised warm-up (diffusers' SD3 fine-tuning) and
best-of-group SFT (Flow-GRPO's SFT), each transcribed below from the commit its ``Source`` names.

The losses run on the tiny real model (tests/conftest.py's ``tiny_model_dir``): a rollout, its rewards, then our
algorithm's optimizer step (the sum of its units' losses) and the transcription of the authors' loop over the
same trained (sample, step) pairs with the same model forwards; loss and gradients must agree, or keep the exact
relation docs/departures.md states.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_steps import _flow_grpo_sde_step
from transcribed import Source, transcribes
from warm_start import tiny_trainer

from trainer.algorithms.base import Rewards
from trainer.algorithms.clean_sample import logit_normal_sigmas
from trainer.algorithms.core_algos import batch_advantages, group_advantages
from trainer.algorithms.ppo_critic import condition_vector
from trainer.rollout import Rollout
from trainer.trainer import Trainer

FLOW_GRPO_TRAIN = Source(
    "yifan123/flow_grpo",
    "74db69191de9a0a54869c9c3341ce4b54db7005f",
    "scripts/train_sd3.py",
    "main (advantages: flow_grpo/stat_tracking.py PerPromptStatTracker.update; the GRPO loss)",
)
DDPO_TRAIN = Source(
    "kvablack/ddpo-pytorch",
    "1958463f020112c9a7bc85768d296daacc2e1b4b",
    "scripts/train.py",
    "main (advantages without per-prompt tracking; the PPO loss)",
)
VERL = Source(
    "volcengine/verl",
    "012be9d9dcb7c38499f23616142870d2682757fc",
    "verl/trainer/ppo/core_algos.py",
    "compute_gae_advantage_return, compute_value_loss",
)
DIFFUSION_DPO = Source(
    "SalesforceAIResearch/DiffusionDPO",
    "5233e75919f912f3f631958ee4ebb5b5204382d9",
    "train.py",
    "main (the train_method == 'dpo' loss)",
)
DIFFUSERS_SD3 = Source(
    "huggingface/diffusers",
    "01310e78bf9862c563cd6f273560e6264b709ea7",
    "examples/dreambooth/train_dreambooth_sd3.py",
    "main (the flow-matching loss)",
)
FLOW_GRPO_SFT = Source(
    "yifan123/flow_grpo",
    "ac4c86e8cae021841f1fde853d340e0db67690dd",
    "scripts/train_sd3_sft.py",
    "main (advantages: flow_grpo/stat_tracking.py update, type 'sft'; the weighted loss)",
)

STEPS = 4
"""Denoising steps of the rollouts: steps 0-2 are trained (the last one never is, nor in Flow-GRPO's recipes,
whose timestep_fraction 0.99 trains int(0.99 T) = T - 1 of them)."""


def _trainer(run_dir: Path, model_dir: str, algorithm: str, *extra: str) -> Trainer:
    """Three prompts of three samples each (unless ``extra`` says otherwise), sampled in STEPS steps, all of them
    stochastic (no SDE window)."""
    return tiny_trainer(
        run_dir,
        model_dir,
        f"algorithm.name={algorithm}",
        "algorithm.group_size=3",
        f"algorithm.sampler.num_steps={STEPS}",
        "algorithm.sampler.sde_window=0",
        "algorithm.sampler.window_range=[0,0]",
        "data.prompts_per_epoch=3",
        "train.warmup_steps=0",
        "train.epochs=1",
        "eval.every=0",
        "logging.progress=false",
        *extra,
        log=False,
    )


def _rollout(trainer: Trainer, noise_level: float | None = None) -> tuple[Rollout, torch.Tensor]:
    """The first epoch's rollout (after the algorithm's ``start_epoch``) and its group ids."""
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    trainer.algorithm.start_epoch(trainer.ctx, 0)
    ro, _, _ = trainer.sample_and_score(
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    assert len(set(prompts)) == len(set(group_ids.tolist())), "a group is one prompt, as Flow-GRPO groups them"
    return ro, group_ids


def _perturb(trainer: Trainer, scale: float = 0.02) -> None:
    """Move the policy's trainable weights off the rollout's (and the reference's): ratios leave 1, the KL is > 0."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.adapter.trainable.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.adapter.trainable.parameters()]


def _our_step(trainer: Trainer, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Our algorithm's first optimizer step off the rollout's weights: (its loss, the gradients). The batch's first
    plan, whose first step would run at the rollout's weights (log p_old: its own forward), is made and left."""
    trainer.algorithm.plan(batch, torch.Generator().manual_seed(2))
    units = trainer.algorithm.plan(batch, torch.Generator().manual_seed(3))[0]
    trainer.policy.zero_grad()
    loss = sum(trainer.algorithm.loss(trainer.ctx, unit)[0] for unit in units)
    loss.backward()
    return loss.detach(), _grads(trainer)


def _assert_grads(ours: list[torch.Tensor], theirs: list[torch.Tensor], scale: float = 1.0) -> None:
    """Equal to float32 round-off: relative 1e-4, or 1e-5 of the tensor's largest entry (sums accumulated in
    another order, e.g. over micro-batches, differ there)."""
    assert any(g.abs().sum() > 0 for g in theirs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, scale * b, rtol=1e-4, atol=1e-5 * float(b.abs().max() * scale) + 1e-12)


# --- GRPO: Flow-GRPO -------------------------------------------------------------------------------------


def _flow_grpo_advantages(prompts: list[str], rewards: np.ndarray, global_std: bool) -> np.ndarray:
    """yifan123/flow_grpo flow_grpo/stat_tracking.py ``PerPromptStatTracker.update`` (type "grpo", fresh stats:
    train_sd3.py clears them every epoch), transcribed for one reward per sample (theirs repeats it per step)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) if global_std else np.std(prompt_rewards, axis=0, keepdims=True)
        advantages[prompts == prompt] = (prompt_rewards - mean) / (std + 1e-4)
    return advantages


def _flow_grpo_loss(trainer, ro, advantages, steps, config, keep=None):
    """yifan123/flow_grpo@74db6919 scripts/train_sd3.py, its training loop over one batch of every kept sample:
    at each trained step j, ``compute_log_prob`` (the model's velocity, then ``sde_step_with_logprob`` scoring
    the stored next latent), the reference's mean with no gradient where beta > 0, then
        ratio = exp(log_prob - old_log_prob), policy_loss = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))
        kl_loss = mean(mean_elements((mean - mean_ref)^2) / (2 std_dev_t^2)),  loss = policy_loss + beta kl_loss
    each backward divided by the accumulation count (accelerate: gradient_accumulation_steps x len(steps), one
    batch here). ``keep``: the samples whose advantages are not all 0 (theirs drops the others before training).
    Returns (loss, gradients)."""
    keep = torch.ones(len(advantages), dtype=torch.bool) if keep is None else keep
    adapter, ref = trainer.adapter, trainer.ctx.reference
    b = int(keep.sum())
    x, cond = ro.latents[keep], ro.cond.select(torch.nonzero(keep).flatten())
    adv = torch.clamp(advantages[keep], -config.adv_clip, config.adv_clip)
    trainer.policy.zero_grad()
    total = 0.0
    for j in steps:
        sigma, index = ro.sigmas[j].expand(b), torch.full((b,), j)
        v = adapter.predict(trainer.policy, x[:, j], sigma, cond, ro.guidance_scale)
        _, log_prob, mean, std_dev_t = _flow_grpo_sde_step(
            v, x[:, j], ro.sigmas, index, ro.noise_level, prev_sample=x[:, j + 1]
        )
        ratio = torch.exp(log_prob - ro.log_probs[keep][:, j])
        clipped = -adv * torch.clamp(ratio, 1.0 - config.clip_range, 1.0 + config.clip_range)
        loss = torch.mean(torch.maximum(-adv * ratio, clipped))
        if config.kl_beta > 0:
            with torch.no_grad():
                v_ref = adapter.predict(ref, x[:, j], sigma, cond, ro.guidance_scale)
                _, _, mean_ref, _ = _flow_grpo_sde_step(
                    v_ref, x[:, j], ro.sigmas, index, ro.noise_level, prev_sample=x[:, j + 1]
                )
            dims = tuple(range(1, mean.ndim))
            kl = ((mean - mean_ref) ** 2).mean(dim=dims, keepdim=True) / (2 * std_dev_t**2)
            loss = loss + config.kl_beta * torch.mean(kl)
        (loss / len(steps)).backward()
        total += float(loss.detach()) / len(steps)
    return torch.tensor(total), _grads(trainer)


@pytest.mark.parametrize("global_std", [True, False])
@transcribes("algorithm:grpo", source=FLOW_GRPO_TRAIN)
def test_grpo_advantages_are_flow_grpos_stat_trackers(global_std):
    """Six prompts of four samples, one group flat: our advantages equal Flow-GRPO's (per-prompt mean, the global
    or the prompt's population std + 1e-4), clipped to [-5, 5] as its loss clamps them."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g) * torch.tensor([1.0, 3.0]).repeat(12)
    rewards[4:8] = 0.25
    group_ids = torch.arange(24) // 4
    prompts = [f"prompt {int(i)}" for i in group_ids]
    theirs = np.clip(_flow_grpo_advantages(prompts, rewards.numpy(), global_std), -5, 5)
    ours = group_advantages(rewards, group_ids, global_std=global_std, clip=5.0)
    torch.testing.assert_close(ours, torch.as_tensor(theirs, dtype=torch.float32), rtol=1e-6, atol=1e-6)


@transcribes("algorithm:grpo", source=FLOW_GRPO_TRAIN)
def test_grpo_loss_and_gradient_are_flow_grpos(tmp_path, tiny_model_dir):
    """Off the rollout's weights (ratios away from 1, some clipped) and the reference's (KL > 0): our GRPO step's
    loss and gradients are Flow-GRPO's training loop's on the same samples, steps and model forwards."""
    trainer = _trainer(tmp_path, tiny_model_dir, "grpo", "algorithm.kl_beta=0.04", "algorithm.timestep_fraction=0.99")
    algo = trainer.algorithm
    trainer._new_reference()
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    _perturb(trainer)
    advantages = torch.as_tensor(_flow_grpo_advantages(ro.prompts, rewards.numpy(), global_std=True)).float()
    steps = range(int(STEPS * 0.99))  # Flow-GRPO's num_train_timesteps: our trainable steps 0..T-2
    with torch.no_grad():  # a clip range that binds for some (sample, step) pairs and not for others
        ratios = [(_flow_grpo_loss_ratio(trainer, ro, j)).abs() for j in steps]
    algo.config.clip_range = float(torch.cat(ratios).median())
    theirs, their_grads = _flow_grpo_loss(trainer, ro, advantages, steps, algo.config)
    ours, our_grads = _our_step(trainer, batch)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    _assert_grads(our_grads, their_grads)


def _flow_grpo_loss_ratio(trainer, ro, j) -> torch.Tensor:
    """|ratio - 1| at step j for every sample (to choose a clip range that binds for about half of them)."""
    b = len(ro.prompts)
    v = trainer.adapter.predict(trainer.policy, ro.latents[:, j], ro.sigmas[j].expand(b), ro.cond, ro.guidance_scale)
    log_prob = _flow_grpo_sde_step(
        v, ro.latents[:, j], ro.sigmas, torch.full((b,), j), ro.noise_level, prev_sample=ro.latents[:, j + 1]
    )[1]
    return torch.exp(log_prob - ro.log_probs[:, j]) - 1


@pytest.mark.parametrize("drop", [True, False])
@transcribes("algorithm:grpo", source=FLOW_GRPO_TRAIN)
def test_grpo_with_a_flat_group_drops_its_samples_as_flow_grpo_with_drop_zero_advantage(tmp_path, tiny_model_dir, drop):
    """One group of three is flat (advantage 0). Flow-GRPO drops its samples before training: with
    ``algorithm.drop_zero_advantage=true`` our step is its step; by default they stay in our mean, so our loss and
    gradients are its times kept / all = 6 / 9 (the departure docs/departures.md states)."""
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        "grpo",
        f"algorithm.drop_zero_advantage={str(drop).lower()}",
        "algorithm.timestep_fraction=0.99",
        "algorithm.clip_range=1e-3",
    )
    algo = trainer.algorithm
    ro, group_ids = _rollout(trainer)
    rewards = torch.where(group_ids == group_ids[0], 0.5, torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7]))
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    _perturb(trainer)
    advantages = torch.as_tensor(_flow_grpo_advantages(ro.prompts, rewards.numpy(), global_std=True)).float()
    keep = advantages != 0
    assert int(keep.sum()) == 6
    theirs, their_grads = _flow_grpo_loss(trainer, ro, advantages, range(STEPS - 1), algo.config, keep)
    ours, our_grads = _our_step(trainer, batch)
    scale = 1.0 if drop else 6 / 9
    torch.testing.assert_close(ours, scale * theirs, rtol=1e-5, atol=1e-7)
    _assert_grads(our_grads, their_grads, scale)


# --- PPO: DDPO -------------------------------------------------------------------------------------------


def _ddpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """kvablack/ddpo-pytorch@1958463f scripts/train.py, advantages without per-prompt stat tracking (our PPO's
    no-grouping baseline): (r - mean) / (std + 1e-8) over the gathered batch (numpy's population std)."""
    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)


def _ddpo_loss(trainer, ro, advantages, steps, config):
    """The same file's training loop ("ppo logic") over one batch, transcribed: at each trained step j, the
    log-probability of the stored next latent under the current model, then
        loss = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))),  A clamped to [-adv_clip_max, adv_clip_max]
    each backward divided by the accumulation count. DDPO shuffles every sample's steps and trains the first
    int(T timestep_fraction) of them; ``steps`` is the draw of its shuffle that trains steps 0..T-2 of every
    sample (ours never trains the last step). Its DDIM step is the scorer there; on this flow model the step the
    rollout took is (Flow-GRPO's SDE step, the same Gaussian log-density)."""
    return _flow_grpo_loss(trainer, ro, advantages, steps, config)


@transcribes("algorithm:ppo", source=DDPO_TRAIN)
def test_ppo_loss_and_gradient_are_ddpos_with_its_advantage_epsilon_relation(tmp_path, tiny_model_dir):
    """Our PPO's advantages are DDPO's with 1e-4 in place of its 1e-8 beside the batch std (Flow-GRPO's own
    no-tracking branch uses 1e-4): ours = theirs (std + 1e-8) / (std + 1e-4); every one scales alike, so our loss
    and gradients are DDPO's times that factor, the clipped objective being linear in A at fixed ratios."""
    trainer = _trainer(tmp_path, tiny_model_dir, "ppo", "algorithm.clip_range=1e-3")
    algo = trainer.algorithm
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    _perturb(trainer)
    r64 = rewards.double().numpy()
    theirs_adv = _ddpo_advantages(r64)
    factor = (r64.std() + 1e-8) / (r64.std() + 1e-4)
    torch.testing.assert_close(
        batch_advantages(rewards, 5.0).double(), torch.as_tensor(theirs_adv * factor), rtol=1e-6, atol=1e-7
    )
    theirs, their_grads = _ddpo_loss(trainer, ro, torch.as_tensor(theirs_adv).float(), range(STEPS - 1), algo.config)
    ours, our_grads = _our_step(trainer, batch)
    torch.testing.assert_close(ours, factor * theirs, rtol=1e-5, atol=1e-7)
    _assert_grads(our_grads, their_grads, factor)


# --- PPO with a critic: verl --------------------------------------------------------------------------------


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """volcengine/verl@012be9d9 verl/trainer/ppo/core_algos.py ``compute_gae_advantage_return``, transcribed, with
    the whitening (verl/utils/torch_functional.py ``masked_whiten``: (A - mean) rsqrt(var + 1e-8), var the
    Bessel-corrected masked variance) left to ``_verl_whiten``: returns (advantages before it, returns)."""
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    return advantages, advantages + values


def _verl_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8), var


def _verl_value_loss(vpreds, returns, values, cliprange_value):
    """The same file's ``compute_value_loss`` (token-mean over an all-ones mask), transcribed."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    return 0.5 * torch.max((vpreds - returns) ** 2, (vpredclipped - returns) ** 2).mean()


@pytest.mark.parametrize("lam", [1.0, 0.9])
@transcribes("algorithm:ppo_critic", source=VERL)
def test_ppo_critic_gae_and_value_loss_are_verls(tmp_path, tiny_model_dir, lam):
    """The reward arrives after the last denoising step (verl's token-level reward at the last token): our returns
    are verl's GAE returns; our advantages are verl's whitened over the trained steps up to the normaliser (ours:
    population std + 1e-4; verl: sqrt(Bessel-corrected var + 1e-8)); our value term (value_coef 0.5 times the MSE)
    is verl's value loss where its value clipping does not bind (a departure: we do not clip values)."""
    trainer = _trainer(tmp_path, tiny_model_dir, "ppo_critic", f"algorithm.gae_lambda={lam}")
    algo = trainer.algorithm
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    values = algo.values(ro)
    token_rewards = torch.zeros_like(values)
    token_rewards[:, -1] = rewards
    raw, returns = _verl_gae(token_rewards, values, torch.ones_like(values), 1.0, lam)
    torch.testing.assert_close(batch.returns, returns, rtol=1e-6, atol=1e-6)
    trained = torch.zeros_like(values)
    trained[:, : STEPS - 1] = 1  # the steps we train (verl whitens over every response token it trains)
    whitened, var = _verl_whiten(raw, trained)
    std = raw[:, : STEPS - 1].std(unbiased=False)
    factor = torch.sqrt(var + 1e-8) / (std + 1e-4)
    torch.testing.assert_close(
        batch.advantages[:, : STEPS - 1],
        (factor * whitened)[:, : STEPS - 1].clamp(-5, 5),
        rtol=1e-5,
        atol=1e-6,
    )
    unit = algo.plan(batch, torch.Generator().manual_seed(2))[0][0]
    _, stats = algo.loss(trainer.ctx, unit)
    vpreds = algo.critic(
        ro.latents[unit.indices, unit.steps],
        ro.sigmas[unit.steps],
        condition_vector(ro.cond.select(unit.indices)),
    )
    unit_returns = batch.returns[unit.indices, unit.steps]
    old = values[unit.indices, unit.steps]
    theirs = _verl_value_loss(vpreds, unit_returns, old, cliprange_value=1e9)
    torch.testing.assert_close(algo.config.value_coef * stats["value_loss"], theirs, rtol=1e-5, atol=1e-8)


# --- online DPO: Diffusion-DPO ------------------------------------------------------------------------------


def _diffusion_dpo_loss(model_pred, ref_pred, target, beta_dpo):
    """SalesforceAIResearch/DiffusionDPO@5233e759 train.py, the ``train_method == 'dpo'`` loss, transcribed: the
    batch is winners then losers at a shared noise and noise level;
        model_diff = l_theta(w) - l_theta(l),  ref_diff = l_ref(w) - l_ref(l),  l = mean_elements((pred - target)^2)
        loss = -mean(logsigmoid(-0.5 beta (model_diff - ref_diff)))"""
    model_losses = (model_pred - target).pow(2).mean(dim=tuple(range(1, target.ndim)))
    model_losses_w, model_losses_l = model_losses.chunk(2)
    ref_losses = (ref_pred - target).pow(2).mean(dim=tuple(range(1, target.ndim)))
    ref_losses_w, ref_losses_l = ref_losses.chunk(2)
    inside_term = -0.5 * beta_dpo * ((model_losses_w - model_losses_l) - (ref_losses_w - ref_losses_l))
    return -1 * F.logsigmoid(inside_term).mean(), (inside_term > 0).float().mean()


@transcribes("algorithm:dpo", source=DIFFUSION_DPO)
def test_dpo_loss_and_gradient_are_diffusion_dpos(tmp_path, tiny_model_dir):
    """Each group's best and worst samples (by reward) form a pair; noised with the same noise at the same level
    (the flow-matching x_sigma = (1 - sigma) x0 + sigma eps, target eps - x0, in place of DDPM's add_noise and
    epsilon target), our DPO unit's loss, ranking accuracy and gradients are Diffusion-DPO's."""
    trainer = _trainer(tmp_path, tiny_model_dir, "dpo", "algorithm.noise_draws=1", "algorithm.beta=200")
    algo = trainer.algorithm
    ro, group_ids = _rollout(trainer)  # start_epoch: the reference is the policy as the epoch starts
    _perturb(trainer)
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (unit,) = algo.plan(batch, torch.Generator().manual_seed(2))[0]
    winners, losers = batch.pairs[unit.pairs, 0], batch.pairs[unit.pairs, 1]
    assert len(winners) == 3
    for w, lose in zip(winners.tolist(), losers.tolist(), strict=True):  # the best and the worst of each group
        members = torch.nonzero(group_ids == group_ids[w]).flatten()
        assert w == int(members[rewards[members].argmax()]) and lose == int(members[rewards[members].argmin()])
    trainer.policy.zero_grad()
    loss, stats = algo.loss(trainer.ctx, unit)
    (loss / unit.share).backward()
    our_grads = _grads(trainer)

    samples = torch.cat([winners, losers])
    x0, sigma, noise = ro.latents[samples, -1], unit.sigma.repeat(2), torch.cat([unit.noise, unit.noise])
    s = sigma.view(-1, *[1] * (x0.ndim - 1))
    noisy, target, cond = (1 - s) * x0 + s * noise, noise - x0, ro.cond.select(samples)
    trainer.policy.zero_grad()
    model_pred = trainer.adapter.predict(trainer.policy, noisy, sigma, cond, 1.0)
    with torch.no_grad():
        ref_pred = trainer.adapter.predict(trainer.ctx.reference, noisy, sigma, cond, 1.0)
    theirs, implicit_acc = _diffusion_dpo_loss(model_pred, ref_pred, target, algo.config.beta)
    theirs.backward()
    torch.testing.assert_close(stats["dpo_loss"], theirs.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(stats["dpo_ranking_acc"], implicit_acc)
    _assert_grads(our_grads, _grads(trainer))


# --- the supervised warm-up: diffusers' SD3 fine-tuning ---------------------------------------------------------


def _diffusers_sd3_sigmas(u: torch.Tensor, shift: float = 3.0) -> torch.Tensor:
    """diffusers@01310e78 examples/dreambooth/train_dreambooth_sd3.py: indices = (u * 1000).long() into the SD3
    scheduler's training grid (FlowMatchEulerDiscreteScheduler(shift=3) as created: 1000 noise levels from
    shift(1) down to shift(1 / 1000)), then ``get_sigmas``; u is ``compute_density_for_timestep_sampling``'s
    logit-normal draw."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    indices = (u * scheduler.config.num_train_timesteps).long()
    return scheduler.sigmas[indices]


def _diffusers_sd3_loss(model_pred, noisy, x0, noise, sigmas, precondition_outputs):
    """The same file's loss (weighting_scheme "logit_normal": weighting 1), transcribed: with
    ``precondition_outputs`` (its default, 1) the prediction is turned into x0's, -sigma pred + x_sigma, and the
    target is x0; without, the target is eps - x0. loss = mean over samples of mean_elements((pred - target)^2)."""
    s = sigmas.view(-1, *[1] * (x0.ndim - 1))
    if precondition_outputs:
        model_pred = model_pred * (-s) + noisy
    target = x0 if precondition_outputs else noise - x0
    return torch.mean(((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


@transcribes("algorithm:sft", source=DIFFUSERS_SD3)
def test_warmup_loss_and_gradient_are_diffusers_sd3_flow_matching_loss(tmp_path, tiny_model_dir):
    """At the warm-up batch's own noise levels and noise, our supervised loss and gradients are diffusers' SD3
    flow-matching loss with precondition_outputs=0; its default (1) is the same loss weighted by sigma^2 per
    sample (the departure docs/departures.md states)."""
    trainer = _trainer(tmp_path, tiny_model_dir, "grpo", "warmup.batch_size=6", "warmup.micro_batch_size=4")
    g = torch.Generator().manual_seed(0)
    data = trainer.task.supervised_batch(6, g)
    batch = trainer.warmup.data_batch(trainer.adapter, data.images, data.prompts, g, data.inputs)
    trainer.policy.zero_grad()
    ours = sum(trainer.warmup.loss(trainer.ctx, unit)[0] for unit in trainer.warmup.plan(batch, g)[0])
    ours.backward()
    our_grads = _grads(trainer)

    s = batch.sigma.view(-1, *[1] * (batch.x0.ndim - 1))
    noisy = (1 - s) * batch.x0 + s * batch.noise
    trainer.policy.zero_grad()
    pred = trainer.adapter.predict(trainer.policy, noisy, batch.sigma, batch.cond, 1.0)
    theirs = _diffusers_sd3_loss(pred, noisy, batch.x0, batch.noise, batch.sigma, precondition_outputs=0)
    theirs.backward()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-8)
    _assert_grads(our_grads, _grads(trainer))
    per_sample = ((pred - (batch.noise - batch.x0)) ** 2).flatten(1).mean(1)
    preconditioned = _diffusers_sd3_loss(pred, noisy, batch.x0, batch.noise, batch.sigma, precondition_outputs=1)
    torch.testing.assert_close(preconditioned, (batch.sigma**2 * per_sample).mean(), rtol=1e-5, atol=1e-8)


@transcribes("algorithm:sft", source=DIFFUSERS_SD3)
def test_warmup_noise_levels_with_sigma_shift_are_diffusers_sd3_grid():
    """For the same standard-normal draws z, diffusers reads the SD3 grid at u = sigmoid(m + s z): noise level
    shift(1 - u), rounded down to the grid. With ``warmup.sigma_shift=3`` our levels are shift(sigmoid(m + s z)):
    theirs at -z (the same density for m = 0) to the grid's 1/1000 rounding; by default (1) we do not shift."""
    z = torch.randn(4000, generator=torch.Generator().manual_seed(0))
    u = torch.sigmoid(z)  # compute_density_for_timestep_sampling("logit_normal", logit_mean=0, logit_std=1)
    theirs = _diffusers_sd3_sigmas(torch.sigmoid(-z))
    ours = logit_normal_sigmas(4000, 0.0, 1.0, torch.Generator().manual_seed(0), shift=3.0)
    shift3 = lambda s: 3 * s / (1 + 2 * s)  # noqa: E731
    torch.testing.assert_close(ours, shift3(u))
    # theirs: level (1000 - floor(1000 (1 - u))) / 1000, in (u, u + 1/1000] up to round-off
    assert bool((theirs >= shift3(u - 1e-6)).all() and (theirs <= shift3(u + 1e-3 + 1e-6)).all())
    unshifted = logit_normal_sigmas(4000, 0.0, 1.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(unshifted, u)


# --- best-of-group SFT: Flow-GRPO's SFT ----------------------------------------------------------------


def _flow_grpo_sft_weights(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """yifan123/flow_grpo flow_grpo/stat_tracking.py ``PerPromptStatTracker.update`` with type "sft",
    transcribed: 1 for every sample whose reward is its prompt's maximum (ties: all of them), else 0."""
    prompts = np.array(prompts)
    weights = np.zeros(len(rewards))
    for prompt in np.unique(prompts):
        prompt_rewards = torch.tensor(rewards[prompts == prompt])
        weights[prompts == prompt] = (prompt_rewards == torch.max(prompt_rewards)).float().numpy()
    return weights


@transcribes("algorithm:sft_best", source=FLOW_GRPO_SFT)
def test_best_of_group_sft_is_flow_grpos_sft_up_to_its_mean_over_every_sample(tmp_path, tiny_model_dir):
    """Flow-GRPO's SFT trains the flow-matching loss weighted by 1 on each prompt's best sample and 0 elsewhere,
    a mean over every sample of the batch, one noise draw per trained "timestep" of its loop. Our default
    (uniform weights on each group's best sample) is that loss with the mean over the chosen samples: ours =
    theirs x N / chosen, in loss and gradients, for the same draws (rewards without ties)."""
    trainer = _trainer(tmp_path, tiny_model_dir, "sft_best", "algorithm.noise_draws=2")
    algo = trainer.algorithm
    assert algo.config.weighting == "uniform"
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.45, 0.7])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    units = algo.plan(batch, torch.Generator().manual_seed(2))[0]
    trainer.policy.zero_grad()
    ours = sum(algo.loss(trainer.ctx, unit)[0] for unit in units)
    ours.backward()
    our_grads = _grads(trainer)

    weights = torch.as_tensor(_flow_grpo_sft_weights(ro.prompts, rewards.numpy())).float()
    n, draws = len(rewards), algo.config.noise_draws
    trainer.policy.zero_grad()
    theirs = 0.0
    for d in range(draws):  # their loop's "timesteps": one fresh noise draw each, accumulated
        units_d = units[d * len(units) // draws : (d + 1) * len(units) // draws]
        samples = torch.cat([batch.samples[u.rows] for u in units_d])
        sigma, noise = torch.cat([u.draw.sigma for u in units_d]), torch.cat([u.draw.noise for u in units_d])
        x0 = ro.latents[samples, -1]
        s = sigma.view(-1, *[1] * (x0.ndim - 1))
        pred = trainer.adapter.predict(trainer.policy, (1 - s) * x0 + s * noise, sigma, ro.cond.select(samples), 1.0)
        weighted = weights[samples].view(-1, *[1] * (x0.ndim - 1)) * (pred.float() - (noise - x0).float()) ** 2
        loss = weighted.sum() / (n * x0[0].numel())  # theirs: the mean over all N samples (the rest weigh 0)
        (loss / draws).backward()
        theirs += float(loss.detach()) / draws
    chosen = int(weights.sum())
    assert chosen == 3
    torch.testing.assert_close(ours.detach(), torch.tensor(theirs * n / chosen), rtol=1e-5, atol=1e-8)
    _assert_grads(our_grads, _grads(trainer), n / chosen)


def test_sigma_shift_is_exact_at_one():
    """``shift`` = 1 leaves the logit-normal levels bit for bit as they were."""
    a = logit_normal_sigmas(64, 0.3, 0.8, torch.Generator().manual_seed(1))
    b = logit_normal_sigmas(64, 0.3, 0.8, torch.Generator().manual_seed(1), shift=1.0)
    assert torch.equal(a, b) and math.isfinite(float(a.sum()))
