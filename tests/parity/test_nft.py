"""Parity of DiffusionNFT (``algorithm.name=nft``) with the authors' training script, NVlabs/DiffusionNFT's
scripts/train_nft_sd3.py: the per-timestep loss (optimality from clipped advantages, implicit positive and
negative policies, adaptive x0-space weighting, c / beta scale, KL to the base model), the per-prompt advantages
it reads, and the old policy's lagged update with its decay schedule, each transcribed below from the commit
``NFT_TRAIN`` names.

Random tensors for the loss alone; the tiny real model (tests/conftest.py's ``tiny_model_dir``) for a whole unit
of ``NFT.loss`` and for the old policy over several epochs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transcribed import Source, transcribes
from warm_start import tiny_trainer

from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import group_advantages, nft_loss, optimality_probability, per_sample_mse
from trainer.algorithms.nft import NFTConfig, old_decay, x0_error_scale
from trainer.models.flow import rectified_flow_target
from trainer.rollout import SamplerSettings, rollout
from trainer.trainer import Trainer

COMMIT = "24af5554898d85e93efa492f42b5e9cdf4156e9b"
NFT_TRAIN = Source(
    "NVlabs/DiffusionNFT",
    COMMIT,
    "scripts/train_nft_sd3.py",
    "main (the per-timestep loss of the training loop)",
)
NFT_DECAY = Source(
    "NVlabs/DiffusionNFT",
    COMMIT,
    "scripts/train_nft_sd3.py",
    "return_decay, and main's update of the 'old' adapter after each epoch",
)
NFT_SOLVER = Source(
    "NVlabs/DiffusionNFT",
    COMMIT,
    "flow_grpo/diffusers_patch/solver.py",
    "run_sampling (solver 'dpm2', deterministic): dpm_step and the updates it calls",
)
NFT_ADVANTAGES = Source(
    "NVlabs/DiffusionNFT",
    COMMIT,
    "flow_grpo/stat_tracking.py",
    "PerPromptStatTracker.update (global_std=True, as config/base.py sets)",
)

DECAY_TYPES = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}
"""The authors' decay_type -> (flat, uprate, uphold) in ``return_decay``."""


def _authors_nft_loss(
    x0, t, noise, forward_prediction, old_prediction, ref_prediction, advantages, beta, adv_clip_max, kl_beta
):
    """One timestep's loss of one micro-batch in NVlabs/DiffusionNFT@24af555 scripts/train_nft_sd3.py ``main``
    (adv_mode "all"; the LoRA base for the reference), before the division by the accumulation steps."""
    dims = tuple(range(1, x0.ndim))
    t_b = t.view(-1, *([1] * (x0.ndim - 1)))
    xt = (1 - t_b) * x0 + t_b * noise
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    r = torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0, 1)
    positive = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    negative = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction

    def weighted(prediction):
        x0_hat = xt - t_b * prediction
        with torch.no_grad():
            weight = torch.abs(x0_hat.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
        return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)

    policy = r * weighted(positive) / beta + (1.0 - r) * weighted(negative) / beta
    kl = ((forward_prediction - ref_prediction) ** 2).mean(dim=dims)
    return (policy * adv_clip_max).mean() + kl_beta * torch.mean(kl)


def _authors_return_decay(step, decay_type):
    """NVlabs/DiffusionNFT@24af555 scripts/train_nft_sd3.py ``return_decay``."""
    flat, uprate, uphold = DECAY_TYPES[decay_type]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def _authors_per_prompt_advantages(prompts, rewards):
    """NVlabs/DiffusionNFT@24af555 flow_grpo/stat_tracking.py ``PerPromptStatTracker.update`` with global_std
    (a fresh tracker each epoch: ``clear`` follows every update)."""
    prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        mine = rewards[prompts == prompt]
        advantages[prompts == prompt] = (mine - np.mean(mine)) / (np.std(rewards) + 1e-4)
    return advantages


