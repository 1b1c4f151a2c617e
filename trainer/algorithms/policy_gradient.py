"""The clipped policy-gradient machinery GRPO, PPO and PPO-with-critic share: their configs' common fields,
the batch of per-(sample, step) advantages, the plan of (micro-batch, timestep) units and the per-step loss.

Each algorithm differs only in how it estimates advantages (group-relative, batch-normalised, or GAE on a
learned value); everything here is the same Flow-GRPO step loss:
    ratio = exp(log p_theta(x_{t+1} | x_t) - log p_old(x_{t+1} | x_t))
    L     = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))) + beta KL(pi_theta || pi_ref)
with the KL in the latent-mean form without the dt factor (``gaussian_mean_kl``). log p_old is the training
forward's own value wherever the weights are still the rollout's (``StepUnit.on_policy``): the ratio is then 1
exactly, whatever kernels or compiled graphs the rollout ran; the gap to the rollout's is logged (``logp_gap``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import torch

from trainer.algorithms.base import (
    AlgorithmDefaults,
    LossContext,
    Rewards,
    check_steps,
    mark_on_policy,
    set_shares,
    split_steps,
)
from trainer.algorithms.core_algos import clipped_policy_loss, gaussian_mean_kl, weighted_mean
from trainer.config.fields import Bounds, NonNegativeFloat, PositiveInt
from trainer.models.base import StepFunction
from trainer.rollout import Rollout, SamplerSettings


@dataclass
class PolicyGradientConfig:
    """Fields every clipped policy-gradient algorithm has; each algorithm's config adds its own."""

    name: str = ""
    """Registry name of the algorithm (``trainer.algorithms.ALGORITHMS``)."""
    group_size: PositiveInt = 8
    """Images per prompt in each rollout batch."""
    adv_clip: Annotated[float, Bounds(0, math.inf, low_open=True)] = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip]."""
    clip_range: Annotated[float, Bounds(0, math.inf, low_open=True)] = 1e-4
    """PPO ratio clip eps; small because the log-prob is averaged over elements (inf: no clipping)."""
    kl_beta: NonNegativeFloat = 0.0
    """Weight of the KL to the reference policy; 0 skips the reference forward entirely."""
    timestep_fraction: Annotated[float, Bounds(0, 1, low_open=True)] = 1.0
    """Fraction of the trainable (stochastic, non-final) steps trained per sample."""
    inner_epochs: PositiveInt = 1
    """Passes over each rollout batch; the ratio and clip keep reuse safe."""
    steps_per_epoch: PositiveInt = 1
    """Optimizer steps per inner epoch (the per-rank batch is split into this many)."""
    micro_batch_size: PositiveInt = 32
    """Samples per forward/backward; gradients accumulate over micro-batches and timesteps."""
    drop_zero_advantage: bool = False
    """Average the loss over the samples of non-zero advantage only, as Flow-GRPO drops the rest before
    training; the default keeps them in the mean, so a batch's update does not grow as groups go flat."""
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    """Rollout sampling (steps, CFG, SDE kind and noise level, SDE window)."""

    def __post_init__(self):
        if self.sampler.noise_level == 0:
            raise ValueError(
                "algorithm.sampler.noise_level=0 samples every step deterministically: a policy gradient "
                "then has no log-probability to train (its loss and gradients are 0); set it > 0 (0.7 is "
                "Flow-GRPO's)"
            )
        if self.sampler.num_steps == 1 and self.sampler.sde_window == 0:
            raise ValueError(
                "algorithm.sampler.num_steps=1 leaves no trainable denoising step (the last step is never "
                "trained: its noise is near 0): set num_steps >= 2"
            )
        if self.sampler.tree and math.prod(self.sampler.tree) != self.group_size:
            raise ValueError(
                f"algorithm.sampler.tree={tuple(self.sampler.tree)} makes {math.prod(self.sampler.tree)} leaves per "
                f"prompt, but algorithm.group_size={self.group_size}: make the factors' product the group size"
            )


