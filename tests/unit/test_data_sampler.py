"""The k-repeat sampler over many layouts: for every world size in 1, 2, 4, 8 that divides an epoch's
samples, the union of the ranks' slices is whole prompt groups, each rank gets the same share, and every
rank computes the same global list without communicating. Epochs are deterministic; sizes that do not
divide are refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from trainer.data.sampler import GroupSampler

LAYOUTS = [  # (pool size, prompts per epoch, group size)
    (10, 4, 8),
    (3, 8, 2),
    (100, 6, 4),
    (7, 12, 2),
    (1, 2, 16),
    (48, 48, 24),
    (5, 5, 16),
]
CASES = [(layout, world) for layout in LAYOUTS for world in (1, 2, 4, 8) if layout[1] * layout[2] % world == 0]


def test_every_world_size_is_exercised():
    assert {world for _, world in CASES} == {1, 2, 4, 8}


@pytest.mark.parametrize("layout, world", CASES)
def test_union_over_ranks_is_whole_groups(layout, world):
    pool, prompts_per_epoch, group_size = layout
    for epoch in range(3):
        parts = [
            GroupSampler(pool, prompts_per_epoch, group_size, world, rank, seed=11).epoch(epoch)
            for rank in range(world)
        ]
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
        indices, groups = GroupSampler(
            pool, prompts_per_epoch, group_size, world, rank, seed=11, local_groups=True
        ).epoch(1)
        assert Counter(groups.tolist()) == {g: group_size for g in set(groups.tolist())}
        for g in set(groups.tolist()):
            assert owners.setdefault(g, rank) == rank and len(set(indices[groups == g].tolist())) == 1
    assert sorted(owners) == list(range(prompts_per_epoch))


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_gathered_batch_holds_whole_groups(world):
    parts = [GroupSampler(10, 4, 8, world, rank, seed=3).epoch(5) for rank in range(world)]
    indices = torch.cat([p[0] for p in parts])
    groups = torch.cat([p[1] for p in parts])
    assert len(indices) == 32 and all(len(p[0]) == 32 // world for p in parts)
    assert Counter(groups.tolist()) == {g: 8 for g in range(4)}
    for g in range(4):
        assert len(set(indices[groups == g].tolist())) == 1  # one prompt per group
    assert len(set(indices.tolist())) == 4  # distinct prompts when the pool allows


def test_epochs_are_deterministic_and_differ():
    a = GroupSampler(10, 5, 4, 1, 0, seed=0)
    assert torch.equal(a.epoch(3)[0], GroupSampler(10, 5, 4, 1, 0, seed=0).epoch(3)[0])
    assert not torch.equal(a.epoch(3)[0], a.epoch(4)[0])


def test_small_pool_cycles_and_world_size_must_divide():
    idx, groups = GroupSampler(3, 7, 2, 1, 0, seed=0).epoch(0)
    assert len(idx) == 14 and set(idx.tolist()) == {0, 1, 2}
    with pytest.raises(ValueError, match="do not divide over 4 ranks"):
        GroupSampler(10, 3, 3, 4, 0, seed=0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_local_groups_keep_every_group_on_one_rank(world):
    parts = [GroupSampler(10, 4, 6, world, rank, seed=1, local_groups=True).epoch(2) for rank in range(world)]
    owners = {}
    for rank, (_, groups) in enumerate(parts):
        for g in groups.tolist():
            owners.setdefault(g, set()).add(rank)
    assert sorted(owners) == [0, 1, 2, 3] and all(len(r) == 1 for r in owners.values())
    assert Counter(torch.cat([p[1] for p in parts]).tolist()) == {g: 6 for g in range(4)}
    # within a rank the order is still shuffled (not sorted by group)
    single = GroupSampler(10, 4, 6, 1, 0, seed=1, local_groups=True).epoch(2)[1]
    assert not torch.equal(single, torch.sort(single).values)


def test_local_groups_need_prompts_divisible_by_ranks():
    with pytest.raises(ValueError, match="prompts_per_epoch=3 must be a multiple of the 2 ranks"):
        GroupSampler(10, 3, 4, 2, 0, seed=0, local_groups=True)


def test_the_largest_seed_the_config_admits_draws_epochs():
    """train.seed is range-checked to [0, 2^63); the epoch stream's seed (seed * 1000003 + epoch) overflowed a
    generator's 64 bits for seeds above ~1.8e13, at the first RL epoch."""
    indices, groups = GroupSampler(4, 2, 2, 1, 0, 2**63 - 1).epoch(3)
    assert len(indices) == len(groups) == 4
