"""AWM against the authors' code (scxue/advantage_weighted_matching): the weighted matching log-likelihood of every
weighting (ghuber included), the clipped ratio loss with the rescaled advantages, the two KL terms, the EMA
policy's decay schedule and the stratified training timesteps, on random inputs and on a tiny SD3 model.

Transcribed (not run) from advantage_weighted_matching/scripts/train_sd3_awm.py and flow_grpo/stat_tracking.py
at the commit below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transcribed import Source, transcribes

from trainer.algorithms.awm import AWM, AWMConfig
from trainer.algorithms.base import LossContext, Rewards, refresh_reference, unwrapped_copy
from trainer.algorithms.clean_sample import stratified_steps
from trainer.algorithms.core_algos import awm_loss
from trainer.distributed import SingleProcess
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout

REPO, COMMIT = "scxue/advantage_weighted_matching", "be5137232e33a21b449ed65a533211d0deb97ed8"
TRAIN = "advantage_weighted_matching/scripts/train_sd3_awm.py"
LOG_PROB = Source(REPO, COMMIT, TRAIN, "compute_log_prob_awm")
TRAIN_STEP = Source(REPO, COMMIT, TRAIN, "main (training loop: exp_first ratio, clip, kl_loss, ema_kl_loss)")
THEIR_WEIGHTING = {
    "uniform": "Uniform",
    "sigma": "t",
    "sigma**2": "t**2",
    "huber": "huber",
    "ghuber": "ghuber",
}


# --- transcriptions of the authors' code ------------------------------------------------------------------------


def _log_prob_awm(noise_pred, clean_latents, random_noise, timestep, weighting, ghuber_power):
    """scxue/advantage_weighted_matching@be51372 `train_sd3_awm.py` `compute_log_prob_awm` after the transformer's
    forward: the matching error against noise - clean in double, weighted."""
    model_output = noise_pred.double()
    log_prob = -((model_output - (random_noise.double() - clean_latents.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = timestep.view(-1)
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t**2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        tiny = torch.tensor(1e-10, dtype=log_prob.dtype)
        log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power) - torch.pow(tiny, ghuber_power)) * t / ghuber_power
    return log_prob


def _policy_loss(log_probs, old_log_probs, advantages, cfg):
    """scxue/advantage_weighted_matching@be51372 `train_sd3_awm.py` `main`, loss_type 'exp_first': the advantages
    clamped and rescaled, one ratio per (timestep, sample), the PPO clip, the mean over both ([T, B] inputs)."""
    advantages = torch.clamp(advantages, -cfg["adv_clip_max"], cfg["adv_clip_max"])
    advantages = advantages / cfg["adv_clip_max"] * cfg["advantage_max"]
    ratio = torch.exp(log_probs.view(-1) - old_log_probs.view(-1).detach())
    advantages = advantages.unsqueeze(0).repeat(log_probs.shape[0], 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - cfg["clip_range"], 1.0 + cfg["clip_range"])
    return torch.mean(torch.maximum(unclipped_loss, clipped_loss))


def _uniform_kl(model_output, other):
    """scxue/advantage_weighted_matching@be51372 `train_sd3_awm.py` `main`, kl_weight / kl_ema_weight 'Uniform'
    ([T, B, C, H, W] inputs): the mean squared velocity gap, meaned over timesteps and samples."""
    return ((model_output - other) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()


def _ema_branch_update(ema_params, params, global_step, kl_ema_decay=0.3, ramp=0.001):
    """scxue/advantage_weighted_matching@be51372 `train_sd3_awm.py` `main` after each epoch, kl_ema_decay_type
    'linear' (``ramp`` its constant 0.001): decay = min(kl_ema_decay, 0.001 global_step), tgt = tgt decay +
    src (1 - decay)."""
    decay = min(kl_ema_decay, ramp * global_step)
    for tgt, src in zip(ema_params, params, strict=True):
        tgt.data.copy_(tgt.detach().data * decay + src.detach().clone().data * (1.0 - decay))


def _discrete_t_indices(rand_u, num_steps, timestep_fraction, train_timesteps, wo_init):
    """scxue/advantage_weighted_matching@be51372 `train_sd3_awm.py` `main`, time_type 'discrete' /
    'discrete_wo_init': one sampler step index per stratum of [0 or 1, int(num_steps timestep_fraction))."""
    boundaries = torch.linspace(int(wo_init), int(num_steps * timestep_fraction), steps=train_timesteps + 1)
    lower_bounds, upper_bounds = boundaries[:-1].long(), boundaries[1:].long()
    return lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()


def _per_prompt_advantages(prompts, rewards, global_std):
    """scxue/advantage_weighted_matching@be51372 `flow_grpo/stat_tracking.py` `PerPromptStatTracker.update`."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        spread = rewards if global_std else prompt_rewards
        advantages[prompts == prompt] = (prompt_rewards - mean) / (np.std(spread, axis=0, keepdims=True) + 1e-4)
    return advantages


# --- the loss on random tensors ---------------------------------------------------------------------------------


