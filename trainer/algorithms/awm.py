"""AWM (Advantage Weighted Matching): the flow-matching loss on the policy's own clean samples, weighted by
their advantages, in PPO's clipped form.

Each clean sample x0 of a rollout (any sampler: the deterministic one by default) gets a group-relative
advantage A, clipped to [-c, c] and rescaled to A a_max / c (the authors' ``advantage_max``). At a noise level
sigma with noise eps, x_sigma and the target v come from the forward process (``adapter.training_target``:
v = eps - x0 for flow models), and a weighted matching error stands in for the log-likelihood of x0:
    e = mean((v_theta(x_sigma, sigma, c) - v)^2),   log p_theta(x0) ~ -w(sigma, e)
    w: e (uniform), sigma e, sigma^2 e, sigma (sqrt(e + 1e-10) - 1e-5) (huber),
       sigma ((e + 1e-10)^p - 1e-10^p) / p (ghuber, the authors' recipes: p = 1/4)
    ratio = exp(log p_theta - log p_old),  L = mean(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps)))
            + beta mean((v_theta - v_ref)^2) + beta_ema mean((v_theta - v_ema)^2)
with p_old the sampling policy, v_ref the reference (the policy as RL starts) and v_ema the EMA policy
(``ema_policy``). On policy the gradient is A grad w: pretraining's loss, weighted by advantages. Until the first
optimizer step on a batch, v_old is v_theta itself, detached: the ratio is 1 exactly (no-grad and grad compiled
graphs round apart) and no sampling-policy copy is run; at one optimizer step per batch (the default, and the
authors' recipes) none is kept either. Samples whose reward failed get weight 0. Departures (docs/departures.md,
Algorithms): logit-normal noise levels by default (``time_type`` "discrete" / "discrete_wo_init" draw the
sampler's, as theirs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from trainer.algorithms.base import AlgorithmDefaults, LossContext, Rewards, mark_on_policy, refresh_reference
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    NoiseDraws,
    stratified_steps,
    weighted_plan,
)
from trainer.algorithms.core_algos import TimeWeighting, awm_loss, group_advantages, per_sample_mse, weighted_mean
from trainer.algorithms.ema_policy import EMAPolicy, ramped_decay
from trainer.config.fields import Bounds, Decay, NonNegativeFloat, PositiveFloat
from trainer.rollout import Rollout
from trainer.state import State


@dataclass
class AWMConfig(CleanSampleConfig):
    """AWM hyper-parameters, defaults those of every one of the authors' recipes (their names in brackets; the
    shared fields: ``CleanSampleConfig``)."""

    name: str = "awm"
    clip_range: Annotated[float, Bounds(0, math.inf, low_open=True)] = 1.0
    """PPO ratio clip eps on the matching log-likelihood ratio [clip_range] (inf: no clipping)."""
    adv_clip: Annotated[float, Bounds(0, math.inf, low_open=True)] = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip] [adv_clip_max]."""
    advantage_max: NonNegativeFloat = 1.0
    """Clipped advantages are rescaled to A advantage_max / adv_clip [advantage_max]; 0: not rescaled."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's [sample.global_std]."""
    time_weighting: TimeWeighting = "ghuber"
    """w in log p = -w(sigma, e) [weighting: Uniform, t, t**2, huber, ghuber]: the error, sigma or sigma^2 times
    it, or sigma times its (generalised) Huber loss, which grows like e^p: errors already small count more."""
    ghuber_power: PositiveFloat = 0.25
    """p of the ghuber weighting [ghuber_power]."""
    kl_beta: NonNegativeFloat = 0.0
    """Weight of mean((v_theta - v_ref)^2) to the reference, the policy as RL starts [beta, kl_weight Uniform]."""
    ema_kl_beta: NonNegativeFloat = 1.0
    """Weight of mean((v_theta - v_ema)^2) to the EMA policy [ema_beta, kl_ema_weight Uniform]; 0: none kept."""
    ema_decay: Decay = 0.3
    """Cap of the EMA policy's decay: ema <- d ema + (1 - d) policy, d = min(ema_decay, ema_decay_ramp k)
    after k optimizer steps [kl_ema_decay]."""
    ema_decay_ramp: NonNegativeFloat = 1e-3
    """Growth of that decay per optimizer step, k counted as epochs x inner_epochs x steps_per_epoch
    [kl_ema_decay_type linear: 0.001]; 0: d = ema_decay throughout [constant]."""
    time_type: Literal["logit_normal", "discrete", "discrete_wo_init"] = "logit_normal"
    """Noise levels [time_type]: logit-normal (``logit_mean``, ``logit_std``), or the rollout schedule's at
    step indices stratified over [0, T timestep_fraction) ("discrete") or [1, T timestep_fraction)."""
    timestep_fraction: Annotated[float, Bounds(0, 1, low_open=True)] = 0.9
    """"discrete*": the share of the T sampler steps whose noise levels are drawn [timestep_fraction]."""

    def __post_init__(self):
        super().__post_init__()
        if self.time_type != "logit_normal" and int(self.sampler.num_steps * self.timestep_fraction) <= 1:
            raise ValueError(
                f"time_type={self.time_type} draws steps below int(num_steps x timestep_fraction) = "
                f"{int(self.sampler.num_steps * self.timestep_fraction)}: raise either"
            )


