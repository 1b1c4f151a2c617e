"""PPO with a learned critic: advantages from a value network instead of a group or batch baseline.

A value network V(x_t, t, c) predicts the final reward from an intermediate latent. The reward arrives
after the last denoising step, so generalised advantage estimation over the T steps (``gae``) gives
    delta_t = V_{t+1} - V_t,   delta_{T-1} = r - V_{T-1},   A_t = delta_t + lam A_{t+1}   (gamma = 1)
(lam = 1: A_t = r - V(x_t)), normalised over this rank's trained steps (``core_algos.critic_advantages``), and the
loss is
    L = clipped policy loss(A) + c_v mean((V(x_t) - R_t)^2),   R_t = A_t + V_t (before normalising)
Departures from Flow-GRPO's PPO baseline: advantages are per step (the critic sees x_t), and the critic
sees the conditioning through its text embeddings mean-pooled over tokens (image conditioning is not
an input). The critic is trained with its own AdamW (``critic_learning_rate``) in the same backward.
Departures from verl's GAE and value loss (core_algos.py): advantages are normalised by the population std + 1e-4
(verl: sqrt(Bessel-corrected variance + 1e-8)), and values are not clipped (verl: cliprange_value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.algorithms.base import LossContext, Rewards
from trainer.algorithms.core_algos import critic_advantages, value_loss, weighted_mean
from trainer.algorithms.policy_gradient import (
    ClippedPolicyGradient,
    PolicyGradientBatch,
    PolicyGradientConfig,
    StepUnit,
    step_loss,
    trainable_steps,
)
from trainer.config.fields import NonNegativeFloat, PositiveInt, Probability
from trainer.models.base import Conditioning, ModelAdapter
from trainer.rollout import Rollout
from trainer.state import State


@dataclass
class PPOCriticConfig(PolicyGradientConfig):
    """PPO-with-critic hyper-parameters (policy fields as in GRPO)."""

    name: str = "ppo_critic"
    group_size: PositiveInt = 1
    gae_lambda: Probability = 1.0
    """GAE lambda over denoising steps: 1 uses r - V(x_t); lower trusts the critic's later values more."""
    value_coef: NonNegativeFloat = 0.5
    """Weight of the value loss in the summed loss."""
    critic_learning_rate: NonNegativeFloat = 1e-3
    """AdamW learning rate of the value network (it must track the policy, so faster than the policy's)."""
    critic_hidden: PositiveInt = 256
    """Width of the value network's two hidden layers."""
    critic_latent_features: PositiveInt = 1024
    """Latent elements the value network sees after average pooling (fewer when the latent is smaller)."""


def condition_vector(cond: Conditioning) -> torch.Tensor:
    """[B, D]: every text embedding mean-pooled over its token dimensions, concatenated (sorted by name);
    padded text (``cond.ragged``) is averaged over its real tokens alone, so D does not depend on the batch's
    longest prompt."""
    mask = cond.embeds[cond.text_mask].float() if cond.text_mask else None
    parts = []
    for name in sorted(cond.embeds):
        if name == cond.text_mask:
            continue
        e = cond.embeds[name].float()
        if name in cond.ragged:
            weights = mask.view(*mask.shape, *[1] * (e.ndim - 2))
            e = weighted_mean(e, weights, dim=1, keepdim=True)
        parts.append(e.mean(dim=tuple(range(1, e.ndim - 1))) if e.ndim > 2 else e.reshape(len(e), -1))
    return torch.cat(parts, dim=1)


