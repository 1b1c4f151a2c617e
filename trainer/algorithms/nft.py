"""DiffusionNFT: policy optimisation on the forward (noising) process of the old policy's clean samples.

No log-probabilities, so any sampler (the deterministic one by default) and no CFG. The old policy samples the
epoch's rollout (``rollout_weights``); each clean sample x0 with reward r gets an optimality probability from its
group-relative advantage A (clipped to [-s, s]),
    r~ = 0.5 + 0.5 clip(A / s, -1, 1),
and at noise levels sigma of the rollout's own schedule, x_sigma and the flow-matching target v come from the
forward process:
    v+ = (1 - beta) v_old + beta v_theta,   v- = (1 + beta) v_old - beta v_theta
    e+- = k (v+- - v)   (the error of the clean sample x_sigma and v+- imply; k = sigma for flow models)
    l(e) = mean(e^2) / sg(max(mean |e|, 1e-5))                      (adaptive weight)
    L  = c / beta [r~ l(e+) + (1 - r~) l(e-)] + w_kl mean((v_theta - v_ref)^2)
Good samples pull the policy towards their target, bad ones push it away, both relative to v_old, the old
policy's velocity; v_ref is the base model's. The old policy follows the policy before every epoch's rollout:
old <- d old + (1 - d) policy, d = min(rate (n - delay), d_max) after n optimizer steps (0 before the delay).
As NVlabs/DiffusionNFT's train_nft_sd3.py (tests/parity/test_nft.py). Departures (docs/departures.md): samples
with a failed reward get weight 0; the default rollout step is Euler (the presets take the authors' DPM-Solver++(2M),
``sampler.ode_order: 2``); rollouts read exact timesteps, not integer-truncated ones. ``noise_levels: logit_normal``
offers SD3's training density instead of the schedule's levels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trainer.algorithms.base import AlgorithmDefaults, LossContext, Rewards
from trainer.algorithms.clean_sample import (
    CleanSampleConfig,
    CleanUnit,
    NoiseDraws,
    weighted_plan,
)
from trainer.algorithms.core_algos import (
    group_advantages,
    nft_loss,
    optimality_probability,
    per_sample_mse,
    weighted_mean,
)
from trainer.config.fields import Decay, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from trainer.ema import Shadow
from trainer.models.base import Conditioning, ModelAdapter
from trainer.rollout import Rollout
from trainer.state import State


@dataclass
class NFTConfig(CleanSampleConfig):
    """DiffusionNFT hyper-parameters (the shared fields: ``CleanSampleConfig``); defaults are the authors'."""

    name: str = "nft"
    beta: PositiveFloat = 1.0
    """Mixing strength of the implicit positive / negative policies (the paper's beta; the authors' config.beta)."""
    optimality_scale: PositiveFloat = 5.0
    """s: advantages are clipped to [-s, s] and mapped to r~ = 0.5 + 0.5 A / s (the authors' adv_clip_max)."""
    loss_scale: PositiveFloat = 5.0
    """c: the policy loss is c / beta times the optimality-weighted errors (the authors scale by adv_clip_max and
    divide by beta); beta here gives the unscaled loss."""
    adaptive_weight: bool = True
    """Divide each sample's squared clean-sample error by its own detached mean absolute error (the authors'
    weighting); false: the plain regression error mean((v+- - v)^2)."""
    kl_weight: NonNegativeFloat = 1e-4
    """Weight of mean((v_theta - v_ref)^2), v_ref the base model's velocity (the authors' train.beta). With LoRA the
    base is the policy with its adapter disabled: no memory, one more forward per micro-batch. With full fine-tuning
    it is a frozen copy of the weights as RL starts: one more denoiser in memory on every rank. 0: neither."""
    global_std: bool = True
    """Normalise advantages by the std of the whole gathered batch instead of each group's."""
    old_decay: Decay = 0.5
    """Most the old policy's decay d reaches; before each epoch's rollout old <- d old + (1 - d) policy. The old
    policy is a float32 copy of the trainable weights (LoRA: the adapters'; this rank's shards where sharded),
    swapped into the policy's network for its forwards."""
    old_decay_rate: NonNegativeFloat = 1e-3
    """d's rise per optimizer step: d = min(rate (n - old_decay_delay), old_decay) after n steps (the authors'
    decay_type 1: rate 0.001 to 0.5; type 2: delay 75, rate 0.0075 to 0.999); 0: d = old_decay from the start."""
    old_decay_delay: NonNegativeInt = 0
    """Optimizer steps during which d = 0 (the old policy is a copy of the policy before each rollout)."""
    noise_levels: Literal["schedule", "logit_normal"] = "schedule"
    """Where each sample's ``noise_draws`` trained noise levels come from: "schedule": distinct levels of its
    rollout's T-step schedule (the sampler's own, as the authors); "logit_normal": SD3's training density."""
    noise_draws: PositiveInt = 9
    """Noise levels (each with fresh noise) per sample per inner epoch; with "schedule" at most T, each level once
    (the authors train int(0.99 T): 9 of 10 steps, 24 of 25)."""


