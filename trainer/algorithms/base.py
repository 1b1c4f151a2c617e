"""The contract between the training loop and an algorithm.

An algorithm turns experience into optimizer steps: ``make_batch`` builds what it trains on (advantages,
pairs, targets), ``plan`` cuts it into optimizer steps of loss units, and ``loss`` computes one unit's part
of its step's loss (the step's loss is the sum over its units, whatever their sizes). The trainer only runs
backward and steps; it never asks which algorithm it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from trainer.models.base import Conditioning, ModelAdapter
from trainer.models.reference import FrozenCopy, Reference, frozen_copy
from trainer.rollout import Rollout, SamplerSettings
from trainer.state import State


@dataclass
class Rewards:
    """Combined rewards of a rollout, locally and gathered over every rank (NaN = failed, never 0)."""

    local: torch.Tensor  # [B] this rank's samples
    all: torch.Tensor  # [N] every rank's samples, rank-major
    group_ids_all: torch.Tensor  # [N] prompt group of each gathered sample
    offset: int  # where this rank's samples start in ``all``

    def local_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``gathered``, a tensor in the order of ``all`` (e.g. advantages computed from every
        rank's rewards): what an algorithm trains on, its own samples."""
        return gathered[self.offset : self.offset + len(self.local)]

    def is_local(self, indices: torch.Tensor) -> torch.Tensor:
        """Whether each of ``indices`` (rows of ``all``) is one of this rank's samples."""
        return indices // len(self.local) == self.offset // len(self.local)