def timestep_embedding(t: torch.Tensor, dim: int = 64) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled to [0, 1000] as diffusion models do): [B, dim]."""
    freqs = torch.exp(-math.log(10_000) * torch.arange(dim // 2, device=t.device) / (dim // 2))
    angles = 1000 * t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class ValueNetwork(nn.Module):
    """V(x_t, t, c) -> [B]: average-pooled latent, timestep features and pooled text embeddings into an MLP."""

    def __init__(self, latent_numel: int, cond_dim: int, hidden: int, latent_features: int):
        super().__init__()
        self.latent_features = min(latent_numel, latent_features)
        self.mlp = nn.Sequential(
            nn.Linear(self.latent_features + 64 + cond_dim, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, latents: torch.Tensor, t: torch.Tensor, cond_vec: torch.Tensor) -> torch.Tensor:
        flat = latents.float().reshape(len(latents), 1, -1)
        pooled = F.adaptive_avg_pool1d(flat, self.latent_features).flatten(1)
        return self.mlp(torch.cat([pooled, timestep_embedding(t), cond_vec.float()], dim=1)).squeeze(1)


class PPOCritic(ClippedPolicyGradient):
    """Clipped policy optimisation with GAE advantages from a learned value network."""

    config_class = PPOCriticConfig
    shown_metrics = ("approx_kl", "clip_frac", "value_loss")

    def __init__(self, config: PPOCriticConfig):
        super().__init__(config)
        self.critic: ValueNetwork | None = None
        self.critic_train: nn.Module | None = None
        self.backend = None

    def setup(self, adapter: ModelAdapter, example: Conditioning, backend) -> None:
        latent_numel = math.prod(adapter.latent_shape)
        device = next(adapter.denoiser.parameters()).device
        self.backend = backend
        self.critic = ValueNetwork(
            latent_numel,
            condition_vector(example).shape[1],
            self.config.critic_hidden,
            self.config.critic_latent_features,
        ).to(device)
        self.critic_train = backend.prepare_auxiliary(
            self.critic, lambda params: torch.optim.AdamW(params, lr=self.config.critic_learning_rate)
        )

    @torch.no_grad()
    def values(self, rollout: Rollout) -> torch.Tensor:
        """V(x_t) [B, T] of every recorded latent before each step."""
        cond = condition_vector(rollout.cond)
        b, t = rollout.log_probs.shape
        rows = [self.critic(rollout.latents[:, i], rollout.sigmas[i].expand(b), cond) for i in range(t)]
        return torch.stack(rows, dim=1)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> PolicyGradientBatch:
        if self.critic is None:
            raise RuntimeError("PPOCritic.setup must run before training (the Trainer calls it)")
        values = self.values(rollout)
        steps = trainable_steps(rollout)
        local = rewards.local.to(values.device)
        adv, returns = critic_advantages(local, values, self.config.gae_lambda, steps, self.config.adv_clip)
        return PolicyGradientBatch(rollout, adv, steps, rewards, returns)

    def loss(self, ctx: LossContext, unit: StepUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = step_loss(ctx, unit, self.config)
        ro = unit.batch.rollout
        predicted = self.critic_train(
            ro.latents[unit.indices, unit.steps], ro.sigmas[unit.steps], condition_vector(ro.cond.select(unit.indices))
        )
        value = value_loss(predicted, unit.batch.returns[unit.indices, unit.steps])
        stats["value_loss"] = value.detach()
        return (loss + self.config.value_coef * value) * unit.share, stats

    def batch_metrics(self, batch: PolicyGradientBatch) -> dict[str, float]:
        steps = batch.train_steps
        return {**super().batch_metrics(batch), "value_target_mean": float(batch.returns[:, steps].mean())}

    def _shards(self) -> dict[str, torch.Tensor]:
        """This rank's shards of the critic's tensors, by name (under FSDP2 its parameters are sharded)."""
        live = {f"critic.{k}": v for k, v in self.critic.state_dict().items()}
        return dict(zip(live, self.backend.local_shards(live.values()), strict=True))

    def checkpoint_state(self) -> dict[str, State]:
        return {"algorithm": State(self._shards(), per_rank=True)}

    @torch.no_grad()
    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        """Write this rank's saved shards into the live ones (whole tensors would not fit sharded ones)."""
        values = saved.get("algorithm", {})
        for name, shard in self._shards().items():
            value = values.get(name)
            if value is None or value.shape != shard.shape:
                held = "nothing" if value is None else tuple(value.shape)
                raise ValueError(
                    f"{source} holds {held} for {name} on rank {self.backend.world.rank}, where this "
                    f"run's shard is {tuple(shard.shape)}: resume with the algorithm settings, "
                    "parallel.backend and number of ranks the checkpoint was made with"
                )
            shard.copy_(value)
