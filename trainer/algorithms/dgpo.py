"""DGPO (Direct Group Preference Optimization): DPO between the better and the worse part of each group of
the policy's own clean samples. No stochastic policy is needed, so rollouts may be deterministic (ODE).

A group of G samples of one prompt gets group-relative advantages A_i. With the denoising losses
l(x_i) = mean((model(x_sigma, sigma, c) - target)^2) at a noise level and noise shared by the group, and
the implicit reward r_i = -beta (l_theta(x_i) - l_ref(x_i)), the group-level Bradley-Terry preference of
G+ (A > 0) over G- (A < 0), each sample weighted by |A_i| / G, has the log-likelihood
    log sigmoid(-s_g),   s_g = beta / G sum_i A_i (l_theta(x_i) - l_ref(x_i)).
The authors train on its gradient divided by beta (``loss_form`` "sigmoid_weighted", the default):
    L = mean over samples of sigmoid(s_g).detach() A_i l_theta(x_i)
an advantage-weighted denoising loss whose weight fades once the policy prefers the group's better part more
than the reference does (1/2 at the reference); "softplus" is the log-likelihood itself, softplus(s_g) per
group, whose gradient is beta times theirs. As the authors' code does, a sample's loss is detached where it has
already moved past a PPO-style clip against the EMA policy (``clip_range``), and beta_KL mean((v_theta -
v_ref)^2) keeps the policy near the reference. Departures: docs/departures.md (Algorithms): logit-normal noise
levels by default (``time_type`` "discrete" draws the sampler's, as theirs), the EMA policy updated before
each epoch (theirs after each optimizer step: the same at their one step per epoch), rollouts always by the
policy (theirs by the EMA policy after ``switch_ema_ref`` steps), the KL reference without CFG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from trainer.algorithms.base import AlgorithmDefaults, LossContext, Rewards, refresh_reference, set_shares
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    NoiseDraws,
    draw_units,
    split_units,
)
from trainer.algorithms.core_algos import (
    clip_denoising_loss,
    dgpo_loss,
    group_advantages,
    per_sample_mse,
    weighted_mean,
)
from trainer.algorithms.ema_policy import EMAPolicy, ramped_decay
from trainer.config.fields import Bounds, Decay, NonNegativeFloat, NonNegativeInt, PositiveFloat
from trainer.rollout import Rollout
from trainer.state import State


@dataclass
class DGPOConfig(CleanSampleConfig):
    """DGPO hyper-parameters, defaults the authors' (their names in brackets; the shared fields:
    ``CleanSampleConfig``; ``micro_batch_size`` is rounded down to whole groups, at least one)."""

    name: str = "dgpo"
    beta: PositiveFloat = 100.0
    """DPO's inverse temperature on the group's advantage-weighted denoising-loss gap [beta_dpo]."""
    loss_form: Literal["sigmoid_weighted", "softplus"] = "sigmoid_weighted"
    """"sigmoid_weighted": the authors' loss, sigmoid(s).detach() A l; "softplus": the group preference's
    negative log-likelihood, the same gradient times beta (the same step under Adam up to gradient clipping)."""
    adv_clip: Annotated[float, Bounds(0, math.inf, low_open=True)] = 5.0
    """Advantages are clipped to [-adv_clip, adv_clip] [adv_clip_max]."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's [sample.global_std]."""
    clip_range: Annotated[float, Bounds(0, math.inf, low_open=True)] = 1e-2
    """PPO-style clip eps of the denoising loss against the EMA policy [clip_range, clip_dsm]; inf: no clip (and
    no EMA policy forward)."""
    kl_beta: NonNegativeFloat = 0.0
    """Weight of mean((v_theta - v_ref)^2), the velocity gap to the reference [train.beta]."""
    ema_decay: Decay = 0.3
    """Cap of the EMA policy's decay: ema <- d ema + (1 - d) policy, d = min(ema_decay, ema_decay_ramp k)."""
    ema_decay_ramp: NonNegativeFloat = 1e-3
    """Growth of that decay per optimizer step k (k counted as epochs x inner_epochs x steps_per_epoch, from 0
    before the first update, as the authors'); 0: d = ema_decay throughout."""
    dpo_reference: Literal["reference", "ema"] = "reference"
    """The l_ref of the preference: the reference ("reference": the policy as RL starts, refreshed every
    ``ref_refresh_every`` epochs) or the EMA policy ("ema": the authors' use_ema_ref, with beta ~2000)."""
    ref_refresh_every: NonNegativeInt = 0
    """Copy the policy into the reference every N RL epochs; 0 keeps the reference made as RL starts."""
    time_type: Literal["logit_normal", "discrete"] = "logit_normal"
    """Noise levels: logit-normal (``logit_mean``, ``logit_std``), or "discrete": the authors', ``noise_draws``
    distinct steps of the rollout's schedule among its first trunc_steps + 1, the same for every group."""
    trunc_steps: NonNegativeInt = 4
    """"discrete": the last step index drawn [trunc_steps] (4 of 10 steps: sigma >= shift(0.3) at shift 3), at most
    the rollout's last."""

    def __post_init__(self):
        super().__post_init__()
        if self.time_type == "discrete" and self.noise_draws > min(self.trunc_steps + 1, self.sampler.num_steps):
            raise ValueError(
                f"time_type=discrete draws noise_draws={self.noise_draws} distinct steps among the first "
                f"trunc_steps + 1 = {self.trunc_steps + 1} of the {self.sampler.num_steps} sampler steps: "
                "lower noise_draws or raise trunc_steps"
            )


