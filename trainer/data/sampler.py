"""The k-repeat prompt sampler: whole prompt groups in every gathered batch, deterministic per epoch."""

from __future__ import annotations

import torch


class GroupSampler:
    """Each epoch draws ``prompts_per_epoch`` prompts from a pool of ``pool_size``, repeats each
    ``group_size`` times, shuffles the global list and gives rank r the r-th equal slice.

    With ``contiguous`` (branching rollouts) each group's rows are adjacent, in order, on one rank.
    Every rank computes the same global list from (seed, epoch), so no communication is needed and the
    gathered batch always holds whole groups; the epoch number is the whole sampler state (resumable).
    """

    def __init__(
        self,
        pool_size: int,
        prompts_per_epoch: int,
        group_size: int,
        world_size: int,
        rank: int,
        seed: int,
        local_groups: bool = False,
        contiguous: bool = False,
    ):
        total = prompts_per_epoch * group_size
        local_groups = local_groups or contiguous
        if local_groups and prompts_per_epoch % world_size:
            raise ValueError(
                f"this algorithm keeps each prompt group on one rank, so data.prompts_per_epoch="
                f"{prompts_per_epoch} must be a multiple of the {world_size} ranks"
            )
        if total % world_size:
            raise ValueError(
                f"data.prompts_per_epoch x algorithm.group_size = {prompts_per_epoch} x {group_size} = {total} "
                f"samples per epoch do not divide over {world_size} ranks; choose values whose product is a "
                f"multiple of {world_size}"
            )
        if pool_size < 1:
            raise ValueError("the prompt pool is empty")
        self.pool_size, self.prompts_per_epoch, self.group_size = pool_size, prompts_per_epoch, group_size
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.per_rank = total // world_size
        self.local_groups, self.contiguous = local_groups, contiguous
        self.unit = group_size if contiguous else 1
        """Rows a rollout chunk must keep together: a group, where its rows share a branching prefix."""

    def epoch(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool indices [per_rank], group ids [per_rank]) of this rank for ``epoch``."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        reps = -(-self.prompts_per_epoch // self.pool_size)
        chosen = torch.cat([torch.randperm(self.pool_size, generator=g) for _ in range(reps)])[: self.prompts_per_epoch]
        groups = torch.arange(self.prompts_per_epoch).repeat_interleave(self.group_size)
        order = torch.randperm(len(groups), generator=g)
        if self.local_groups:  # a stable sort by owning rank keeps the shuffle inside each rank's slice
            owner = groups[order] // (self.prompts_per_epoch // self.world_size)
            order = order[torch.sort(owner, stable=True).indices]
        if self.contiguous:  # each group's rows together, in order, whole on one rank (they share a prefix)
            order = torch.arange(len(groups))
        groups = groups[order]
        mine = slice(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        return chosen[groups[mine]], groups[mine]