@dataclass
class AWMBatch:
    rollout: Rollout
    advantages: torch.Tensor  # [B] this rank's samples
    weights: torch.Tensor  # [B] 0 where the reward failed
    rewards: Rewards
    plans: int = 0  # plans made of this batch: the first one's first optimizer step is on policy


class AWM(AlgorithmDefaults):
    """Advantage weighted matching on clean rollout samples."""

    config_class = AWMConfig
    shown_metrics = ("matching_loss", "clip_frac")

    def __init__(self, config: AWMConfig):
        super().__init__(config)
        self.needs_reference = config.kl_beta > 0
        off_policy = config.inner_epochs > 1 or config.steps_per_epoch > 1  # steps after the first
        self.sampling = EMAPolicy("awm_sampling") if off_policy else None  # p_old: copied before each rollout
        self.ema = EMAPolicy("awm_ema") if config.ema_kl_beta > 0 else None

    def setup(self, adapter, example, backend) -> None:
        for policy in (self.sampling, self.ema):
            if policy is not None:
                policy.setup(adapter, backend)

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        if self.needs_reference and ctx.reference is None:  # none: RL not started by Trainer.fit
            refresh_reference(ctx)
        if self.sampling is not None:
            self.sampling.update(0.0)  # p_old: the policy that samples this epoch
        if self.ema is not None:  # after k steps the authors' update uses d(k); a copy as RL starts
            cfg = self.config
            steps = epoch * cfg.inner_epochs * cfg.steps_per_epoch
            self.ema.update(ramped_decay(cfg.ema_decay, cfg.ema_decay_ramp, steps) if epoch else 0.0)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> AWMBatch:
        cfg = self.config
        adv = group_advantages(rewards.all, rewards.group_ids_all, cfg.global_std, cfg.adv_clip)
        if cfg.advantage_max > 0:
            adv = adv / cfg.adv_clip * cfg.advantage_max
        return AWMBatch(rollout, rewards.local_rows(adv), (~torch.isnan(rewards.local)).float(), rewards)

    def plan(self, batch: AWMBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """The batch's clean samples, weighted by reward (``clean_sample.weighted_plan``); "discrete*" noise
        levels: one step index per sample in each of ``noise_draws`` strata of the trained steps."""
        cfg, ro = self.config, batch.rollout
        draws = None
        if cfg.time_type != "logit_normal":
            lo, hi = int(cfg.time_type == "discrete_wo_init"), int(cfg.sampler.num_steps * cfg.timestep_fraction)
            steps = stratified_steps(lo, hi, cfg.noise_draws, len(ro.latents), generator)
            draws = NoiseDraws.at_steps(ro.sigmas, steps, ro.latents[:, -1], generator)
        return mark_on_policy(batch, weighted_plan(batch, cfg, generator, draws))

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, idx, cfg = unit.batch, unit.rows, self.config
        ro = batch.rollout
        x_t, target = ctx.adapter.training_target(ro.latents[idx, -1], unit.draw.noise, unit.draw.sigma)
        cond, sigma = ro.cond.select(idx), unit.draw.sigma
        v_old = None if unit.on_policy else self.sampling.predict(ctx, x_t, sigma, cond)
        v_ema = self.ema.predict(ctx, x_t, sigma, cond) if self.ema is not None else None
        with torch.no_grad():
            v_ref = ctx.adapter.predict(ctx.reference, x_t, sigma, cond, 1.0) if cfg.kl_beta > 0 else None
        v_theta = ctx.adapter.predict(ctx.policy, x_t, sigma, cond, 1.0)
        v_old = v_theta.detach() if v_old is None else v_old
        weights = batch.weights[idx].to(v_theta.device)  # host-side rewards
        loss, stats = awm_loss(
            v_theta,
            v_old,
            target,
            batch.advantages[idx].to(v_theta.device),
            sigma.float().to(v_theta.device),
            cfg.clip_range,
            weights,
            cfg.time_weighting,
            cfg.ghuber_power,
        )
        with torch.no_grad():
            stats["matching_loss"] = weighted_mean(per_sample_mse(v_theta, target), weights)
        for name, beta, v in (("kl", cfg.kl_beta, v_ref), ("ema_kl", cfg.ema_kl_beta, v_ema)):
            if beta > 0:
                kl = weighted_mean(per_sample_mse(v_theta, v), weights)
                loss, stats[name] = loss + beta * kl, kl.detach()
        return loss * unit.share, stats

    def batch_metrics(self, batch: AWMBatch) -> dict[str, float]:
        adv = batch.advantages
        return {"adv_abs_mean": float(adv.abs().mean()), "adv_max": float(adv.abs().max())}

    def checkpoint_state(self) -> dict[str, State]:
        return self.ema.checkpoint_state() if self.ema is not None else {}  # p_old is copied before each epoch

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if self.ema is not None:
            self.ema.load_checkpoint_state(saved, source)
