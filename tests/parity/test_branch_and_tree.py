"""Parity of the branching samplers: ``sampler.branch`` against Flow-GRPO's S1 sampler (ODE before the branch step,
repeat there, SDE for ``train_num_steps``, ODE after) and ``sampler.tree`` with its advantages against BranchGRPO's
tree rollout (one forward per node, children drawing their own noise at a split) and per-depth advantages.

Same noise: the transcriptions draw from a generator seeded as ours, in our order (rows in tree order), and give
each of their rows the draw of the same (prompt, branch). Departures (docs/departures.md): S1 fixes std_t by step
(5 at step 0, 4.5 at step 1), ours is the sampler's std_t(a, sigma), so the test sets a to give S1's std; S1 repeats
the batch before the branch step's forward (G equal forwards), ours takes it once per prompt; S1's rows are tiled
(branch-major), ours grouped (prompt-major); BranchGRPO trains each edge once, ours each leaf's copy of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from transcribed import Source, transcribes

from trainer.algorithms.core_algos import tree_advantages
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.rollout import SamplerSettings, rollout
from trainer.samplers.branching import widths

S1_PIPELINE = Source(
    "zhtmike/flow_grpo",
    "8755f2430dfa658ae331d4fb6ce1ebe21afce98b",
    "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob_s1.py",
    "pipeline_with_logprob",
)
S1_STEP = Source(
    "zhtmike/flow_grpo",
    "e6e339d2c321ef3a74e31f77d1fefd1048140342",
    "flow_grpo/diffusers_patch/sd3_sde_with_logprob_s1.py",
    "sde_step_with_logprob",
)
BRANCH_GRPO = Source(
    "Fredreic1849/BranchGRPO",
    "19fbb9fc92ad1857212f3b664d6e9ff80c8b3804",
    "fastvideo/train_branchgrpo_flux.py",
    "run_tree_sample_step, flux_step_with_split",
)
BRANCH_GRPO_ADVANTAGES = Source(
    "Fredreic1849/BranchGRPO",
    "19fbb9fc92ad1857212f3b664d6e9ff80c8b3804",
    "fastvideo/train_branchgrpo_flux.py",
    "compute_node_rewards_from_leaves, compute_hierarchical_advantages_by_depth, collect_all_transitions",
)
S1_STD = {0: 5.0, 1: 4.5}
"""S1's std_dev_t by step index (its ``noise_dict``)."""
STEPS, PROMPTS = 5, ("a handwritten digit 3", "a handwritten digit 7")


@pytest.fixture(scope="module")
def adapter(tiny_model_dir):
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))
    adapter.denoiser.eval()
    return adapter


