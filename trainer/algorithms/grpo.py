"""GRPO for flow models (Flow-GRPO): group-relative advantages and a PPO-clip loss per denoising step.

Per prompt, ``group_size`` images are sampled with the SDE sampler, which records log p(x_{t+1} | x_t).
    A_i   = clip((r_i - mean_group(r)) / (std + 1e-4), -c, c)      std per group or over the batch
    ratio = exp(log p_theta(x_{t+1} | x_t) - log p_old(x_{t+1} | x_t))
    L     = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))) + beta KL(pi_theta || pi_ref)
with the KL between the two Gaussian steps in the Flow-GRPO latent-mean form (no dt factor; see
``gaussian_mean_kl``). Departures from the paper: none in the loss; trained timesteps are a random subset
per sample (``timestep_fraction``) of the stochastic steps, the last step excluded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from trainer.algorithms.advantages import (
    clipped_policy_loss,
    gaussian_mean_kl,
    group_advantages,
    zero_std_share,
)
from trainer.algorithms.base import LossContext, Rewards, split_steps
from trainer.rollout import Rollout, SamplerSettings


@dataclass
class GRPOConfig:
    """GRPO hyper-parameters; defaults follow the Flow-GRPO reference recipe where it has one."""

    name: str = "grpo"
    """Registry name of the algorithm (``trainer.algorithms.ALGORITHMS``)."""
    group_size: int = 8
    """Images per prompt (G); advantages are relative within a group."""
    global_std: bool = True
    """Normalise by the std of the whole gathered batch (reference recipe) instead of each group's."""
    adv_clip: float = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip]."""
    clip_range: float = 1e-4
    """PPO ratio clip eps; small because the log-prob is averaged over elements."""
    kl_beta: float = 0.0
    """Weight of the KL to the reference policy; 0 skips the reference forward entirely."""
    timestep_fraction: float = 1.0
    """Fraction of the trainable (stochastic, non-final) steps trained per sample."""
    inner_epochs: int = 1
    """Passes over each rollout batch; the ratio and clip keep reuse safe."""
    steps_per_epoch: int = 1
    """Optimizer steps per inner epoch (the per-rank batch is split into this many)."""
    micro_batch_size: int = 32
    """Samples per forward/backward; gradients accumulate over micro-batches and timesteps."""
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    """Rollout sampling (steps, CFG, SDE kind and noise level, SDE window)."""

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError("algorithm.group_size must be >= 2 for group-relative advantages")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"algorithm.timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        if self.inner_epochs < 1 or self.steps_per_epoch < 1 or self.micro_batch_size < 1:
            raise ValueError("algorithm.inner_epochs, steps_per_epoch and micro_batch_size must be >= 1")


@dataclass
class GRPOBatch:
    rollout: Rollout
    advantages: torch.Tensor   # [B] this rank's samples
    train_steps: torch.Tensor  # [K] denoising step indices eligible for training
    rewards: Rewards


@dataclass
class GRPOUnit:
    batch: GRPOBatch
    indices: torch.Tensor      # [m] samples of this micro-batch
    steps: torch.Tensor        # [m] denoising step trained for each sample


class GRPO:
    """Group relative policy optimisation on SDE rollouts."""

    config_class = GRPOConfig

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.sampler = config.sampler
        self.group_size = config.group_size
        self.inner_epochs = config.inner_epochs
        self.needs_reference = config.kl_beta > 0

    def advantages(self, rewards: Rewards) -> torch.Tensor:
        adv_all = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std, self.config.adv_clip)
        return adv_all[rewards.offset : rewards.offset + len(rewards.local)]

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> GRPOBatch:
        train_steps = rollout.trainable_steps()
        if len(train_steps) == 0:
            raise ValueError("no trainable denoising steps: raise sampler.num_steps or sampler.sde_window")
        return GRPOBatch(rollout, self.advantages(rewards), train_steps, rewards)

    def plan(self, batch: GRPOBatch, generator: torch.Generator) -> list[list[GRPOUnit]]:
        """Each sample trains on its own random subset of ``ceil(timestep_fraction * K)`` steps; a unit is
        one micro-batch at one step position."""
        n = len(batch.advantages)
        k = len(batch.train_steps)
        per_sample = max(1, math.ceil(self.config.timestep_fraction * k))
        order = torch.stack([batch.train_steps[torch.randperm(k, generator=generator)[:per_sample]] for _ in range(n)])
        steps = []
        for micro_batches in split_steps(n, self.config.steps_per_epoch, self.config.micro_batch_size, generator):
            steps.append([GRPOUnit(batch, idx, order[idx, j]) for idx in micro_batches for j in range(per_sample)])
        return steps

    def loss(self, ctx: LossContext, unit: GRPOUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, idx, step = unit.batch, unit.indices, unit.steps
        ro = batch.rollout
        x_t, x_next = ro.latents[idx, step], ro.latents[idx, step + 1]
        sigma, sigma_next = ro.sigmas[step], ro.sigmas[step + 1]
        cond = ro.cond.select(idx)
        step_fn = ctx.adapter.step_function(ro.kind, ro.sigmas)
        v = ctx.adapter.predict(ctx.policy, x_t, sigma, cond, ro.guidance_scale)
        _, log_prob, mean, std = step_fn(v, x_t, sigma, sigma_next, ro.noise_level, prev_sample=x_next)
        loss, stats = clipped_policy_loss(batch.advantages[idx], log_prob, ro.log_probs[idx, step],
                                          self.config.clip_range)
        if self.config.kl_beta > 0:
            with torch.no_grad():
                v_ref = ctx.adapter.predict(ctx.reference, x_t, sigma, cond, ro.guidance_scale)
                _, _, ref_mean, _ = step_fn(v_ref, x_t, sigma, sigma_next, ro.noise_level, prev_sample=x_next)
            kl = gaussian_mean_kl(mean, ref_mean, std).mean()
            loss = loss + self.config.kl_beta * kl
            stats["kl"] = kl.detach()
        stats["policy_loss"] = loss.detach()
        return loss, stats

    def batch_metrics(self, batch: GRPOBatch) -> dict[str, float]:
        valid = ~torch.isnan(batch.rewards.all)
        return {
            "adv_abs_mean": float(batch.advantages.abs().mean()),
            "zero_std_share": zero_std_share(batch.rewards.all, batch.rewards.group_ids_all),
            "failed_share": float((~valid).float().mean()),
        }
