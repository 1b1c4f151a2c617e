"""What refl, draft and drtune share: training on a differentiable reward, whose gradient flows back through
decoding into the denoiser.

The rollout (deterministic steps, no gradient) gives each sample's trajectory x_0 .. x_T; each algorithm redoes a
part of it with gradient (``final_latents``), decodes the latent it ends on, scores the image with the in-process
form of the reward's scorer (``scoring``, the code the reward server runs) and minimises -r (or ReFL's hinge).
The served rewards of the rollout are logged, judged and watched by the hacking alarm as for every algorithm.
Departure (all three): the gradient-free prefix is the epoch's rollout, sampled once with the weights at its start
(the authors resample per optimizer step; with ``steps_per_epoch`` 1 and one inner epoch the two are the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.checkpoint import checkpoint

from scoring import DIFFERENTIABLE, build_differentiable, needs_weights
from scoring.frames import score_clips
from trainer.algorithms.base import AlgorithmDefaults, LossContext, Rewards, check_steps, mark_on_policy, set_shares
from trainer.algorithms.core_algos import reward_loss
from trainer.config.fields import FiniteFloat, LocalPath, PositiveInt
from trainer.models.base import Conditioning, ModelAdapter
from trainer.rollout import Rollout, SamplerSettings


@dataclass
class RewardBackpropConfig:
    """What refl, draft and drtune share; each adds how much of the trajectory it redoes with gradient."""

    name: str = ""
    scorer: str = "digit"
    """The reward scorer whose differentiable form is trained on (``scoring.DIFFERENTIABLE``); it must be one of
    reward.weights, which still scores every rollout for logging, the scoreboard and the alarm."""
    scorer_dir: LocalPath = ""
    """The folder of the scorer's weights, laid out as the reward server's ``--model-dir`` (``aesthetic/clip``,
    ``aesthetic/head.pth``); scorers without weights (digit) need none."""
    group_size: PositiveInt = 1
    """Samples per prompt (no grouping is needed: a larger group only samples more images per prompt)."""
    inner_epochs: PositiveInt = 1
    steps_per_epoch: PositiveInt = 1
    """Optimizer steps per inner epoch; the epoch's samples are split evenly between them."""
    micro_batch_size: PositiveInt = 16
    """Samples per forward/backward (gradients accumulate over a step's micro-batches)."""
    loss: Literal["negative", "hinge"] = "negative"
    """"negative": -r; "hinge": relu(margin - r), ReFL's (zero gradient once a sample's reward passes margin)."""
    margin: FiniteFloat = 2.0
    """The hinge's margin (ImageReward's ReFL: 2, on ImageReward's scale)."""
    checkpointing: bool = True
    """Recompute each step's forward in the backward pass (memory of one step's activations, not K)."""
    sampler: SamplerSettings = field(default_factory=lambda: SamplerSettings(noise_level=0.0))
    """Deterministic rollouts: the gradient path redoes their steps, so they must be the ODE's."""

    def __post_init__(self):
        if self.scorer not in DIFFERENTIABLE:
            build_differentiable(self.scorer)  # raises the one-line ValueError naming the choices
        if needs_weights(self.scorer) and not self.scorer_dir:
            raise ValueError(
                f"algorithm.scorer={self.scorer} reads weights: set algorithm.scorer_dir to the folder the reward "
                f"server reads them from (its --model-dir, holding {self.scorer}/)"
            )
        if self.sampler.noise_level != 0 or self.sampler.ode_order != 1:
            raise ValueError(
                f"algorithm.name={self.name} backpropagates through deterministic Euler steps: set "
                "algorithm.sampler.noise_level=0 and ode_order=1"
            )


@dataclass
class RewardBatch:
    rollout: Rollout
    rewards: Rewards
    plans: int = 0  # plans made of it so far (``mark_on_policy``)


@dataclass
class RewardUnit:
    """One micro-batch: rows of the batch and each row's drawn steps ([m] or [m, K], -1 where not drawn)."""

    batch: RewardBatch
    rows: torch.Tensor
    steps: torch.Tensor
    share: float = 0.0
    step_weight: float = 0.0
    on_policy: bool = False


