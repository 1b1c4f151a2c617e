"""DGPO against the authors' code (Luo-Yihong/DGPO): the group loss, the PPO-style clip of the denoising loss,
the KL term, the EMA reference's decay schedule and the advantages, on random inputs and on a tiny SD3 model.

Transcribed (not run) from scripts/train_sd3_dgpo.py and flow_grpo/{ema,stat_tracking}.py at the commit below.
Where we offer a second form on purpose (``loss_form="softplus"``), the exact relation is asserted: its gradient
is beta times theirs (docs/departures.md, Algorithms).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transcribed import Source, transcribes

from trainer.algorithms.base import LossContext, Rewards, refresh_reference, unwrapped_copy
from trainer.algorithms.core_algos import dgpo_loss, per_sample_mse
from trainer.algorithms.dgpo import DGPO, DGPOConfig
from trainer.distributed import SingleProcess
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout

REPO, COMMIT = "Luo-Yihong/DGPO", "01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6"
TRAIN = "scripts/train_sd3_dgpo.py"
GROUP_LOSS = Source(REPO, COMMIT, TRAIN, "compute_group_dgpo_loss_allreduce")
TRAIN_STEP = Source(REPO, COMMIT, TRAIN, "main (training loop: clip_dsm, kl_loss, ema_ref.step)")


# --- transcriptions of the authors' code ------------------------------------------------------------------------


def _group_dgpo_loss(model_v, ref_old_v, target_v, advantages, group_ids, beta_dpo, group_size, dsm_loss=None):
    """Luo-Yihong/DGPO@01ceb4b `scripts/train_sd3_dgpo.py` `compute_group_dgpo_loss_allreduce`, one process (the
    all-reduce of the group sums is the identity): sigmoid of each group's advantage-weighted loss gap, detached,
    weights A * dsm per sample; mean over the batch."""
    batch_size = model_v.shape[0]
    if dsm_loss is None:
        dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    _, local_group_indices = torch.unique(group_ids, return_inverse=True)
    num_groups = int(local_group_indices.max()) + 1
    group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    group_sums.scatter_add_(0, local_group_indices, per_sample_term)
    group_weights = torch.sigmoid(group_sums.detach())
    return (group_weights[local_group_indices].detach() * advantages * dsm_loss).mean()


def _train_loss(model_v, ref_old_v, old_v, target_v, advantages, group_ids, cfg):
    """Luo-Yihong/DGPO@01ceb4b `scripts/train_sd3_dgpo.py` `main`, the loss of one training micro-step: the
    advantages clamped, the PPO-style clip of the denoising loss against ``old_v`` (the EMA reference,
    use_old = clip_dsm or clip_kl), the group loss against the frozen reference (or ``old_v`` with use_ema_ref),
    plus beta times the velocity gap to the frozen reference."""
    ref_dgpo_v = old_v if cfg["use_ema_ref"] else ref_old_v
    advantages = torch.clamp(advantages, -cfg["adv_clip_max"], cfg["adv_clip_max"])
    dsm_loss = 1 * (target_v - model_v).square().reshape(model_v.shape[0], -1).mean(dim=1)
    if cfg["clip_dsm"]:
        old_dsm_loss = 1 * (target_v - old_v).square().reshape(model_v.shape[0], -1).mean(dim=1)
        ratio = torch.exp(-dsm_loss + old_dsm_loss)
        should_clip = torch.where(advantages > 0, ratio > 1.0 + cfg["clip_range"], ratio < 1.0 - cfg["clip_range"])
        dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    loss = _group_dgpo_loss(
        model_v, ref_dgpo_v, target_v, advantages, group_ids, cfg["beta_dpo"], cfg["group_size"], dsm_loss
    )
    if cfg["beta"] > 0:
        kl_loss = torch.mean(1 * (model_v - ref_old_v).square().reshape(model_v.shape[0], -1).mean(dim=1))
        loss = loss + cfg["beta"] * kl_loss
    return loss


def _noised(x0, noise, sigma):
    """Luo-Yihong/DGPO@01ceb4b `scripts/train_sd3_dgpo.py` `main`: xt = (1 - sigma) x0 + sigma noise,
    target_v = noise - x0 (sigma = t / 1000 of the sampler's timestep)."""
    sigmas_t = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - sigmas_t) * x0 + sigmas_t * noise, noise - x0


