"""Branching rollouts: a prompt's group shares one trajectory that splits into the group's rows at chosen steps.

A plan is ((step, factor), ...), steps increasing: step i's forward runs once per trajectory, and at a split its
``factor`` children each draw their own noise around that forward's mean. A prompt starts as one row (one initial
noise) and ends as G = prod(factors) rows, its group, in tree order: a leaf l's ancestor at width w is l // (G / w).
    S1 (Flow-GRPO's single-step trainer, ``sampler.branch``): ((b, G),), ODE before the branch step b, which is
        drawn per epoch; SDE for the window's steps from b, ODE after.
    tree (BranchGRPO, ``sampler.tree``): ((s_1, f_1), ..., (s_L, f_L)), f_1 ... f_L = G, every step SDE.
Forwards per prompt: sum over steps i of w_i, the width before step i's split (T G without branching).
"""

from __future__ import annotations

import math

import torch

BRANCHINGS = ("branch", "tree")
"""The branching samplers (``sampler.branch``, ``sampler.tree``), each with its parity test."""

Plan = tuple[tuple[int, int], ...]


def uniform_tree_steps(num_steps: int, levels: int) -> tuple[int, ...]:
    """BranchGRPO's default split steps for ``levels`` splits over ``num_steps``: l (T // L) for l < L."""
    return tuple(min(level * (num_steps // levels), num_steps - 1) for level in range(levels))


def widths(num_steps: int, plan: Plan) -> list[int]:
    """[T + 1] rows per prompt: entry i is the width step i's forward runs at (before its split); entry T the
    leaves (the width after the last step), so that entry i + 1 is the number of nodes step i leads to."""
    factors = dict(plan)
    out = [1]
    for i in range(num_steps):
        out.append(out[-1] * factors.get(i, 1))
    return out


def forwards_per_prompt(num_steps: int, plan: Plan) -> int:
    """Denoiser forwards (rows) a prompt's rollout takes: sum of ``widths`` over the T steps."""
    return sum(widths(num_steps, plan)[:-1])


def leaves_per_prompt(plan: Plan) -> int:
    return math.prod(factor for _, factor in plan)


def group_width(group_ids: torch.Tensor) -> int:
    """Rows per group, where every group's rows are one contiguous run of the same length (as a branching rollout
    needs them: the sampler keeps groups whole and in order when ``sampler.branch`` or ``sampler.tree`` is set)."""
    starts = torch.nonzero(torch.diff(group_ids.cpu()), as_tuple=False).flatten() + 1
    bounds = [0, *starts.tolist(), len(group_ids)]
    sizes = {b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)}
    if len(sizes) != 1 or len(bounds) - 1 != len(torch.unique(group_ids)):
        raise ValueError("a branching rollout needs each prompt group's rows together and of one size")
    return sizes.pop()


def to_leaves(tensor: torch.Tensor, leaves: int) -> torch.Tensor:
    """A tensor recorded at some width (rows in tree order) repeated to ``leaves`` rows: each row once per leaf
    below it. The tensor itself when it already has ``leaves`` rows."""
    rows = tensor.shape[0]
    return tensor if rows == leaves else tensor.repeat_interleave(leaves // rows, dim=0)


def whole_groups(bounds: list[int], group: int) -> list[int]:
    """Chunk ``bounds`` [0, ..., n] moved to the nearest multiples of ``group`` (n is one): no chunk splits a group."""
    if group == 1:
        return bounds
    return sorted({min(bounds[-1], round(b / group) * group) for b in bounds})