@dataclass
class PolicyGradientBatch:
    rollout: Rollout
    advantages: torch.Tensor  # [B, T] this rank's samples, per denoising step
    train_steps: torch.Tensor  # [K] denoising step indices eligible for training
    rewards: Rewards
    returns: torch.Tensor | None = None  # [B, T] value targets (critic algorithms)
    step_fn: StepFunction | None = None  # the adapter's step on this schedule, built once per batch
    # log p_old [B, T] and the old step means [B, T, ...] (algorithms that record them): the rollout's, each
    # replaced by the training forward's value where it ran at the rollout's weights, for later passes
    old_log_probs: torch.Tensor = field(init=False)
    old_means: torch.Tensor | None = field(init=False)
    plans: int = 0  # plans made of this batch: the first one's first optimizer step runs at the rollout's weights

    def __post_init__(self) -> None:
        self.old_log_probs = self.rollout.log_probs.clone()
        self.old_means = None if self.rollout.means is None else self.rollout.means.clone()


@dataclass
class StepUnit:
    batch: PolicyGradientBatch
    indices: torch.Tensor  # [m] samples of this micro-batch
    steps: torch.Tensor  # [m] denoising step trained for each sample
    share: float = 1.0  # the unit's share of its optimizer step's loss (``set_shares``)
    step_weight: float = 0.0  # this rank's total unit weight in that step (``balance_ranks``)
    on_policy: bool = False  # no optimizer step since the rollout: log p_old is this unit's own forward


def trainable_steps(rollout: Rollout) -> torch.Tensor:
    steps = rollout.trainable_steps()
    if len(steps) == 0:
        raise ValueError(
            "no trainable denoising steps: raise algorithm.sampler.num_steps or algorithm.sampler.sde_window"
        )
    return steps


def plan_units(
    batch: PolicyGradientBatch, config: PolicyGradientConfig, generator: torch.Generator
) -> list[list[StepUnit]]:
    """Each sample trains on its own random subset of ``ceil(timestep_fraction * K)`` steps; a unit is one
    micro-batch at one step position; the per-rank batch splits into ``steps_per_epoch`` optimizer steps, whose
    loss is the mean over all of their (sample, step) pairs. The batch's first plan's first step is on policy."""
    n = batch.advantages.shape[0]
    k = len(batch.train_steps)
    per_sample = max(1, math.ceil(config.timestep_fraction * k))
    order = torch.stack([batch.train_steps[torch.randperm(k, generator=generator)[:per_sample]] for _ in range(n)])
    steps = []
    for micro_batches in split_steps(n, config.steps_per_epoch, config.micro_batch_size, generator):
        steps.append([StepUnit(batch, idx, order[idx, j]) for idx in micro_batches for j in range(per_sample)])
    mark_on_policy(batch, steps)
    if not config.drop_zero_advantage:
        return set_shares(steps, lambda unit: len(unit.indices))
    kept = (batch.advantages != 0).cpu()  # one read of the device for the whole plan
    return set_shares(steps, lambda unit: int(kept[unit.indices, unit.steps].sum()))


LogRatio = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x_next [m, ...], the policy's step mean [m, ...], the old policy's [m, ...], the step's std [m, 1, ...]) ->
log-ratio [m]."""

StepWeight = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(the rollout's schedule t[0..T], the unit's steps [m]) -> a positive weight [m] on each sample's policy loss."""