@transcribes("algorithm:awm", source=LOG_PROB)
@pytest.mark.parametrize("weighting", sorted(THEIR_WEIGHTING))
def test_the_clipped_matching_loss_and_its_gradient_are_the_authors(weighting):
    """awm_loss with each time weighting (theirs: Uniform, t, t**2, huber, ghuber) equals their exp_first loss on
    their log-probabilities, some ratios clipped: values and gradients on the policy's velocities."""
    gen = torch.Generator().manual_seed(len(weighting))
    t, b, shape = 3, 4, (3, 4, 4)
    noise = torch.randn((t * b, *shape), generator=gen, dtype=torch.float64)
    clean = torch.randn((t * b, *shape), generator=gen, dtype=torch.float64)
    v_theta = (noise - clean + 0.5 * torch.randn(noise.shape, generator=gen, dtype=torch.float64)).requires_grad_()
    v_old = v_theta.detach() + 0.2 * torch.randn(noise.shape, generator=gen, dtype=torch.float64)
    sigma = torch.rand(t * b, generator=gen, dtype=torch.float64)
    adv = 3 * torch.randn(b, generator=gen, dtype=torch.float64)
    cfg = {"adv_clip_max": 5.0, "advantage_max": 1.0, "clip_range": 0.02}
    logp = _log_prob_awm(v_theta, clean, noise, sigma, THEIR_WEIGHTING[weighting], 0.25).view(t, b)
    old = _log_prob_awm(v_old, clean, noise, sigma, THEIR_WEIGHTING[weighting], 0.25).view(t, b)
    theirs = _policy_loss(logp, old, adv, cfg)
    (want,) = torch.autograd.grad(theirs, v_theta)
    scaled = adv.clamp(-5, 5) / 5 * 1.0  # AWM.make_batch's rescaling
    ours, stats = awm_loss(v_theta, v_old, noise - clean, scaled.repeat(t), sigma, 0.02, None, weighting, 0.25)
    (got,) = torch.autograd.grad(ours, v_theta)
    assert 0 < stats["clip_frac"].item() < 1
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-8)


@transcribes("algorithm:awm", source=TRAIN_STEP)
@pytest.mark.parametrize(
    ("num_steps", "fraction", "draws", "wo_init"),
    [(14, 0.9, 6, True), (14, 0.9, 6, False), (10, 1.0, 4, True), (6, 0.9, 6, False)],
)
def test_the_stratified_training_steps_are_the_authors(num_steps, fraction, draws, wo_init):
    """The step indices ``time_type`` "discrete" / "discrete_wo_init" draws are theirs for the same uniforms."""
    lo, hi = int(wo_init), int(num_steps * fraction)
    ours = stratified_steps(lo, hi, draws, 5, torch.Generator().manual_seed(0))
    rand_u = torch.rand((draws, 5), generator=torch.Generator().manual_seed(0))
    for i in range(5):
        assert ours[:, i].tolist() == _discrete_t_indices(rand_u[:, i], num_steps, fraction, draws, wo_init).tolist()


# --- the algorithm's loss on a tiny model -----------------------------------------------------------------------

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7", "a handwritten digit 1"]
G = 4


@torch.no_grad()
def _move(adapter, seed: int, scale: float = 0.02) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in adapter.trainable.parameters():
        p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _tiny_run(tiny_model_dir, config: AWMConfig):
    """A rollout of 3 groups of 4 on the tiny model; four networks as after some epochs: the reference (the
    policy as RL starts), the sampling policy, the EMA policy half-way between it and a later policy, the policy."""
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    group_ids = torch.arange(len(PROMPTS) * G) // G
    prompts = [PROMPTS[i] for i in group_ids.tolist()]
    ro = rollout(adapter, adapter.denoiser, prompts, group_ids, config.sampler, torch.Generator().manual_seed(0))
    algo = AWM(config)
    ctx = LossContext(adapter, adapter.denoiser, None)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    refresh_reference(ctx)
    nets = {"ref": unwrapped_copy(adapter.denoiser)}
    _move(adapter, 1)
    algo.start_epoch(ctx, 0)  # the sampling policy's copy; the EMA policy's start
    nets["old"], nets["ema"] = unwrapped_copy(adapter.denoiser), unwrapped_copy(adapter.denoiser)
    _move(adapter, 2)
    algo.ema.update(0.5)
    params = [p for p in nets["ema"].parameters()]
    _ema_branch_update(params, list(adapter.trainable.parameters()), global_step=1, kl_ema_decay=0.5, ramp=0.5)
    _move(adapter, 3)
    rewards = torch.rand(len(prompts), generator=torch.Generator().manual_seed(3))
    return adapter, ro, algo, ctx, nets, prompts, group_ids, rewards