@dataclass
class NFTBatch:
    rollout: Rollout
    optimality: torch.Tensor  # [B] r~ of this rank's samples
    weights: torch.Tensor  # [B] 0 where the reward failed
    rewards: Rewards


class OldPolicy(Shadow):
    """The old (sampling) policy's trainable weights, swapped into the policy's network to run it."""

    what = "DiffusionNFT old policy"


def old_decay(config: NFTConfig, steps: int) -> float:
    """The old policy's decay d after ``steps`` optimizer steps: 0 before ``old_decay_delay``, then
    min(rate (steps - delay), old_decay), or old_decay at rate 0 (the authors' ``return_decay``)."""
    if steps < config.old_decay_delay:
        return 0.0
    if config.old_decay_rate == 0:
        return config.old_decay
    return min((steps - config.old_decay_delay) * config.old_decay_rate, config.old_decay)


def schedule_draws(sigmas: torch.Tensor, x0: torch.Tensor, draws: int, generator: torch.Generator) -> NoiseDraws:
    """``draws`` (at most T) distinct levels of the T-step schedule ``sigmas`` [T+1] for each row of ``x0``, each
    row in an order of its own, with fresh noise: the authors shuffle every sample's sampler timesteps and train
    the first int(0.99 T)."""
    num_steps = len(sigmas) - 1
    order = torch.argsort(torch.rand(len(x0), num_steps, generator=generator), dim=1)
    return NoiseDraws.at_steps(sigmas, order[:, :draws].T, x0, generator)


def x0_error_scale(training_target: Callable, sigma: torch.Tensor) -> torch.Tensor:
    """k [B] with |x0_hat - x0| = k |prediction - target|: how a regression error shows in the clean sample it
    implies (sigma for flow models, sqrt(1 - abar) / sqrt(abar) for epsilon ones). An adapter's ``training_target``
    is affine, x_t = a x0 + s eps and target = c x0 + d eps, so x0_hat = (x_t - s p / d) / (a - s c / d) and
    k = s / (a d - s c)."""
    ones = torch.ones(len(sigma), 1, device=sigma.device)
    a, c = training_target(ones, torch.zeros_like(ones), sigma)
    s, d = training_target(torch.zeros_like(ones), ones, sigma)
    return (s / (a * d - s * c)).flatten().abs()