def step_loss(
    ctx: LossContext,
    unit: StepUnit,
    config: PolicyGradientConfig,
    log_ratio: LogRatio | None = None,
    step_weight: StepWeight | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss (plus beta KL) of one unit, a mean over its samples (not scaled by its
    ``share``): re-evaluates log p(x_{t+1} | x_t) under the policy; ``log_ratio`` replaces
    log p_theta - log p_old in the ratio where an algorithm defines its own, and ``step_weight`` w scales each
    sample's policy loss (as w A: the clipped loss is linear in a positive factor of A; the KL term keeps its
    weight). An on-policy unit's old values are its own, detached, and recorded in the batch; ``logp_gap`` is then
    max |log p - the rollout's log p|, the rollout's and training forward's numerical gap (0 in eager mode;
    compiled graphs in bf16 round apart)."""
    batch, ro = unit.batch, unit.batch.rollout
    # Every tensor indexed below lives on the rollout's device; host indices would be copied there by each
    # indexing op, every copy waiting for the device to finish its queued work.
    idx, step = (t.to(ro.latents.device, non_blocking=True) for t in (unit.indices, unit.steps))
    x_t, x_next = ro.latents[idx, step], ro.latents[idx, step + 1]
    sigma = ro.sigmas[step]
    cond = ro.cond.select(idx)
    if batch.step_fn is None:  # its per-step constants are then computed once, not per unit
        batch.step_fn = ctx.adapter.step_function(ro.kind, ro.sigmas)
    step_fn = batch.step_fn
    v = ctx.adapter.predict(ctx.policy, x_t, sigma, cond, ro.guidance_scale)
    _, log_prob, mean, std = step_fn(v, x_t, step, ro.noise_level, prev_sample=x_next)
    if unit.on_policy:
        old = log_prob.detach()
        batch.old_log_probs[idx, step] = old.to(batch.old_log_probs.dtype)
        if batch.old_means is not None:
            batch.old_means[idx, step] = mean.detach().to(batch.old_means.dtype)
        gap = (old.float() - ro.log_probs[idx, step].float()).abs().max()
    new, old = log_prob, batch.old_log_probs[idx, step]
    if log_ratio is not None:
        new = log_ratio(x_next, mean, batch.old_means[idx, step], step_fn.std(step, ro.noise_level, x_t))
        old = torch.zeros_like(new)
    advantages = batch.advantages[idx, step]
    if step_weight is not None:
        advantages = advantages * step_weight(ro.sigmas, step)
    weights = (advantages != 0).float() if config.drop_zero_advantage else None
    loss, stats = clipped_policy_loss(advantages, new, old, config.clip_range, weights)
    if unit.on_policy:
        stats["logp_gap"] = gap
    stats["policy_loss"] = loss.detach()
    if config.kl_beta > 0:
        with torch.no_grad():
            v_ref = ctx.adapter.predict(ctx.reference, x_t, sigma, cond, ro.guidance_scale)
            ref_mean, _ = step_fn.mean(v_ref, x_t, step, ro.noise_level)
        kl_i = gaussian_mean_kl(mean, ref_mean, std)
        kl = kl_i.mean() if weights is None else weighted_mean(kl_i, weights)
        loss = loss + config.kl_beta * kl
        stats["kl"] = kl.detach()
    return loss, stats


def advantage_metrics(batch: PolicyGradientBatch) -> dict[str, float]:
    """Statistics of the advantages at the trained steps, and the failed share of the gathered rewards."""
    adv = batch.advantages[:, batch.train_steps]
    return {
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std(unbiased=False)),
        "adv_abs_mean": float(adv.abs().mean()),
        "adv_max": float(adv.abs().max()),
    }


def per_step(advantages: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Per-sample advantages [B] broadcast to every denoising step [B, T], on the rollout's device (the
    rewards they come from live on the host)."""
    return advantages.to(rollout.log_probs.device)[:, None].expand(-1, rollout.log_probs.shape[1])


class ClippedPolicyGradient(AlgorithmDefaults):
    """The shared loop of the clipped policy-gradient algorithms; a subclass supplies ``advantages``
    (per sample, this rank's slice of the gathered batch) and may add to ``batch_metrics``."""

    shown_metrics = ("approx_kl", "clip_frac")

    def __init__(self, config: PolicyGradientConfig):
        super().__init__(config)
        self.needs_reference = config.kl_beta > 0
        # The ratio statistics say how far the policy moved off the rollout's; with one optimizer step per
        # rollout batch the ratio is exactly 1 (they are logged as 0), so the progress line leaves them out.
        # Later optimizer steps' samples have only the rollout's log p_old: their ratio holds its gap to the
        # training forward, shown then. The KL to the reference is shown where kl_beta > 0 puts it in the loss.
        reused = config.inner_epochs > 1 or config.steps_per_epoch > 1
        self.shown_metrics = (
            tuple(m for m in type(self).shown_metrics if reused or m not in ("approx_kl", "clip_frac"))
            + (("logp_gap",) if config.steps_per_epoch > 1 else ())
            + (("kl",) if config.kl_beta > 0 else ())
        )

    def advantages(self, rewards: Rewards) -> torch.Tensor:
        raise NotImplementedError

    def check_batch(self, samples_per_rank: int) -> None:
        check_steps(samples_per_rank, self.config.steps_per_epoch)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> PolicyGradientBatch:
        return PolicyGradientBatch(
            rollout, per_step(self.advantages(rewards), rollout), trainable_steps(rollout), rewards
        )

    def plan(self, batch: PolicyGradientBatch, generator: torch.Generator) -> list[list[StepUnit]]:
        return plan_units(batch, self.config, generator)

    def loss(self, ctx: LossContext, unit: StepUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = step_loss(ctx, unit, self.config)
        return loss * unit.share, stats

    def batch_metrics(self, batch: PolicyGradientBatch) -> dict[str, float]:
        return advantage_metrics(batch)