def _s1_step(v, x, sigmas, i, noise_level, eps):
    """S1's ``sde_step_with_logprob``: the Flow-GRPO SDE mean with std_dev_t from S1_STD (0 at noise level 0)."""
    v, x = v.float(), x.float()
    sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
    std = 0.0 if noise_level == 0 else S1_STD[i]
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    x_next = mean + std * torch.sqrt(-dt) * eps
    scale = std * torch.sqrt(-dt)
    log_prob = -((x_next - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    return x_next, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def _s1_pipeline(adapter, groups, branch, train_num_steps, generator):
    """S1's ``pipeline_with_logprob``: ODE before ``branch``; there the latents and embeddings are tiled ``groups``
    times; SDE for ``train_num_steps`` steps, ODE after. Returns (recorded latents, recorded log-probs, final)."""
    cond, sigmas = adapter.encode_prompts(list(PROMPTS)), adapter.sigmas(STEPS)
    latents, recorded, log_probs = adapter.prepare_latents(len(PROMPTS), generator), [], []
    for i in range(STEPS):
        if i == branch:
            latents = latents.repeat(groups, 1, 1, 1)
            cond = cond.select(torch.arange(len(PROMPTS)).repeat(groups))
            recorded.append(latents)
        level = 1 if branch <= i < branch + train_num_steps else 0
        v = adapter.predict(adapter.denoiser, latents, sigmas[i].expand(len(latents)), cond, 1.0)
        eps = torch.randn(latents.shape, generator=generator)  # drawn prompt-major, as ours: give it tiled
        if len(latents) > len(PROMPTS):
            eps = eps.unflatten(0, (len(PROMPTS), groups)).transpose(0, 1).flatten(0, 1)
        latents, log_prob = _s1_step(v, latents, sigmas, i, level, eps)
        if branch <= i < branch + train_num_steps:
            recorded.append(latents)
            log_probs.append(log_prob)
    return recorded, log_probs, latents


def _prompt_major(x, groups):
    """S1's tiled rows (branch j of prompt b at j B + b) in our order (b G + j)."""
    return x.unflatten(0, (groups, len(PROMPTS))).transpose(0, 1).flatten(0, 1)


@pytest.mark.parametrize("branch", [0, 1])
@transcribes("sampler:branch", source=S1_PIPELINE)
@transcribes("sampler:branch", source=S1_STEP)
def test_branch_rollout_is_s1s_with_its_std_as_our_noise_level(adapter, branch):
    """S1's recorded latents (from the branch step on), log-probs and final samples for the same noise, ours with
    a = S1's std_t / sqrt(sigma / (1 - s)) (s = sigma, sigmas[1] at sigma = 1): the departure row's relation."""
    groups, sigmas = 3, adapter.sigmas(STEPS).tolist()
    sigma, s = sigmas[branch], sigmas[max(branch, 1)]
    settings = SamplerSettings(num_steps=STEPS, noise_level=S1_STD[branch] / math.sqrt(sigma / (1 - s)))
    settings = SamplerSettings(**{**vars(settings), "sde_window": 1, "window_range": (branch, branch + 1)})
    settings.branch = True
    stochastic = torch.zeros(STEPS, dtype=torch.bool)
    stochastic[branch] = True
    rows = [p for p in PROMPTS for _ in range(groups)]
    ours = rollout(
        adapter, adapter.denoiser, rows, torch.arange(2).repeat_interleave(groups), settings,
        torch.Generator().manual_seed(4), stochastic=stochastic,
    )  # fmt: skip
    recorded, log_probs, final = _s1_pipeline(adapter, groups, branch, 1, torch.Generator().manual_seed(4))
    for k, latents in enumerate(recorded):
        assert torch.allclose(ours.latents[:, branch + k], _prompt_major(latents, groups), atol=1e-5)
    assert torch.allclose(ours.log_probs[:, branch], _prompt_major(log_probs[0], groups), atol=1e-4)
    assert torch.allclose(ours.latents[:, -1], _prompt_major(final, groups), atol=1e-5)
    assert ours.log_probs[:, [i for i in range(STEPS) if i != branch]].abs().sum() == 0  # ODE steps: not trained
    assert ours.forwards == len(PROMPTS) * (branch + 1 + groups * (STEPS - branch - 1))  # the prefix once


class _Node:
    """BranchGRPO's ``TreeNode``: a latent, its parent, the log-prob of the edge to it, its reward and advantage."""

    def __init__(self, latent, parent=None, log_prob=None):
        self.latent, self.parent, self.log_prob, self.children = latent, parent, log_prob, []
        self.depth = 0 if parent is None else parent.depth + 1
        self.reward = self.advantage = None
        if parent is not None:
            parent.children.append(self)

    def leaves(self):
        return [self] if not self.children else [leaf for c in self.children for leaf in c.leaves()]

    def path(self):
        return [self] if self.parent is None else [*self.parent.path(), self]


def _flux_step_with_split(v, x, eta, sigmas, i, eps):
    """BranchGRPO's ``flux_step_with_split`` (sde_solver, grpo): one mean, a child per noise row of ``eps``."""
    sigma, dsigma = sigmas[i], sigmas[i + 1] - sigmas[i]
    x0 = x - sigma * v
    std = max(eta * math.sqrt(sigma - sigmas[i + 1]), 1e-8)
    mean = x + dsigma * v + (-0.5 * eta**2 * (-(x - x0 * (1 - sigma)) / sigma**2)) * dsigma
    children = [mean + e[None] * std for e in eps]
    log_probs = [
        (-((c - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2, 3))
        for c in children
    ]
    return children, log_probs


def _branch_grpo_tree(adapter, plan, eta, generator):
    """BranchGRPO's ``run_tree_sample_step``: a root per prompt, each step one forward per node, a split's node
    drawing ``factor`` children. The noise of step i is one draw over its children in node order (ours)."""
    cond, sigmas = adapter.encode_prompts(list(PROMPTS)), adapter.sigmas(STEPS).tolist()
    x = adapter.prepare_latents(len(PROMPTS), generator)
    roots = [_Node(x[b : b + 1]) for b in range(len(PROMPTS))]
    nodes, prompt_of = list(roots), list(range(len(PROMPTS)))
    for i in range(STEPS):
        f = dict(plan).get(i, 1)
        eps = torch.randn((len(nodes) * f, *x.shape[1:]), generator=generator)
        new_nodes, new_prompts = [], []
        for n, (node, b) in enumerate(zip(nodes, prompt_of, strict=True)):
            v = adapter.predict(adapter.denoiser, node.latent, torch.tensor([sigmas[i]]), cond.select([b]), 1.0)
            children, log_probs = _flux_step_with_split(
                v.float(), node.latent.float(), eta, sigmas, i, eps[n * f : (n + 1) * f]
            )
            new_nodes += [_Node(c, node, lp) for c, lp in zip(children, log_probs, strict=True)]
            new_prompts += [b] * f
        nodes, prompt_of = new_nodes, new_prompts
    return roots


def _branch_grpo_advantages(root, leaf_rewards):
    """BranchGRPO's node rewards (mean over leaf descendants), per-depth normalisation and edge advantages."""
    for leaf, r in zip(root.leaves(), leaf_rewards, strict=True):
        leaf.reward = r
    by_depth, stack = {}, [root]
    while stack:
        node = stack.pop()
        by_depth.setdefault(node.depth, []).append(node)
        stack += node.children
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.children:
                node.reward = torch.stack([leaf.reward for leaf in node.leaves()]).mean()
    for nodes in by_depth.values():
        if len(nodes) <= 1:
            for node in nodes:
                node.advantage = torch.tensor(0.0)
            continue
        rewards = torch.stack([node.reward for node in nodes])
        std = rewards.std()
        adv = torch.zeros_like(rewards) if std < 1e-6 else (rewards - rewards.mean()) / (std + 1e-8)
        for node, a in zip(nodes, adv, strict=True):
            node.advantage = a


@transcribes("sampler:tree", source=BRANCH_GRPO)
@transcribes("sampler:tree", source=BRANCH_GRPO_ADVANTAGES)
def test_tree_rollout_and_advantages_are_branchgrpos(adapter):
    """Every leaf's path (latents and edge log-probs) and every edge's advantage, BranchGRPO's with its DanceGRPO
    step (our "eta" kind) and ours, for a 2 x 2 tree split at steps 1 and 3; forwards one per node and step."""
    plan, eta = ((1, 2), (3, 2)), 0.7
    settings = SamplerSettings(num_steps=STEPS, kind="eta", noise_level=eta, tree=(2, 2), tree_steps=(1, 3))
    rows, group_ids = [p for p in PROMPTS for _ in range(4)], torch.arange(2).repeat_interleave(4)
    ours = rollout(adapter, adapter.denoiser, rows, group_ids, settings, torch.Generator().manual_seed(6))
    roots = _branch_grpo_tree(adapter, plan, eta, torch.Generator().manual_seed(6))
    leaves = [leaf for root in roots for leaf in root.leaves()]
    for row, leaf in enumerate(leaves):
        path = leaf.path()
        theirs = torch.cat([n.latent for n in path]).float()  # the last step divides by sigma^2 ~ 1e-6: 1e-4
        assert torch.allclose(ours.latents[row], theirs, atol=1e-4)
        assert torch.allclose(ours.log_probs[row], torch.cat([n.log_prob for n in path[1:]]), atol=1e-4)
    assert ours.forwards == len(PROMPTS) * sum(widths(STEPS, plan)[:-1]) == 2 * (1 + 1 + 2 + 2 + 4)

    rewards = torch.rand(len(rows), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    adv = tree_advantages(rewards, group_ids, widths(STEPS, plan), clip=math.inf)
    for b, root in enumerate(roots):
        _branch_grpo_advantages(root, rewards[4 * b : 4 * b + 4])
    for row, leaf in enumerate(leaves):
        theirs = torch.stack([n.advantage for n in leaf.path()[1:]]).float()  # the edge into each node
        assert torch.allclose(adv[row], theirs, atol=1e-6), row