def _ema_ref_step(ema_parameters, parameters, global_step, cap=0.3, ramp=0.001):
    """Luo-Yihong/DGPO@01ceb4b `flow_grpo/ema.py` `EMAModuleWrapper.step` (update_step_interval 1) as `main` calls it
    after each optimizer step: decay = min(0.3, 0.001 * global_step), global_step counting steps before this one;
    ema += (1 - decay) (p - ema). ``cap`` and ``ramp`` are the two constants of that call."""
    decay = min(cap, ramp * global_step)
    for ema, p in zip(ema_parameters, parameters, strict=True):
        ema.add_((1 - decay) * (p.detach() - ema))


def _per_prompt_advantages(prompts, rewards, global_std):
    """Luo-Yihong/DGPO@01ceb4b `flow_grpo/stat_tracking.py` `PerPromptStatTracker.update` (type 'grpo')."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = np.std(rewards, axis=0, keepdims=True) if global_std else np.std(prompt_rewards, axis=0, keepdims=True)
        advantages[prompts == prompt] = (prompt_rewards - mean) / (std + 1e-4)
    return advantages


# --- the loss on random tensors ---------------------------------------------------------------------------------


def _random_groups(m: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (m * g, 3, 4, 4)
    model_v = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    ref_v = model_v.detach() + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
    target = torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(m * g, generator=gen, dtype=torch.float64)
    return model_v, ref_v, target, adv, torch.arange(m * g) // g


@transcribes("algorithm:dgpo", source=GROUP_LOSS)
@pytest.mark.parametrize("beta", [0.5, 10.0, 100.0])
def test_the_group_loss_and_its_gradient_are_the_authors(beta):
    """loss_form "sigmoid_weighted" (the default), meaned over the groups of a step, is their loss meaned over
    its samples: equal values and equal gradients on the policy's velocities."""
    model_v, ref_v, target, adv, group_ids = _random_groups(5, 4, seed=int(beta))
    theirs = _group_dgpo_loss(model_v, ref_v, target, adv, group_ids, beta, 4)
    (want,) = torch.autograd.grad(theirs, model_v)
    per_group, _ = dgpo_loss(
        per_sample_mse(model_v, target).reshape(5, 4),
        per_sample_mse(ref_v, target).reshape(5, 4),
        adv.reshape(5, 4),
        beta,
    )
    ours = per_group.mean()
    (got,) = torch.autograd.grad(ours, model_v)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)


@transcribes("algorithm:dgpo", source=GROUP_LOSS)
def test_the_softplus_form_has_beta_times_the_authors_gradient():
    """loss_form "softplus", the group preference's negative log-likelihood, differs from theirs on purpose: its
    gradient is exactly beta times theirs (docs/departures.md)."""
    beta = 100.0
    model_v, ref_v, target, adv, group_ids = _random_groups(6, 3, seed=7)
    (want,) = torch.autograd.grad(_group_dgpo_loss(model_v, ref_v, target, adv, group_ids, beta, 3), model_v)
    per_group, _ = dgpo_loss(
        per_sample_mse(model_v, target).reshape(6, 3),
        per_sample_mse(ref_v, target).reshape(6, 3),
        adv.reshape(6, 3),
        beta,
        "softplus",
    )
    (got,) = torch.autograd.grad(per_group.mean(), model_v)
    torch.testing.assert_close(got, beta * want, rtol=1e-4, atol=1e-9)


# --- the algorithm's loss on a tiny model -----------------------------------------------------------------------

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7", "a handwritten digit 1"]
G = 4


@torch.no_grad()
def _move(adapter, seed: int, scale: float = 0.02) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in adapter.trainable.parameters():
        p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _tiny_run(tiny_model_dir, config: DGPOConfig):
    """A rollout of 3 groups of 4 on the tiny model, the reference taken, the policy moved, the EMA policy taken
    as RL starts, the policy moved again: three different networks, as after some epochs."""
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    group_ids = torch.arange(len(PROMPTS) * G) // G
    prompts = [PROMPTS[i] for i in group_ids.tolist()]
    ro = rollout(adapter, adapter.denoiser, prompts, group_ids, config.sampler, torch.Generator().manual_seed(0))
    algo = DGPO(config)
    ctx = LossContext(adapter, adapter.denoiser, None)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    refresh_reference(ctx)
    nets = {"ref": unwrapped_copy(adapter.denoiser)}
    _move(adapter, 1)
    algo.start_epoch(ctx, 0)  # the EMA policy: a copy of the policy as RL starts
    nets["old"] = unwrapped_copy(adapter.denoiser)
    _move(adapter, 2)
    rewards = torch.rand(len(prompts), generator=torch.Generator().manual_seed(3))
    return adapter, ro, algo, ctx, nets, prompts, group_ids, rewards


