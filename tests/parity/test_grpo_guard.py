"""GRPO-Guard against the implementations of it that exist (its authors publish no code): verl-omni's
``GRPOGuardLoss`` (the normalised ratio and the paper's 1 / |dt| reweighting) and Flow-Factory's
``GRPOGuardTrainer`` (the same ratio, no reweighting). Ours runs on the tiny real model, off policy, with
per-sample steps mixed in one unit; theirs on the same forwards, one sample at a time (their batches share a step).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transcribed import Source, transcribes
from warm_start import tiny_trainer

from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import guard_log_ratio
from trainer.samplers.flow_sde import cps_step_with_logprob

VERL_OMNI = Source(
    "verl-project/verl-omni",
    "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30",
    "verl_omni/trainer/diffusion/diffusion_algos.py",
    "GRPOGuardLoss.compute_loss",
)
FLOW_FACTORY = Source(
    "X-GenGroup/Flow-Factory",
    "a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c",
    "src/flow_factory/trainers/grpo.py",
    "GRPOGuardTrainer.optimize",
)


def _verl_omni_sde_step(v, x, sigma, sigma_next, sigma_max, noise_level, prev_sample):
    """verl-project/verl-omni@a1139baf verl_omni/pipelines/schedulers/flow_match_sde.py
    FlowMatchSDEDiscreteScheduler.sample_previous_step, sde_type "sde", given prev_sample, with the normaliser:
    (log_prob [B], prev_sample_mean, std_dev_t, sqrt_dt [B])."""
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * (std_dev_t * torch.sqrt(-dt)) ** 2)
    log_prob = log_prob - torch.log(std_dev_t * torch.sqrt(-dt)) - math.log(math.sqrt(2 * math.pi))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t, torch.sqrt(-dt).reshape(-1)


def _verl_omni_guard_loss(
    old_log_prob, log_prob, advantages, clip_ratio, adv_clip_max, old_mean, mean, std_dev_t, sqrt_dt
):
    """verl-project/verl-omni@a1139baf diffusion_algos.py GRPOGuardLoss.compute_loss (no rollout IS weights)."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t, sqrt_dt_mean = std_dev_t.mean(), sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (mean - old_mean).pow(2)
    mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio = torch.exp((log_prob - old_log_prob + mean_diff_sq / (2 * scale**2)) * scale)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.mean(torch.maximum(unclipped, clipped)) / (sqrt_dt_mean**2)


def _flow_factory_guard_loss(old_log_prob, log_prob, adv, clip_range, adv_clip_range, old_mean, mean, std_dev_t, dt):
    """X-GenGroup/Flow-Factory@a0b2bc5a src/flow_factory/trainers/grpo.py GRPOGuardTrainer.optimize, the policy
    loss of one timestep (no KL): the same ratio written as s log r + mse / (2 s), no reweighting."""
    adv = torch.clamp(adv, adv_clip_range[0], adv_clip_range[1])
    scale_factor = torch.sqrt(-dt) * std_dev_t
    mse = (mean - old_mean).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((log_prob - old_log_prob) * scale_factor + mse / (2 * scale_factor))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 + clip_range[0], 1.0 + clip_range[1])
    return torch.mean(torch.maximum(unclipped, clipped))


def _theirs(trainer, unit, reweight: bool) -> torch.Tensor:
    """The unit's loss by the reference function, one sample at a time, averaged over the unit's samples."""
    batch, ro, config = unit.batch, unit.batch.rollout, trainer.algorithm.config
    losses = []
    for i, t in zip(unit.indices.tolist(), unit.steps.tolist(), strict=True):
        x, x_next = ro.latents[i : i + 1, t], ro.latents[i : i + 1, t + 1]
        sigma, sigma_next = ro.sigmas[t], ro.sigmas[t + 1]
        v = trainer.adapter.predict(
            trainer.policy, x, sigma.expand(1), ro.cond.select(torch.tensor([i])), ro.guidance_scale
        ).float()
        log_prob, mean, std_dev_t, sqrt_dt = _verl_omni_sde_step(
            v, x.float(), sigma, sigma_next, ro.sigmas[1], ro.noise_level, x_next.float()
        )
        old_log_prob, old_mean = batch.old_log_probs[i : i + 1, t], batch.old_means[i : i + 1, t]
        adv = batch.advantages[i : i + 1, t]
        if reweight:
            losses.append(
                _verl_omni_guard_loss(
                    old_log_prob,
                    log_prob,
                    adv,
                    config.clip_range,
                    config.adv_clip,
                    old_mean,
                    mean,
                    std_dev_t,
                    sqrt_dt,
                )
            )
        else:
            eps, clip = config.clip_range, (-config.adv_clip, config.adv_clip)
            losses.append(
                _flow_factory_guard_loss(
                    old_log_prob,
                    log_prob,
                    adv,
                    (-eps, eps),
                    clip,
                    old_mean,
                    mean,
                    std_dev_t,
                    sigma_next - sigma,
                )
            )
    return torch.stack(losses).mean()