def _ours(x0, t, noise, v_theta, v_old, v_ref, advantages, config: NFTConfig):
    """Our loss of the same micro-batch: ``nft_loss`` on the forward process our flow adapters use, scaled and
    with the KL term as ``NFT.loss`` composes them (all rewards valid)."""
    _, target = rectified_flow_target(x0, noise, t)
    s = config.optimality_scale
    optimality = optimality_probability(advantages.clamp(-s, s), s)
    scale = x0_error_scale(rectified_flow_target, t)
    policy = nft_loss(v_theta, v_old, target, optimality, config.beta, scale).mean()
    return policy * config.loss_scale / config.beta + config.kl_weight * per_sample_mse(v_theta, v_ref).mean()


@transcribes("algorithm:nft", source=NFT_TRAIN)
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_the_loss_and_its_gradient_are_diffusionnfts_on_random_predictions(beta):
    """In float64: the authors' x0-space errors (x_t - t v - x0) cancel at small t in float32, ours do not."""
    g = torch.Generator().manual_seed(0)
    shape = (6, 4, 8, 8)
    x0, noise = (
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )
    t = torch.tensor([1.0, 0.93, 0.6, 0.31, 0.08, 0.002], dtype=torch.float64)
    v_old = noise - x0 + 0.3 * torch.randn(shape, generator=g)
    v_ref = noise - x0 + 0.3 * torch.randn(shape, generator=g)
    start = v_old + 0.2 * torch.randn(shape, generator=g)
    advantages = torch.tensor([-7.0, -2.0, -0.3, 0.0, 1.5, 6.0], dtype=torch.float64)  # beyond the clip of 5
    theirs_v, ours_v = start.clone().requires_grad_(), start.clone().requires_grad_()
    theirs = _authors_nft_loss(x0, t, noise, theirs_v, v_old, v_ref, advantages, beta, 5.0, 1e-4)
    ours = _ours(x0, t, noise, ours_v, v_old, v_ref, advantages, NFTConfig(beta=beta))
    theirs.backward()
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)  # k = t read off in float32
    torch.testing.assert_close(ours_v.grad, theirs_v.grad, rtol=1e-6, atol=1e-6 * theirs_v.grad.abs().max().item())