def _their_step(adapter, ro, units, nets, adv, config):
    """Their loss from the four networks' velocities, per unit (one timestep of its samples: [1, B] inputs) and
    meaned over the units: their mean over [T, B] where every unit holds as many samples."""
    cfg = {
        "adv_clip_max": config.adv_clip,
        "advantage_max": config.advantage_max,
        "clip_range": config.clip_range,
    }
    w, p = THEIR_WEIGHTING[config.time_weighting], config.ghuber_power
    losses = []
    for unit in units:
        x0, noise, sigma = ro.latents[unit.rows, -1], unit.draw.noise, unit.draw.sigma
        s = sigma.reshape(-1, 1, 1, 1)
        xt, cond = (1 - s) * x0 + s * noise, ro.cond.select(unit.rows)
        with torch.no_grad():
            v = {k: adapter.predict(nets[k], xt, sigma, cond, 1.0).double() for k in ("ref", "old", "ema")}
        model_v = adapter.predict(adapter.denoiser, xt, sigma, cond, 1.0)
        old_v = model_v.detach() if unit.on_policy else v["old"]  # theirs: the first accumulation steps' own
        logp, old = (_log_prob_awm(u, x0, noise, sigma, w, p)[None] for u in (model_v, old_v))
        loss = _policy_loss(logp, old, adv[unit.rows], cfg)
        model = model_v.double()[None]
        kl, ema_kl = _uniform_kl(model, v["ref"][None]), _uniform_kl(model, v["ema"][None])
        losses.append(loss + config.kl_beta * kl + config.ema_kl_beta * ema_kl)
    assert len({len(unit.rows) for unit in units}) == 1
    return torch.stack(losses).mean()


@transcribes("algorithm:awm", source=TRAIN_STEP)
@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("time_type", ["discrete_wo_init", "discrete"])
def test_a_step_of_the_algorithm_is_the_authors_training_step(tiny_model_dir, time_type, on_policy):
    """An optimizer step of AWM (two draws of every sample: the authors' train_timesteps 2) equals their training
    step's loss from the same networks' velocities: the rescaled advantages, the ghuber-weighted ratio against the
    step's own forward (first step) or the sampling policy's, the clip, the KL to the reference and to the EMA
    policy; values and parameter gradients."""
    settings = SamplerSettings(num_steps=8, noise_level=0.0)
    config = AWMConfig(
        group_size=G,
        noise_draws=2,
        micro_batch_size=64,
        inner_epochs=2,
        clip_range=2e-3,
        kl_beta=0.05,
        ema_kl_beta=1.0,
        time_type=time_type,
        sampler=settings,
    )
    adapter, ro, algo, ctx, nets, prompts, group_ids, rewards = _tiny_run(tiny_model_dir, config)
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    (units,) = algo.plan(batch, torch.Generator().manual_seed(4))
    if not on_policy:
        (units,) = algo.plan(batch, torch.Generator().manual_seed(4))
    assert all(unit.on_policy == on_policy for unit in units) and len(units) == 2
    ours, clip_frac = 0.0, 0.0
    for unit in units:
        loss, stats = algo.loss(ctx, unit)
        ours, clip_frac = ours + loss, clip_frac + stats["clip_frac"].item()
    ours_grads = torch.autograd.grad(ours, list(adapter.trainable.parameters()))

    adv = torch.tensor(_per_prompt_advantages(prompts, rewards.double().numpy(), config.global_std))
    torch.testing.assert_close(batch.advantages.double(), adv.clamp(-5, 5) / 5, rtol=1e-6, atol=1e-7)
    lo, hi = int(time_type == "discrete_wo_init"), int(8 * config.timestep_fraction)
    assert all(float(s) in ro.sigmas[lo:hi].tolist() for unit in units for s in unit.draw.sigma)
    theirs = _their_step(adapter, ro, units, nets, adv, config)
    their_grads = torch.autograd.grad(theirs, list(adapter.trainable.parameters()))
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-7)
    for a, b in zip(ours_grads, their_grads, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-7)
    assert (clip_frac > 0) != on_policy


@transcribes("algorithm:awm", source=TRAIN_STEP)
def test_the_ema_policy_follows_the_authors_decay_schedule(tiny_model_dir):
    """One optimizer step per epoch (their recipes'): after each epoch their EMA LoRA branch moves with decay
    min(kl_ema_decay, ramp * steps done); ours, updated before the next epoch, holds the same weights (a steep
    ramp so that the cap is reached within the test)."""
    config = AWMConfig(group_size=G, ema_decay=0.3, ema_decay_ramp=0.1, sampler=SamplerSettings(noise_level=0.0))
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    algo = AWM(config)
    ctx = LossContext(adapter, adapter.denoiser, None)
    algo.setup(adapter, None, SingleProcess(torch.device("cpu")))
    algo.start_epoch(ctx, 0)
    params = list(adapter.trainable.parameters())
    theirs = [p.detach().clone() for p in params]  # the EMA branch starts as a copy of the trained one
    for epoch in range(1, 7):
        _move(adapter, 10 + epoch)  # the epoch's one optimizer step
        _ema_branch_update(theirs, params, global_step=epoch, kl_ema_decay=0.3, ramp=0.1)
        algo.start_epoch(ctx, epoch)
        for ours, want in zip(algo.ema.view.swap.frozen.values(), theirs, strict=True):
            torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