@dataclass
class LossContext:
    """What a loss needs to run forwards: the adapter, the policy network (possibly wrapped by the
    parallel backend) and, when the algorithm asked for one, the frozen reference network. It keeps the
    reference in checkpoints (``trainer.state.Stateful``)."""

    adapter: ModelAdapter
    policy: nn.Module
    reference: Reference | None
    snapshot: Callable[[nn.Module], nn.Module] = field(default=None)
    """Frozen full copy of a (possibly wrapped or sharded) network: the backend's ``frozen_copy``."""

    def __post_init__(self):
        if self.snapshot is None:
            self.snapshot = unwrapped_copy

    def checkpoint_state(self) -> dict[str, State]:
        """What the reference keeps: all its weights where it holds its own, the values a view swaps in (a
        trained IP-Adapter's as the reference was taken), nothing where it views the policy's own weights."""
        return self.reference.checkpoint_state() if self.reference is not None else {}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        """Restore the reference made for the resumed policy; a reference refreshed from the policy since
        (saved whole) replaces a view of the policy."""
        if self.reference is None:
            return
        if "reference" in saved and not self.reference.holds_weights:
            self.reference = FrozenCopy(self.snapshot(self.policy))
        self.reference.load_checkpoint_state(saved, source)


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
    local_groups: bool
    """Whether each prompt group must be sampled whole on one rank (pairs and best-of-group pick among
    a group's own latents); otherwise groups may span ranks and only rewards are gathered."""
    shown_metrics: tuple[str, ...]
    """Its statistics shown on the progress line, in this order, where an epoch reports them (all are logged)."""
    records_means: bool
    """Whether its rollouts keep each step's Gaussian mean (``Rollout.means``: as much memory as the latents)."""

    def setup(self, adapter: ModelAdapter, example: Conditioning, backend: Any) -> None:
        """Build the algorithm's own networks (e.g. a critic) once the policy is prepared; ``example`` is
        one item's conditioning (its shapes), ``backend`` offers ``prepare_auxiliary``."""
        ...

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        """Called before each RL epoch's rollout (e.g. to refresh a reference from the policy)."""
        ...

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """The weights the epoch's rollout samples with: a context inside which the policy's network holds them
        (entered before the backend gathers sharded weights for sampling). The policy's own (a null context),
        unless the algorithm samples with another policy (DiffusionNFT's old one)."""
        ...

    def check_batch(self, samples_per_rank: int) -> None:
        """Raise the ValueError that ``plan`` would raise for an epoch of ``samples_per_rank`` samples on each
        rank (steps that do not divide it), as the trainer is built rather than after the warm-up."""
        ...

    def make_batch(self, rollout: Rollout, rewards: Rewards) -> Any: ...

    def plan(self, batch: Any, generator: torch.Generator) -> list[list[Any]]:
        """Optimizer steps for one inner epoch, each a list of loss units whose gradients accumulate."""
        ...

    def loss(self, ctx: LossContext, unit: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The unit's part of its optimizer step's loss (the step's loss is the sum over its units), and
        statistics of the unit alone (its own mean losses, ratios, ...), averaged over units for logging."""
        ...

    def batch_metrics(self, batch: Any) -> dict[str, float]:
        """Per-epoch statistics of the batch (advantages, zero-std share, ...)."""
        ...

    def checkpoint_state(self) -> dict[str, State]:
        """The algorithm's own networks' state (``trainer.state.Stateful``; a critic's shards on this rank)."""
        ...

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None: ...


class AlgorithmDefaults:
    """What every algorithm shares: the protocol fields read from its config, and the hooks of an algorithm
    without networks of its own or per-epoch work (an algorithm that needs them defines its own)."""

    local_groups = False
    shown_metrics: tuple[str, ...] = ()
    records_means = False

    def __init__(self, config: Any):
        self.config = config
        self.sampler = config.sampler
        self.group_size = config.group_size
        self.inner_epochs = config.inner_epochs

    def setup(self, adapter: ModelAdapter, example: Conditioning, backend: Any) -> None:
        pass

    def start_epoch(self, ctx: LossContext, epoch: int) -> None:
        pass

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def check_batch(self, samples_per_rank: int) -> None:
        pass

    def checkpoint_state(self) -> dict[str, State]:
        return {}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        pass


def unwrapped_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` (unwrapped from DDP) with its own weights, frozen and in eval mode: the one-process
    ``LossContext.snapshot`` (the trainer passes its backend's ``frozen_copy``, which also gathers shards)."""
    return frozen_copy(getattr(net, "module", net))


@torch.no_grad()
def refresh_reference(ctx: LossContext, decay: float = 0.0) -> None:
    """Move the reference towards the policy: ref <- decay ref + (1 - decay) policy (decay 0 copies).

    A reference that views the policy's weights (the LoRA-disabled base) is replaced by a snapshot of the
    policy first: from then on it holds its own weights, and checkpoints store them."""
    current = ctx.snapshot(ctx.policy)
    if ctx.reference is None or not ctx.reference.holds_weights or decay == 0.0:
        ctx.reference = FrozenCopy(current)
        return
    for ref, new in zip(ctx.reference.parameters(), current.parameters(), strict=True):
        ref.lerp_(new, 1.0 - decay)


def shares_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether any parameter of ``a`` is stored in the same memory as one of ``b`` (a wrapper, not a copy)."""
    ptrs = {p.data_ptr() for p in b.parameters()}
    return any(p.data_ptr() in ptrs for p in a.parameters())


def set_shares(steps: list[list[Any]], weight: Callable[[Any], float]) -> list[list[Any]]:
    """Set each unit's ``share`` to its weight over the total of its optimizer step (0 in a step of no weight),
    and return ``steps``. A unit's loss is a (weighted) mean over its own samples; scaled by its share, the
    step's loss, the sum over its units, is that mean over all of the step's samples: a last, smaller
    micro-batch or one holding heavier samples counts as much as its samples do, no more.
    ``weight``: the unit's sample count, or the sum of its samples' loss weights."""
    for units in steps:
        weights = [weight(unit) for unit in units]
        total = sum(weights)
        for unit, w in zip(units, weights, strict=True):
            unit.share = w / total if total > 0 else 0.0
            unit.step_weight = total
    return steps


def balance_ranks(steps: list[list[Any]], gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Rescale ``set_shares``' shares so that every sample weighs the same across data-parallel ranks.

    The backends average the ranks' gradients, so step s's loss is (1/W) sum_r sum_u share_u L_u, and
    ``set_shares`` divides each rank's unit weights w_u by that rank's step weight S_r: a sample of a light
    rank (DPO's or best-of-group SFT's padding, NFT's failed rewards) would weigh more than one of a heavy
    rank. Scaling every share by W S_r / sum_r S_r makes the step's loss sum_r sum_u w_u L_u / sum_r S_r,
    the weighted mean over all ranks' samples that one process would compute (a no-op where the ranks' step
    weights are equal). ``gather``: the backend's all-gather; every rank calls this with as many steps.
    """
    if not steps:
        return
    local = torch.tensor([units[0].step_weight for units in steps], dtype=torch.float64)
    every = gather(local).reshape(-1, len(steps))  # [W, S], rank-major
    for units, mine, total in zip(steps, local.tolist(), every.sum(0).tolist(), strict=True):
        scale = every.shape[0] * mine / total if total > 0 else 0.0
        for unit in units:
            unit.share *= scale


def mark_on_policy(batch: Any, steps: list[list[Any]]) -> list[list[Any]]:
    """Mark ``steps``' first optimizer step's units ``on_policy`` where this is the batch's first plan (counted in
    ``batch.plans``): no step has moved the weights off the rollout's, so a unit's own forward is the old policy's."""
    if batch.plans == 0 and steps:
        for unit in steps[0]:
            unit.on_policy = True
    batch.plans += 1
    return steps


def check_steps(num_samples: int, num_steps: int) -> None:
    """Refuse ``num_steps`` optimizer steps that do not split ``num_samples`` samples per rank evenly."""
    if num_samples % num_steps:
        raise ValueError(
            f"{num_samples} samples per rank do not split into {num_steps} optimizer steps: make the "
            "per-rank batch (data.prompts_per_epoch x algorithm.group_size / ranks) a multiple of "
            "algorithm.steps_per_epoch"
        )


def split_steps(
    num_samples: int, num_steps: int, micro_batch_size: int, generator: torch.Generator
) -> list[list[torch.Tensor]]:
    """Shuffle sample indices into ``num_steps`` optimizer steps of micro-batches of ``micro_batch_size``."""
    check_steps(num_samples, num_steps)
    perm = torch.randperm(num_samples, generator=generator)
    per_step = num_samples // num_steps
    return [list(chunk.split(micro_batch_size)) for chunk in perm.split(per_step)]


def balanced_local(selected: torch.Tensor, rewards: Rewards) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of ``selected`` (rows of gathered-batch indices, [S, k]), as local indices, padded
    to the largest share of any rank so that every rank runs the same number of forwards and backwards
    (data parallelism requires it). Returns (local rows [M, k], weights [M]: 1 real, 0 padding).

    Every rank computes the same selection from the gathered rewards, so no collective is needed.
    """
    per_rank = len(rewards.local)
    counts = torch.bincount(selected[:, 0] // per_rank, minlength=len(rewards.all) // per_rank)
    mine = selected[rewards.is_local(selected[:, 0])] - rewards.offset
    assert bool((mine >= 0).all()) and bool((mine < per_rank).all()), "a selected row spans ranks"
    pad = int(counts.max()) - len(mine)
    rows = torch.cat([mine, torch.zeros(pad, selected.shape[1], dtype=torch.long)])
    weights = torch.cat([torch.ones(len(mine)), torch.zeros(pad)])
    return rows, weights
