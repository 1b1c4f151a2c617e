"""Branching rollouts' bookkeeping (trainer/samplers/branching.py), their settings' refusals, the sampler that keeps
groups whole, and the tree advantages on fixed values."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms.core_algos import tree_advantages
from trainer.algorithms.grpo import GRPOConfig
from trainer.data.sampler import GroupSampler
from trainer.rollout import SamplerSettings, rollout_bounds, window_mask
from trainer.samplers.branching import forwards_per_prompt, group_width, to_leaves, uniform_tree_steps, widths


def test_widths_and_forwards_count_each_trajectory_once_per_step():
    # S1 at b = 1 with G = 8 over 10 steps: steps 0 and 1 on one row, then 8 rows for 8 steps
    assert widths(10, ((1, 8),)) == [1, 1, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    assert forwards_per_prompt(10, ((1, 8),)) == 2 + 8 * 8
    assert forwards_per_prompt(10, ((0, 2), (3, 2), (6, 2))) == 1 + 3 * 2 + 3 * 4 + 3 * 8
    assert forwards_per_prompt(10, ()) == 10  # no branching: one row per image, T steps


def test_uniform_tree_steps_are_branchgrpos_default_split_points():
    assert uniform_tree_steps(10, 3) == (0, 3, 6)
    assert uniform_tree_steps(16, 4) == (0, 4, 8, 12)


def test_group_width_needs_whole_contiguous_groups():
    assert group_width(torch.tensor([4, 4, 4, 1, 1, 1])) == 3
    with pytest.raises(ValueError, match="rows together and of one size"):
        group_width(torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="rows together and of one size"):
        group_width(torch.tensor([0, 0, 1]))


def test_to_leaves_repeats_each_row_for_the_leaves_below_it():
    x = torch.tensor([[1.0], [2.0]])
    assert to_leaves(x, 6)[:, 0].tolist() == [1, 1, 1, 2, 2, 2]
    assert to_leaves(x, 2) is x  # the unbranched path is untouched


def test_chunks_keep_groups_whole_when_branching():
    assert rollout_bounds(160, 0, 8) == [*range(0, 160, 16), 160]
    assert rollout_bounds(60, 0, 8, group=6) == [0, 6, 18, 24, 30, 42, 48, 54, 60]
    assert all(b % 6 == 0 for b in rollout_bounds(60, 3, 8, group=6))


def test_contiguous_sampler_gives_each_rank_whole_groups_in_order():
    ranks = [GroupSampler(7, 4, 3, 2, r, seed=1, contiguous=True).epoch(5) for r in range(2)]
    plain = GroupSampler(7, 4, 3, 2, 0, seed=1).epoch(5)
    for indices, groups in ranks:
        assert groups.tolist() == sorted(groups.tolist()) and group_width(groups) == 3
        assert all(len(set(indices[groups == g].tolist())) == 1 for g in groups.unique())
    chosen = {int(i) for idx, _ in ranks for i in idx}
    assert chosen == {int(i) for i in GroupSampler(7, 4, 3, 1, 0, seed=1).epoch(5)[0]}  # the same prompts
    assert len(plain[0]) == len(ranks[0][0])


def test_the_branch_step_is_the_windows_start_drawn_per_epoch():
    settings = SamplerSettings(num_steps=10, sde_window=1, window_range=(0, 2), branch=True)
    plans = {settings.branch_plan(window_mask(settings, torch.Generator().manual_seed(s)), 8) for s in range(20)}
    assert plans == {((0, 8),), ((1, 8),)}  # S1's {0, 1}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"branch": True}, r"^sampler.branch branches at the SDE window's start: set sampler.sde_window > 0"),
        ({"branch": True, "sde_window": 1, "noise_level": 0.0}, r"need noise_level > 0"),
        ({"tree": (2, 2), "sde_window": 2}, r"^sampler.tree samples every step with SDE.*sde_window=0$"),
        ({"tree": (2, 2), "tree_steps": (3, 1)}, r"tree_steps=\(3, 1\) must be 2 increasing steps below num_steps"),
        ({"tree": (2, 2), "tree_steps": (1,)}, r"must be 2 increasing steps"),
    ],
)
def test_settings_that_cannot_branch_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplerSettings(num_steps=10, **fields)


def test_a_tree_whose_leaves_are_not_the_group_is_refused():
    with pytest.raises(ValueError, match=r"tree=\(2, 2\) makes 4 leaves per prompt, but algorithm.group_size=8"):
        GRPOConfig(group_size=8, sampler=SamplerSettings(tree=(2, 2)))
    with pytest.raises(ValueError, match=r"makes 4 leaves per prompt, but a group has 6 images"):
        SamplerSettings(tree=(2, 2)).branch_plan(torch.ones(10, dtype=torch.bool), 6)


def test_tree_advantages_on_fixed_values():
    """One tree of 4 leaves, split 2 x 2 at steps 0 and 1 (3 steps): depth 1 has 2 nodes, depths 2-3 the leaves."""
    rewards = torch.tensor([1.0, 3.0, 5.0, 7.0])
    adv = tree_advantages(rewards, torch.zeros(4, dtype=torch.long), widths(3, ((0, 2), (1, 2))), clip=5.0)
    half = (torch.tensor([2.0, 6.0]) - 4.0) / (torch.tensor([2.0, 6.0]).std() + 1e-8)
    leaf = (rewards - 4.0) / (rewards.std() + 1e-8)
    assert torch.allclose(adv[:, 0], half.repeat_interleave(2))
    assert torch.allclose(adv[:, 1], leaf) and torch.allclose(adv[:, 2], leaf)
    flat = tree_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), [1, 2, 4, 4])
    assert flat.abs().sum() == 0  # std < 1e-6: advantage 0, as BranchGRPO
    failed = tree_advantages(
        torch.tensor([1.0, float("nan"), 5.0, 7.0]), torch.zeros(4, dtype=torch.long), [1, 2, 4, 4]
    )
    assert failed[1].abs().sum() == 0 and torch.allclose(failed[0, 0], -failed[2, 0])  # nodes 1 and 6 at depth 1
