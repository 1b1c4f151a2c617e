"""The k-repeat sampler over many layouts: for every world size in 1, 2, 4, 8 that divides an epoch's
samples, the union of the ranks' slices is whole prompt groups, each rank gets the same share, and every
rank computes the same global list without communicating."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from trainer.data.sampler import GroupSampler

LAYOUTS = [  # (pool size, prompts per epoch, group size)
    (10, 4, 8), (3, 8, 2), (100, 6, 4), (7, 12, 2), (1, 2, 16), (48, 48, 24), (5, 5, 16),
]
CASES = [(layout, world) for layout in LAYOUTS for world in (1, 2, 4, 8) if layout[1] * layout[2] % world == 0]


def test_every_world_size_is_exercised():
    assert {world for _, world in CASES} == {1, 2, 4, 8}


@pytest.mark.parametrize("layout, world", CASES)
def test_union_over_ranks_is_whole_groups(layout, world):
    pool, prompts_per_epoch, group_size = layout
    for epoch in range(3):
        parts = [GroupSampler(pool, prompts_per_epoch, group_size, world, rank, seed=11).epoch(epoch)
                 for rank in range(world)]
        assert {len(indices) for indices, _ in parts} == {prompts_per_epoch * group_size // world}
        indices = torch.cat([p[0] for p in parts])
        groups = torch.cat([p[1] for p in parts])
        assert Counter(groups.tolist()) == {g: group_size for g in range(prompts_per_epoch)}
        for g in range(prompts_per_epoch):
            assert len(set(indices[groups == g].tolist())) == 1, f"group {g} mixes prompts"
        assert all(count % group_size == 0 for count in Counter(indices.tolist()).values())
        assert indices.min() >= 0 and indices.max() < pool
        distinct = len(set(indices.tolist()))
        assert distinct == min(pool, prompts_per_epoch)  # the pool is cycled only when it is too small
        single = GroupSampler(pool, prompts_per_epoch, group_size, 1, 0, seed=11).epoch(epoch)
        assert torch.equal(indices, single[0]) and torch.equal(groups, single[1])


@pytest.mark.parametrize("layout, world", [case for case in CASES if case[0][1] % case[1] == 0])
def test_local_groups_keep_each_group_on_one_rank(layout, world):
    """Algorithms that pair within a group (DPO, best-of-group) sample each group whole on one rank."""
    pool, prompts_per_epoch, group_size = layout
    owners: dict[int, int] = {}
    for rank in range(world):
        indices, groups = GroupSampler(pool, prompts_per_epoch, group_size, world, rank, seed=11,
                                       local_groups=True).epoch(1)
        assert Counter(groups.tolist()) == {g: group_size for g in set(groups.tolist())}
        for g in set(groups.tolist()):
            assert owners.setdefault(g, rank) == rank and len(set(indices[groups == g].tolist())) == 1
    assert sorted(owners) == list(range(prompts_per_epoch))