def _check_units(tmp_path: Path, model_dir: str, reweight: bool, clip_range: float) -> None:
    """After the policy moved off the rollout's weights, every unit's loss (its per-sample mean, before its share)
    and its gradient equal the reference's on the same forwards; some units mix steps, and the clip binds only
    at the small ``clip_range``."""
    trainer = tiny_trainer(
        tmp_path,
        model_dir,
        "algorithm.name=grpo_guard",
        "algorithm.group_size=2",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.sde_window=0",
        "data.prompts_per_epoch=2",
        f"algorithm.reweight={str(reweight).lower()}",
        f"algorithm.clip_range={clip_range}",
        "train.warmup_steps=0",
        "train.epochs=1",
        "eval.every=0",
        "logging.progress=false",
        log=False,
    )
    algo = trainer.algorithm
    indices, group_ids = trainer.sampler.epoch(0)
    prompts = [trainer.task.prompts[i] for i in indices.tolist()]
    ro, _, _ = trainer.sample_and_score(
        prompts, indices, group_ids, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy moves off the rollout's weights
        for p in trainer.adapter.trainable.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    rewards = torch.tensor([1.0, 0.0, 0.2, 0.9])
    batch = algo.make_batch(ro, Rewards(rewards, rewards, group_ids, 0))
    algo.plan(batch, torch.Generator().manual_seed(2))  # the first plan's first step would be on policy
    (units,) = algo.plan(batch, torch.Generator().manual_seed(2))
    assert any(len(set(unit.steps.tolist())) > 1 for unit in units)
    clipped = []
    for unit in units:
        trainer.policy.zero_grad()
        ours, stats = algo.loss(trainer.ctx, unit)
        (ours / unit.share).backward()
        grads_ours = [p.grad.clone() for p in trainer.adapter.trainable.parameters()]
        trainer.policy.zero_grad()
        theirs = _theirs(trainer, unit, reweight)
        theirs.backward()
        torch.testing.assert_close(ours.detach() / unit.share, theirs.detach(), rtol=1e-5, atol=1e-7)
        for a, b in zip(grads_ours, trainer.adapter.trainable.parameters(), strict=True):
            torch.testing.assert_close(a, b.grad, rtol=2e-3, atol=1e-7)
        clipped.append(float(stats["clip_frac"]))
    assert (max(clipped) > 0) == (clip_range < 1e-3)


@pytest.mark.parametrize("clip_range", [1.0, 1e-7])
@transcribes("algorithm:grpo_guard", source=VERL_OMNI)
def test_grpo_guard_equals_verl_omni_with_the_dt_reweighting(tmp_path, tiny_model_dir, clip_range):
    """The default (``reweight``): verl-omni's normalised ratio and per-step loss divided by -dt."""
    _check_units(tmp_path, tiny_model_dir, True, clip_range)


@pytest.mark.parametrize("clip_range", [1.0, 1e-7])
@transcribes("algorithm:grpo_guard", source=FLOW_FACTORY)
def test_grpo_guard_without_reweighting_equals_flow_factory(tmp_path, tiny_model_dir, clip_range):
    """``reweight=false``: Flow-Factory's ratio on Flow-GRPO's SDE step, no reweighting."""
    _check_units(tmp_path, tiny_model_dir, False, clip_range)


@transcribes("algorithm:grpo_guard", source=FLOW_FACTORY)
def test_flow_factory_ratio_on_cps_steps_is_ours_rescaled_and_shifted():
    """On CPS steps (std = sigma_next sin(a pi / 2), no sqrt(dt); log p = -mean((x - mean)^2), Flow-Factory's
    CPS scoring) Flow-Factory's ratio keeps scaling by c = sqrt(-dt) std, so with d = mean - old_mean its
    log-ratio is 2 std c log r~ - (c - 1 / (2 c)) mean(d^2): not zero-mean, at a scale that changes with the
    step. Ours stays log r~ = mean(eps d) for every Gaussian step kind."""
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 2, 4, 4, generator=g), torch.randn(4, 2, 4, 4, generator=g)
    sigma, sigma_next = torch.tensor([0.9, 0.7, 0.5, 0.3]), torch.tensor([0.7, 0.5, 0.3, 0.1])
    x_next, _, old_mean, std = cps_step_with_logprob(v, x, sigma, sigma_next, 0.7, generator=g)
    _, _, mean, _ = cps_step_with_logprob(
        v + 0.1 * torch.randn(v.shape, generator=g), x, sigma, sigma_next, 0.7, prev_sample=x_next
    )
    dims = (1, 2, 3)
    log_prob, old_log_prob = -((x_next - mean) ** 2).mean(dims), -((x_next - old_mean) ** 2).mean(dims)
    scale = torch.sqrt(sigma - sigma_next) * std.reshape(-1)
    mse = ((mean - old_mean) ** 2).mean(dims)
    theirs = (log_prob - old_log_prob) * scale + mse / (2 * scale)  # the log of Flow-Factory's ratio
    ours = guard_log_ratio(x_next, mean, old_mean, std)
    torch.testing.assert_close(
        theirs, 2 * std.reshape(-1) * scale * ours - (scale - 1 / (2 * scale)) * mse, rtol=1e-4, atol=1e-6
    )