class RewardBackprop(AlgorithmDefaults):
    """The shared plan and loss; a subclass gives ``draw_steps`` and ``final_latents``."""

    config_class = RewardBackpropConfig
    needs_reference = False
    shown_metrics = ("reward_loss", "reward_in_process")
    reproduces_rollout = True
    """Whether ``final_latents`` equals the rollout's final latent before any update (then ``served_gap`` checks the
    in-process reward against the served one)."""

    def __init__(self, config: RewardBackpropConfig):
        super().__init__(config)
        self.scorer = None  # built in ``setup``, on the model's device

    def setup(self, adapter: ModelAdapter, example: Conditioning, backend: Any) -> None:
        if adapter.sampler_kind != "flow":
            raise ValueError(
                f"algorithm.name={self.config.name} needs a flow model; this one samples with "
                f"{adapter.sampler_kind} steps: use a policy-gradient algorithm (e.g. algorithm.name=grpo)"
            )
        scorer = build_differentiable(self.config.scorer, model_dir=self.config.scorer_dir or None)
        self.scorer = scorer.to(adapter.device).requires_grad_(False)

    def check_batch(self, samples_per_rank: int) -> None:
        check_steps(samples_per_rank, self.config.steps_per_epoch)

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> RewardBatch:
        return RewardBatch(rollout, rewards)

    def draw_steps(self, num_samples: int, num_steps: int, generator: torch.Generator) -> torch.Tensor:
        """Each sample's drawn steps for this plan (none by default)."""
        return torch.zeros(num_samples, dtype=torch.long)

    def plan(self, batch: RewardBatch, generator: torch.Generator) -> list[list[RewardUnit]]:
        """Shuffled samples in ``steps_per_epoch`` optimizer steps of micro-batches, with their drawn steps."""
        num = len(batch.rollout.prompts)
        check_steps(num, self.config.steps_per_epoch)
        steps = self.draw_steps(num, len(batch.rollout.sigmas) - 1, generator)
        perm = torch.randperm(num, generator=generator)
        plan = [
            [RewardUnit(batch, rows, steps[rows]) for rows in chunk.split(self.config.micro_batch_size)]
            for chunk in perm.split(num // self.config.steps_per_epoch)
        ]
        return mark_on_policy(batch, set_shares(plan, lambda unit: len(unit.rows)))

    def final_latents(self, ctx: LossContext, unit: RewardUnit) -> torch.Tensor:
        """The latents the unit's images decode from, with gradient to the policy."""
        raise NotImplementedError

    def loss(self, ctx: LossContext, unit: RewardUnit) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ro = unit.batch.rollout
        images = ctx.adapter.decode(self.final_latents(ctx, unit))
        prompts = [ro.prompts[i] for i in unit.rows.tolist()]
        # a clip [B, F, C, H, W] is scored on its frames as the servers score it by default
        rewards = score_clips(self.scorer, images, prompts) if images.ndim == 5 else self.scorer(images, prompts)
        loss = reward_loss(rewards, self.config.loss, self.config.margin).mean()
        stats = {"reward_loss": loss.detach(), "reward_in_process": rewards.detach().mean()}
        if unit.on_policy and self.reproduces_rollout:  # the same image as the served one scored
            served = unit.batch.rewards.local[unit.rows].to(rewards.device)
            stats["served_gap"] = (rewards.detach() - served).abs().nanmean()
        return loss * unit.share, stats

    def batch_metrics(self, batch: RewardBatch) -> dict[str, float]:
        return {}

    def forward(self, ctx: LossContext, ro: Rollout, x: torch.Tensor, step: torch.Tensor, cond: Conditioning):
        """The policy's output at latents ``x`` of steps ``step`` [m], checkpointed when configured."""
        predict = lambda x: ctx.adapter.predict(ctx.policy, x, ro.sigmas[step], cond, ro.guidance_scale)  # noqa: E731
        if self.config.checkpointing and torch.is_grad_enabled():
            return checkpoint(predict, x, use_reentrant=False)
        return predict(x)
