"""The contract between the training loop and an algorithm.

An algorithm turns experience into optimizer steps: ``make_batch`` builds what it trains on (advantages,
pairs, targets), ``plan`` cuts it into optimizer steps of loss units, and ``loss`` computes one unit's loss.
The trainer only runs backward and steps; it never asks which algorithm it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trainer.models.base import ModelAdapter
from trainer.rollout import Rollout, SamplerSettings


@dataclass
class Rewards:
    """Combined rewards of a rollout, locally and gathered over every rank (NaN = failed, never 0)."""

    local: torch.Tensor           # [B] this rank's samples
    all: torch.Tensor             # [N] every rank's samples, rank-major
    group_ids_all: torch.Tensor   # [N] prompt group of each gathered sample
    offset: int                   # where this rank's samples start in ``all``


@dataclass
class LossContext:
    """What a loss needs to run forwards: the adapter, the policy network (possibly wrapped by the
    parallel backend) and, when the algorithm asked for one, the frozen reference network."""

    adapter: ModelAdapter
    policy: nn.Module
    reference: nn.Module | None


class Algorithm(Protocol):
    """An RL algorithm trained on rollouts. One implementation per file, registered by name."""

    sampler: SamplerSettings
    """How its rollouts are sampled."""
    group_size: int
    """Samples per prompt in a rollout batch (1 when the algorithm does not group)."""
    inner_epochs: int
    """Passes over one rollout batch."""
    needs_reference: bool
    """Whether ``LossContext.reference`` must be provided."""

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> Any: ...

    def plan(self, batch: Any, generator: torch.Generator) -> list[list[Any]]:
        """Optimizer steps for one inner epoch, each a list of loss units whose gradients accumulate."""
        ...

    def loss(self, ctx: LossContext, unit: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def batch_metrics(self, batch: Any) -> dict[str, float]:
        """Per-epoch statistics of the batch (advantages, zero-std share, ...)."""
        ...


def split_steps(num_samples: int, num_steps: int, micro_batch_size: int,
                generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Shuffle sample indices into ``num_steps`` optimizer steps of micro-batches of ``micro_batch_size``."""
    if num_samples % num_steps:
        raise ValueError(f"{num_samples} samples per rank do not split into {num_steps} optimizer steps; "
                         "make the per-rank batch a multiple of algorithm.steps_per_epoch")
    perm = torch.randperm(num_samples, generator=generator)
    per_step = num_samples // num_steps
    return [list(chunk.split(micro_batch_size)) for chunk in perm.split(per_step)]