class NFT(AlgorithmDefaults):
    """DiffusionNFT on the old policy's clean rollout samples."""

    config_class = NFTConfig
    shown_metrics = ("nft_loss",)

    def __init__(self, config: NFTConfig):
        super().__init__(config)
        self.needs_reference = config.kl_weight > 0  # the base model of the KL term
        self.old: OldPolicy | None = None  # built once the policy is prepared (``setup``)
        self.optimizer_steps = 0  # planned so far: the old policy's decay follows them
        self.old_differs = False  # whether this epoch's old policy holds other weights than the policy

    def setup(self, adapter: ModelAdapter, example: Conditioning, backend: Any) -> None:
        params = list(adapter.trainable.parameters())
        shards = backend.local_shards(params)
        self.old = OldPolicy(shards, any(s.shape != p.shape for s, p in zip(shards, params, strict=True)))

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        """old <- d old + (1 - d) policy before the rollout; before the first optimizer step, a copy."""
        decay = old_decay(self.config, self.optimizer_steps) if self.optimizer_steps else 0.0
        self.old.follow(decay)
        self.old_differs = decay > 0

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """The old policy samples (the policy's own weights while the old one is their copy)."""
        return self.old.swapped() if self.old_differs else contextlib.nullcontext()

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> NFTBatch:
        scale = self.config.optimality_scale
        adv = group_advantages(rewards.all, rewards.group_ids_all, self.config.global_std, clip=scale)
        optimality = optimality_probability(rewards.local_rows(adv), scale)
        return NFTBatch(rollout, optimality, (~torch.isnan(rewards.local)).float(), rewards)

    def plan(self, batch: NFTBatch, generator: torch.Generator) -> list[list[CleanUnit]]:
        """The batch's clean samples at the schedule's (or logit-normal) levels, weighted by reward
        (``clean_sample.weighted_plan``)."""
        draws = None
        if self.config.noise_levels == "schedule":
            ro = batch.rollout
            draws = schedule_draws(ro.sigmas, ro.latents[:, -1], self.config.noise_draws, generator)
        steps = weighted_plan(batch, self.config, generator, draws)
        self.optimizer_steps += len(steps)
        return steps

    def loss(self, ctx: LossContext, unit: CleanUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        config, batch, idx, draw = self.config, unit.batch, unit.rows, unit.draw
        ro = batch.rollout
        x_t, target = ctx.adapter.training_target(ro.latents[idx, -1], draw.noise, draw.sigma)
        cond = ro.cond.select(idx)
        predict = lambda net: ctx.adapter.predict(net, x_t, draw.sigma, cond, 1.0).float()  # noqa: E731
        with torch.no_grad(), self.old.swapped():  # the old weights in the policy's network, bit for bit back after
            v_old = predict(ctx.adapter.denoiser)
        v_theta = predict(ctx.policy)
        scale = x0_error_scale(ctx.adapter.training_target, draw.sigma) if config.adaptive_weight else None
        optimality = batch.optimality[idx].to(v_theta.device)  # host-side rewards
        w = batch.weights[idx].to(v_theta.device)
        mean = lambda x: weighted_mean(x, w)  # noqa: E731
        policy = mean(nft_loss(v_theta, v_old, target.float(), optimality, config.beta, scale))
        loss = policy * (config.loss_scale / config.beta)
        stats = {"nft_loss": policy.detach(), "old_deviation": mean(per_sample_mse(v_theta.detach(), v_old))}
        if config.kl_weight > 0:
            with torch.no_grad():
                v_ref = predict(ctx.reference)
            kl = mean(per_sample_mse(v_theta, v_ref))
            loss = loss + config.kl_weight * kl
            stats["kl"] = kl.detach()
        return loss * unit.share, stats

    def batch_metrics(self, batch: NFTBatch) -> dict[str, float]:
        return {
            "optimality_mean": float(batch.optimality.mean()),
            "optimality_extreme_share": float(((batch.optimality - 0.5).abs() == 0.5).float().mean()),
        }

    def checkpoint_state(self) -> dict[str, State]:
        """The old policy's weights and the optimizer steps its decay has counted."""
        steps = {"optimizer_steps": torch.tensor(self.optimizer_steps)}
        return {"nft_old": State({**self.old.state(), **steps}, self.old.per_rank)}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        if "nft_old" not in saved:
            raise ValueError(
                f"{source} holds no DiffusionNFT old policy: resume a run of algorithm.name=nft made with this version"
            )
        state = dict(saved["nft_old"])
        self.optimizer_steps = int(state.pop("optimizer_steps"))
        self.old.load_state(state)