@dataclass
class DGPOBatch:
    rollout: Rollout
    groups: torch.Tensor  # [M, G] local sample indices of this rank's groups
    advantages: torch.Tensor  # [B] this rank's samples
    weights: torch.Tensor  # [M] 1 where a group has a reward, 0 where all of its rewards failed
    rewards: Rewards


class DGPO(AlgorithmDefaults):
    """Direct group preference optimisation on clean rollout samples."""

    config_class = DGPOConfig
    needs_reference = True
    local_groups = True
    shown_metrics = ("dgpo_loss",)

    def __init__(self, config: DGPOConfig):
        super().__init__(config)
        self.needs_reference = config.dpo_reference == "reference" or config.kl_beta > 0
        uses_ema = math.isfinite(config.clip_range) or config.dpo_reference == "ema"
        self.ema = EMAPolicy("dgpo_ema") if uses_ema else None

    def setup(self, adapter, example, backend) -> None:
        if self.ema is not None:
            self.ema.setup(adapter, backend)

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        every = self.config.ref_refresh_every
        if self.needs_reference and (ctx.reference is None or (every and epoch % every == 0)):
            refresh_reference(ctx)  # none: RL not started by Trainer.fit
        if self.ema is not None:  # the authors' update after optimizer step k uses d(k - 1); at RL start: a copy
            steps = epoch * self.config.inner_epochs * self.config.steps_per_epoch
            cfg = self.config
            self.ema.update(ramped_decay(cfg.ema_decay, cfg.ema_decay_ramp, steps - 1) if epoch else 0.0)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> DGPOBatch:
        adv = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std, self.config.adv_clip)
        ids = rewards.local_rows(rewards.group_ids_all)
        groups = torch.stack([torch.nonzero(ids == g).flatten() for g in torch.unique(ids)])
        valid = ~torch.isnan(rewards.local)
        return DGPOBatch(rollout, groups, rewards.local_rows(adv), valid[groups].any(dim=1).float(), rewards)

    def plan(self, batch: DGPOBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """Every group under each of ``noise_draws`` draws (one noise level and noise per group), in shuffled
        micro-batches of whole groups, cut into ``steps_per_epoch`` optimizer steps; a step's loss is the mean
        over its groups. "discrete": draw d's step is the same for every group, the draws' steps distinct."""
        cfg = self.config
        per_unit = max(1, cfg.micro_batch_size // cfg.group_size)
        x0 = batch.rollout.latents[batch.groups[:, 0], -1]
        draws = None
        if cfg.time_type == "discrete":
            first = min(cfg.trunc_steps + 1, len(batch.rollout.sigmas) - 1)  # never the final noise level, 0
            steps = torch.randperm(first, generator=generator)[: cfg.noise_draws]
            draws = NoiseDraws.at_steps(batch.rollout.sigmas, steps[:, None].expand(-1, len(x0)), x0, generator)
        units = draw_units(x0, cfg, generator, per_unit, lambda rows, draw: CleanUnit(batch, rows, draw), draws)
        return set_shares(split_units(units, cfg.steps_per_epoch), lambda unit: float(batch.weights[unit.rows].sum()))

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch, rows, draw, cfg = unit.batch, unit.rows, unit.draw, self.config
        ro = batch.rollout
        m, g = len(rows), batch.groups.shape[1]
        samples = batch.groups[rows].reshape(-1)
        sigma, noise = draw.sigma.repeat_interleave(g), draw.noise.repeat_interleave(g, dim=0)
        x_t, target = ctx.adapter.training_target(ro.latents[samples, -1], noise, sigma)
        cond = ro.cond.select(samples)
        v_ema = self.ema.predict(ctx, x_t, sigma, cond) if self.ema is not None else None
        with torch.no_grad():
            v_ref = ctx.adapter.predict(ctx.reference, x_t, sigma, cond, 1.0) if self.needs_reference else None
        v_theta = ctx.adapter.predict(ctx.policy, x_t, sigma, cond, 1.0)
        policy = per_sample_mse(v_theta, target)
        adv = batch.advantages[samples].to(policy.device)  # host-side rewards
        stats = {"denoise_loss": policy.detach().mean()}
        if math.isfinite(cfg.clip_range):
            policy, clipped = clip_denoising_loss(policy, per_sample_mse(v_ema, target), adv, cfg.clip_range)
            stats["clip_frac"] = clipped.float().mean()
        ref = per_sample_mse(v_ref if cfg.dpo_reference == "reference" else v_ema, target)
        per_group, preference = dgpo_loss(
            policy.reshape(m, g), ref.reshape(m, g), adv.reshape(m, g), cfg.beta, cfg.loss_form
        )
        w = batch.weights[rows].to(per_group.device)
        loss = weighted_mean(per_group, w)
        stats["dgpo_loss"], stats["dgpo_weight"] = loss.detach(), weighted_mean(preference, w)
        if cfg.kl_beta > 0:
            kl = per_sample_mse(v_theta, v_ref).reshape(m, g).mean(dim=1)
            stats["kl"] = weighted_mean(kl.detach(), w)
            loss = loss + cfg.kl_beta * weighted_mean(kl, w)
        return loss * unit.share, stats

    def batch_metrics(self, batch: DGPOBatch) -> dict[str, float]:
        return {"adv_abs_mean": float(batch.advantages.abs().mean()), "groups": float(len(batch.groups))}

    def checkpoint_state(self) -> dict[str, State]:
        return self.ema.checkpoint_state() if self.ema is not None else {}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if self.ema is not None:
            self.ema.load_checkpoint_state(saved, source)