@transcribes("algorithm:nft", source=NFT_ADVANTAGES)
def test_optimality_from_the_gathered_rewards_is_diffusionnfts():
    """Per-prompt means, the whole batch's std (+ 1e-4), clipped to [-5, 5] and mapped to [0, 1] in the loss."""
    g = torch.Generator().manual_seed(1)
    group_ids = torch.arange(96) // 4
    rewards = torch.rand(96, generator=g, dtype=torch.float64)
    rewards[0] = 50.0  # an outlier beyond 5 batch stds of its group's mean: the clip acts
    theirs_adv = torch.from_numpy(
        _authors_per_prompt_advantages([f"p{i}" for i in group_ids.tolist()], rewards.numpy())
    )
    theirs = ((theirs_adv.clamp(-5.0, 5.0) / 5.0) / 2.0 + 0.5).clamp(0, 1)
    assert (theirs_adv.abs() > 5).any()
    config = NFTConfig()
    ours = optimality_probability(
        group_advantages(rewards, group_ids, config.global_std, clip=config.optimality_scale),
        config.optimality_scale,
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@transcribes("algorithm:nft", source=NFT_DECAY)
def test_the_decay_schedule_is_diffusionnfts():
    configs = {
        0: NFTConfig(old_decay=0.0),
        1: NFTConfig(),
        2: NFTConfig(old_decay=0.999, old_decay_rate=0.0075, old_decay_delay=75),
    }
    for decay_type, config in configs.items():
        assert [old_decay(config, n) for n in range(400)] == [_authors_return_decay(n, decay_type) for n in range(400)]


STEPS = 4
"""Denoising steps of the tiny model's rollouts, of whose levels each sample trains int(0.99 * 4) = 3 (noise_draws),
as the authors' timestep_fraction 0.99 gives."""


def _trainer(run_dir: Path, model_dir: str, *extra: str) -> Trainer:
    """Two prompts of three samples each, sampled in STEPS deterministic steps."""
    return tiny_trainer(
        run_dir,
        model_dir,
        "algorithm.name=nft",
        "algorithm.group_size=3",
        f"algorithm.sampler.num_steps={STEPS}",
        f"algorithm.noise_draws={int(0.99 * STEPS)}",
        "data.prompts_per_epoch=2",
        "train.warmup_steps=0",
        "train.epochs=1",
        "eval.every=0",
        "logging.progress=false",
        *extra,
        log=False,
    )


def _perturb(trainer: Trainer, seed: int) -> None:
    """Move the policy's trainable weights, as an optimizer step would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.adapter.trainable.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def _rollout(trainer: Trainer):
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    ro, _, _ = trainer.sample_and_score(
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    return ro, group_ids


@transcribes("algorithm:nft", source=NFT_TRAIN)
@pytest.mark.parametrize(("beta", "kl"), [(1.0, 1e-4), (0.1, 0.5)])
def test_a_units_loss_and_gradient_are_diffusionnfts(tmp_path, tiny_model_dir, beta, kl):
    """``NFT.loss`` of one unit (all of the batch's samples at one noise draw), divided by its share of the step,
    against the authors' loss on the same model forwards: the base model (the reference as RL starts), the old
    policy and the policy all differ."""
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        f"algorithm.beta={beta}",
        f"algorithm.kl_weight={kl}",
        "algorithm.micro_batch_size=64",
    )
    algo, ctx, adapter = trainer.algorithm, trainer.ctx, trainer.adapter
    trainer._new_reference()
    algo.start_epoch(ctx, 0)
    _perturb(trainer, 5)
    algo.optimizer_steps = 100  # d = 0.1: old = 0.1 base + 0.9 policy
    algo.start_epoch(ctx, 1)
    _perturb(trainer, 6)
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.8, 0.2, 0.25])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = algo.plan(batch, torch.Generator().manual_seed(2))
    assert len(units) == int(0.99 * STEPS)  # one unit per noise level of the schedule
    unit = units[1]
    trainer.policy.zero_grad()
    loss, _ = algo.loss(ctx, unit)
    (loss / unit.share).backward()
    ours = [p.grad.clone() for p in adapter.trainable.parameters()]

    rows, t, noise = unit.rows, unit.draw.sigma, unit.draw.noise
    x0, cond = ro.latents[rows, -1], ro.cond.select(rows)
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    with torch.no_grad(), algo.old.swapped():
        old = adapter.predict(adapter.denoiser, xt, t, cond, 1.0)
    trainer.policy.zero_grad()
    forward = adapter.predict(trainer.policy, xt, t, cond, 1.0)
    with torch.no_grad():
        ref = adapter.predict(ctx.reference, xt, t, cond, 1.0)
    adv = torch.from_numpy(_authors_per_prompt_advantages(ro.prompts, rewards.double().numpy()))[rows].float()
    theirs = _authors_nft_loss(x0, t, noise, forward, old, ref, adv, beta, 5.0, kl)
    theirs.backward()
    torch.testing.assert_close(loss / unit.share, theirs.float(), rtol=1e-5, atol=0)
    for a, b in zip(ours, [p.grad for p in adapter.trainable.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)


@transcribes("algorithm:nft", source=NFT_DECAY)
@pytest.mark.parametrize(("decay_type", "steps_per_epoch"), [(1, 1), (2, 2)])
def test_the_old_policy_follows_the_policy_as_diffusionnfts(tmp_path, tiny_model_dir, decay_type, steps_per_epoch):
    """The authors copy the policy into the old adapter once, then after every epoch set
    old <- decay old + (1 - decay) policy with decay = return_decay(optimizer steps so far): ours refreshes before
    each epoch's rollout from the optimizer steps its plans counted. From step 70 (a resumed run), across the
    delay of decay_type 2."""
    flat, uprate, uphold = DECAY_TYPES[decay_type]
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        f"algorithm.old_decay={uphold}",
        f"algorithm.old_decay_rate={uprate}",
        f"algorithm.old_decay_delay={flat}",
        f"algorithm.steps_per_epoch={steps_per_epoch}",
        "algorithm.micro_batch_size=2",
    )
    algo, ctx = trainer.algorithm, trainer.ctx
    params = list(trainer.adapter.trainable.parameters())
    algo.start_epoch(ctx, 0)
    theirs = [p.detach().clone() for p in params]  # the copy before the loop
    ro, group_ids = _rollout(trainer)
    rewards = torch.tensor([0.1, 0.9, 0.4, 0.8, 0.2, 0.25])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    global_step = algo.optimizer_steps = 70
    for epoch in range(1, 9):
        global_step += len(algo.plan(batch, torch.Generator().manual_seed(epoch)))
        _perturb(trainer, epoch)  # the epoch's optimizer steps
        decay = _authors_return_decay(global_step, decay_type)
        theirs = [old * decay + p.detach().clone() * (1.0 - decay) for old, p in zip(theirs, params, strict=True)]
        algo.start_epoch(ctx, epoch)
        assert algo.optimizer_steps == global_step
        for ours, old in zip(algo.old.shadow, theirs, strict=True):
            torch.testing.assert_close(ours, old, rtol=1e-6, atol=1e-7)
    assert global_step > flat + 4 and algo.old_differs


def _authors_dpm2_sampling(velocity, z, sigmas):
    """NVlabs/DiffusionNFT@24af555 flow_grpo/diffusers_patch/solver.py ``run_sampling`` with solver "dpm2" and
    determistic=True: ``dpm_step`` with its DPMState, ``convert_model_output``, ``ddim_update`` (eta 0),
    ``dpm_solver_first_order_update`` and ``multistep_dpm_solver_second_order_update``, flow alpha = 1 - sigma."""
    sig = sigmas.to(torch.float64)
    lam = lambda s: torch.log(1 - s) - torch.log(s)  # noqa: E731
    num_steps, outputs, lower_order_nums = len(sigmas) - 1, [None, None], 0
    for i in range(num_steps):
        x0_pred = z - sigmas[i] * velocity(z, sigmas[i]).float()
        outputs = [outputs[1], x0_pred]
        t, s = sig[i + 1], sig[i]
        if lower_order_nums < 1 or i == num_steps - 1:  # order 2: the first and the final step are first order
            if i == 0 or i == num_steps - 1:  # ddim_update at eta 0
                z = (1 - t) * x0_pred + t * (z - (1 - s) * x0_pred) / s
            else:
                h = lam(t) - lam(s)
                z = (t / s) * z - ((1 - t) * (torch.exp(-h) - 1.0)) * x0_pred
        else:
            h, h_0 = lam(t) - lam(s), lam(s) - lam(sig[i - 1])
            d0, d1 = outputs[1], (1.0 / (h_0 / h)) * (outputs[1] - outputs[0])
            z = (t / s) * z - ((1 - t) * (torch.exp(-h) - 1.0)) * d0 - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
        lower_order_nums = min(lower_order_nums + 1, 2)
        z = z.to(torch.float32)
    return z


@transcribes("step:dpm_solver_2m", source=NFT_SOLVER)
def test_a_deterministic_second_order_rollout_is_diffusionnfts_dpm2_sampling(tmp_path, tiny_model_dir):
    """``sampler: {noise_level: 0, ode_order: 2}`` on the tiny model against the authors' rollout solver on the same
    model velocities (their pipeline passes timesteps truncated to integers to the model: docs/departures.md);
    Euler's samples differ by far more."""
    trainer = _trainer(tmp_path, tiny_model_dir)
    adapter, net = trainer.adapter, trainer.adapter.denoiser
    prompts = [trainer.task.prompts[i] for i in range(3)]
    settings = SamplerSettings(num_steps=6, noise_level=0.0, ode_order=2)
    initial = adapter.prepare_latents(3, torch.Generator().manual_seed(3))
    ours = rollout(adapter, net, prompts, torch.arange(3), settings, None, initial=initial).latents[:, -1]
    cond = adapter.encode_prompts(prompts)
    sigmas = adapter.sigmas(6)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    with torch.no_grad():
        theirs = _authors_dpm2_sampling(lambda z, s: adapter.predict(net, z, s.expand(3), cond, 1.0), initial, sigmas)
    euler = rollout(
        adapter,
        net,
        prompts,
        torch.arange(3),
        SamplerSettings(num_steps=6, noise_level=0.0),
        None,
        initial=initial,
    ).latents[:, -1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (euler - theirs).abs().max() > 100 * (ours - theirs).abs().max() + 1e-4