CASES = {
    "clip": {},
    "no clip, KL": {"clip_range": float("inf"), "kl_beta": 0.05},
    "EMA reference, clip, KL": {"dpo_reference": "ema", "beta": 2000.0, "kl_beta": 0.02},
    "group std": {"global_std": False, "kl_beta": 0.02},
}


@transcribes("algorithm:dgpo", source=TRAIN_STEP)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_of_the_algorithm_is_the_authors_training_step(tiny_model_dir, case):
    """DGPO.loss on one unit holding every group ("discrete" noise levels: one sampler step for all, as theirs)
    equals their training loss computed from the same networks' velocities: the advantages, the clip against the
    EMA reference (some samples clipped, not all), the group loss and the KL; values and parameter gradients."""
    settings = SamplerSettings(num_steps=6, noise_level=0.0)
    config = DGPOConfig(
        **{
            "group_size": G,
            "noise_draws": 1,
            "micro_batch_size": 64,
            "time_type": "discrete",
            "trunc_steps": 3,
            "clip_range": 2e-3,
            "sampler": settings,
            **CASES[case],
        }
    )
    adapter, ro, algo, ctx, nets, prompts, group_ids, rewards = _tiny_run(tiny_model_dir, config)
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = algo.plan(batch, torch.Generator().manual_seed(4))
    (unit,) = units
    assert unit.share == 1.0
    ours, stats = algo.loss(ctx, unit)
    ours_grads = torch.autograd.grad(ours, list(adapter.trainable.parameters()))

    adv = torch.tensor(
        _per_prompt_advantages(prompts, rewards.double().numpy(), config.global_std), dtype=torch.float32
    )
    torch.testing.assert_close(batch.advantages, adv.clamp(-5, 5))
    sigma = unit.draw.sigma
    assert bool((sigma == sigma[0]).all()) and float(sigma[0]) in ro.sigmas[: config.trunc_steps + 1].tolist()
    noise = torch.empty_like(ro.latents[:, -1])
    # their noise is shared within a group
    noise[batch.groups[unit.rows].reshape(-1)] = unit.draw.noise.repeat_interleave(G, dim=0)
    xt, target_v = _noised(ro.latents[:, -1], noise, sigma[0].expand(len(noise)))
    with torch.no_grad():
        ref_v, old_v = (
            ctx.adapter.predict(nets[k], xt, sigma[0].expand(len(xt)), ro.cond, 1.0) for k in ("ref", "old")
        )
    model_v = ctx.adapter.predict(adapter.denoiser, xt, sigma[0].expand(len(xt)), ro.cond, 1.0)
    cfg = {
        "beta_dpo": config.beta,
        "group_size": G,
        "clip_dsm": True,
        "clip_range": config.clip_range,
        "beta": config.kl_beta,
        "use_ema_ref": config.dpo_reference == "ema",
        "adv_clip_max": 5.0,
    }
    if case == "no clip, KL":
        cfg["clip_dsm"] = False
    theirs = _train_loss(model_v, ref_v, old_v, target_v, adv, group_ids, cfg)
    their_grads = torch.autograd.grad(theirs, list(adapter.trainable.parameters()))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for a, b in zip(ours_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    if cfg["clip_dsm"]:
        assert 0 < stats["clip_frac"].item() < 1, stats["clip_frac"]


@transcribes("algorithm:dgpo", source=TRAIN_STEP)
def test_the_ema_reference_follows_the_authors_decay_schedule(tiny_model_dir):
    """One optimizer step per epoch (their recipes'): after each, their ema_ref moves with decay
    min(cap, ramp * (steps before it)); ours, updated before the next epoch, holds the same weights (a steep ramp
    so that the cap is reached within the test)."""
    config = DGPOConfig(group_size=G, ema_decay=0.3, ema_decay_ramp=0.1, sampler=SamplerSettings(noise_level=0.0))
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    algo = DGPO(config)
    ctx = LossContext(adapter, adapter.denoiser, None)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    _move(adapter, 5)
    algo.start_epoch(ctx, 0)
    params = list(adapter.trainable.parameters())
    theirs = [p.detach().clone() for p in params]  # created as training starts
    for epoch in range(1, 7):
        _move(adapter, 10 + epoch)  # the epoch's one optimizer step
        _ema_ref_step(theirs, params, global_step=epoch - 1, cap=0.3, ramp=0.1)
        algo.start_epoch(ctx, epoch)
        for ours, want in zip(algo.ema.view.swap.frozen.values(), theirs, strict=True):
            torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
