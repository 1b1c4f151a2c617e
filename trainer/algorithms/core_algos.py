"""The algorithm vocabulary, as verl's core_algos: every advantage estimator and loss of trainer/algorithms/, pure
functions on tensors with their formula in the docstring, registered by name (``ADVANTAGE_ESTIMATORS``,
``LOSSES``) and tested on fixed values (tests/unit/test_advantages.py, tests/parity/). The algorithms' files
hold what is not math: batches, plans of loss units, the forwards that feed these functions.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from shared.registry import Registry

ADVANTAGE_ESTIMATORS = Registry()
"""Name -> advantage estimator (rewards -> advantages, or the probabilities an algorithm weights samples by)."""
LOSSES = Registry()
"""Name -> loss (per sample, or a weighted mean over samples) or loss term of an algorithm."""

STD_EPS = 1e-4


def weighted_mean(
    values: torch.Tensor, weights: torch.Tensor, floor: float = 1.0, dim: int | None = None, keepdim: bool = False
) -> torch.Tensor:
    """sum(w x) / max(sum(w), floor), over ``dim`` (None: every element): the mean over the samples of weight 1 with
    0/1 weights (floor 1: 0 where there are none); fractional weights need a floor below their sum (1e-12)."""
    if dim is None:
        return (values * weights).sum() / weights.sum().clamp_min(floor)
    return (values * weights).sum(dim, keepdim=keepdim) / weights.sum(dim, keepdim=keepdim).clamp_min(floor)


def per_sample_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B]: mean over every non-batch element of (prediction - target)^2, in float32."""
    return ((prediction.float() - target.float()) ** 2).mean(dim=tuple(range(1, prediction.ndim)))


# --- advantage estimators ---------------------------------------------------------------------------------------------


@ADVANTAGE_ESTIMATORS.register("group")
def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False, clip: float = 5.0, ddof: int = 0
) -> torch.Tensor:
    """GRPO advantages: A_i = (r_i - mean of r over i's group) / (std + 1e-4), clipped to [-clip, clip].

    ``std`` is the standard deviation of i's group, or of the whole batch when ``global_std`` (the
    Flow-GRPO recipe), with ``ddof`` delta degrees of freedom: 0 the population std (Flow-GRPO's np.std), 1 the
    unbiased one (MixGRPO's torch.std); 0 where there are no more values than ``ddof``. NaN rewards (a failed
    reward component) are left out of every mean and std and get advantage 0: they carry no signal and are never
    counted as a zero reward.
    """
    r = rewards.double()
    valid = ~torch.isnan(r)
    adv = torch.zeros_like(r)
    std_of = lambda x: x.std(correction=ddof) if len(x) > max(ddof, 1) else x.new_tensor(0.0)  # noqa: E731
    batch_std = std_of(r[valid])
    for g in torch.unique(group_ids):
        members = (group_ids == g) & valid
        if not members.any():
            continue
        values = r[members]
        std = batch_std if global_std else std_of(values)
        adv[members] = (values - values.mean()) / (std + STD_EPS)
    return adv.clamp(-clip, clip).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@ADVANTAGE_ESTIMATORS.register("tree")
def tree_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, nodes: list[int], clip: float = 5.0
) -> torch.Tensor:
    """BranchGRPO's per-depth advantages on a tree rollout [N, T]: a group's rows are its tree's leaves in tree
    order, and step t's edge leads to one of ``nodes[t + 1]`` nodes (``branching.widths``), each the parent of a
    block of G / nodes leaves. A node's reward is the mean of its leaves'; at each depth the tree's nodes are
    normalised among themselves, A = clip((R - mean R) / (std R + 1e-8), -clip, clip) with the unbiased std, 0 where
    the depth has one node or std < 1e-6; an edge takes the advantage of the node it leads to. NaN (failed) leaves
    are left out of their node's mean, and nodes with no scored leaf out of the depth's statistics (advantage 0)."""
    r = rewards.double()
    adv = torch.zeros(len(r), len(nodes) - 1, dtype=torch.float64)
    for g in torch.unique(group_ids):
        members = torch.nonzero(group_ids == g, as_tuple=False).flatten()
        for t, width in enumerate(nodes[1:]):
            node_r = r[members].view(width, -1).nanmean(dim=1)
            scored = ~torch.isnan(node_r)
            values = node_r[scored]
            if len(values) < 2 or float(values.std()) < 1e-6:
                continue
            node_adv = torch.where(scored, (node_r - values.mean()) / (values.std() + 1e-8), 0.0)
            adv[members, t] = node_adv.repeat_interleave(len(members) // width)
    adv[torch.isnan(r)] = 0.0
    return adv.clamp(-clip, clip).float()


@ADVANTAGE_ESTIMATORS.register("batch")
def batch_advantages(rewards: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """PPO-style advantages without grouping: A_i = clip((r_i - batch mean) / (batch std + 1e-4), -clip, clip), NaN
    rewards -> 0."""
    return group_advantages(rewards, torch.zeros_like(rewards, dtype=torch.long), global_std=True, clip=clip)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(
    final_rewards: torch.Tensor, values: torch.Tensor, lam: float, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the T denoising steps of each sample.

    The reward arrives only after the last step, so with V_t = V(x_t) [B, T] and r [B]:
        delta_t = gamma V_{t+1} - V_t  (t < T-1),   delta_{T-1} = r - V_{T-1}
        A_t = delta_t + gamma lam A_{t+1},           return_t = A_t + V_t
    With gamma = lam = 1, A_t = r - V_t. Returns (advantages [B, T], returns [B, T]).
    """
    b, t = values.shape
    adv = torch.zeros_like(values)
    running = torch.zeros(b, dtype=values.dtype, device=values.device)
    for i in reversed(range(t)):
        next_value = final_rewards.to(values.dtype) if i == t - 1 else gamma * values[:, i + 1]
        running = next_value - values[:, i] + gamma * lam * running
        adv[:, i] = running
    return adv, adv + values


@ADVANTAGE_ESTIMATORS.register("critic")
def critic_advantages(
    rewards: torch.Tensor, values: torch.Tensor, lam: float, steps: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-with-critic's advantages per denoising step [B, T]: ``gae`` on the rewards r [B] (a failed, NaN one as 0)
    and the values V [B, T], normalised over the trained ``steps`` of the samples with a reward,
        A = clip((A - mean) / (std + 1e-4), -clip, clip),   0 where the reward failed,
    and the value targets R = A + V before normalising (V where the reward failed). Returns (A, R)."""
    valid = ~torch.isnan(rewards)
    adv, returns = gae(torch.where(valid, rewards, 0.0), values, lam)
    trained = adv[valid][:, steps]
    adv = torch.where(valid[:, None], (adv - trained.mean()) / (trained.std(unbiased=False) + 1e-4), 0.0)
    return adv.clamp(-clip, clip), torch.where(valid[:, None], returns, values)


@ADVANTAGE_ESTIMATORS.register("optimality")
def optimality_probability(advantages: torch.Tensor, scale: float) -> torch.Tensor:
    """r~ = 0.5 + 0.5 clip(A / scale, -1, 1): advantages mapped to [0, 1] (0.5 = no preference)."""
    return 0.5 + 0.5 * (advantages / scale).clamp(-1.0, 1.0)


def zero_std_share(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of samples whose group has no reward spread (they get advantage 0 under per-group std)."""
    flat = 0
    for g in torch.unique(group_ids):
        values = rewards[(group_ids == g) & ~torch.isnan(rewards)]
        if len(values) > 0 and float(values.max() - values.min()) == 0.0:
            flat += len(values)
    return flat / max(len(rewards), 1)


def best_and_worst(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group: index of the highest and of the lowest reward (first on ties; NaN rewards never chosen).

    Returns (groups [G'], best [G'], worst [G']) for the G' groups with at least two valid samples whose
    rewards differ: a group without spread gives no preference.
    """
    groups, best, worst = [], [], []
    for g in torch.unique(group_ids).tolist():
        members = torch.nonzero((group_ids == g) & ~torch.isnan(rewards), as_tuple=False).flatten()
        if len(members) < 2:
            continue
        values = rewards[members]
        if float(values.max() - values.min()) == 0.0:
            continue
        groups.append(g)
        best.append(int(members[torch.argmax(values)]))
        worst.append(int(members[torch.argmin(values)]))
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_long(groups), as_long(best), as_long(worst)


# --- policy-gradient losses on denoising steps ------------------------------------------------------------------------


@LOSSES.register("ppo_clip")
def clipped_policy_loss(
    advantages: torch.Tensor,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: ratio = exp(logp - logp_old); L = mean(max(-A ratio, -A clamp(ratio, 1-eps, 1+eps))).

    Computed as L = mean(-|A| min(s ratio, s + eps)) with s = sign(A): for A > 0 the max is
    -A min(ratio, 1+eps), for A < 0 it is -A max(ratio, 1-eps), for A = 0 it is 0; the same value and
    gradient in about half the kernels of the two-branch form, backward included. With ``weights`` the
    mean is sum(w L_i) / max(sum(w), 1) (e.g. 0 for samples dropped for their zero advantage).

    Returns the loss and detached diagnostics: ``approx_kl`` = 0.5 mean((logp - logp_old)^2) and
    ``clip_frac`` = mean(|ratio - 1| > eps).
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    sign = advantages.sign()
    per_sample = torch.minimum(ratio * sign, sign + clip_range) * advantages.abs()
    if weights is None:
        loss = per_sample.mean().neg()
    else:
        loss = weighted_mean(per_sample, weights).neg()
    with torch.no_grad():
        stats = {
            "approx_kl": 0.5 * log_ratio.square().mean(),
            "clip_frac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "ratio": ratio.mean(),
        }
    return loss, stats


@LOSSES.register("value")
def value_loss(predicted: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """The critic's regression loss L_V = mean((V(x_t) - R_t)^2) on the value targets R (``critic_advantages``)."""
    return F.mse_loss(predicted, returns)


@LOSSES.register("gaussian_kl")
def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor) -> torch.Tensor:
    """KL between equal-variance Gaussians in the Flow-GRPO form, per sample [B]:
    KL_i = mean over elements of (mean - ref_mean)^2 / (2 std_dev_t^2).

    The true KL of the step divides by 2 (std_dev_t^2 * |dt|); this follows the reference recipe and drops
    the dt factor on purpose, which weights low-noise steps more.
    """
    sq = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return sq / (2 * std_dev_t.reshape(-1) ** 2)


@LOSSES.register("guard_log_ratio")
def guard_log_ratio(
    x_next: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """log r~ = mean over elements of eps (mean - old_mean), eps = (x_next - old_mean) / std, per sample [B]
    (std: [B] or [B, 1, ...]); equal to s (log p - log p_old) + mean((mean - old_mean)^2) / (2 s) for the
    Gaussian log-densities."""
    std = std.reshape(-1, *[1] * (x_next.ndim - 1))
    eps = (x_next.float() - old_mean.float()) / std
    return (eps * (mean.float() - old_mean.float())).mean(dim=tuple(range(1, x_next.ndim)))


@LOSSES.register("guard_step_weight")
def guard_step_weight(schedule: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The gradient reweighting 1 / (-dt) = 1 / (t[i] - t[i + 1]) of each step i [m], on the rollout's schedule
    t[0..T] (flow models: the noise levels sigma; DDIM: the timesteps over N, where it is the constant T)."""
    return 1.0 / (schedule[steps] - schedule[steps + 1]).float()


# --- losses on clean samples ------------------------------------------------------------------------------------------


@LOSSES.register("denoising")
def denoising_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The supervised denoising loss L = sum_i w_i mean((prediction_i - target_i)^2) / max(sum_i w_i, 1e-12) (w = 1
    without ``weights``: the plain mean over samples)."""
    per_sample = per_sample_mse(prediction, target)
    if weights is None:
        return per_sample.mean()
    weights = weights.to(per_sample)  # host-side batch weights, device-side losses
    return weighted_mean(per_sample, weights, floor=1e-12)


@LOSSES.register("diffusion_dpo")
def diffusion_dpo_loss(
    loss_win: torch.Tensor,
    loss_lose: torch.Tensor,
    ref_win: torch.Tensor,
    ref_lose: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Diffusion-DPO on per-pair denoising losses l (each [P], at a shared noise level and noise):
        L = mean(-log sigmoid(-beta/2 [(l_theta(w) - l_ref(w)) - (l_theta(l) - l_ref(l))]))
    averaged with ``weights`` when given (0 = padding pair). Diagnostics: ``dpo_ranking_acc`` = share of pairs
    where the policy improved more on the winner than on the loser (the implicit reward ranks them right),
    ``dpo_margin`` = mean of the bracket.
    """
    margin = (loss_win - ref_win) - (loss_lose - ref_lose)
    per_pair = -torch.nn.functional.logsigmoid(-0.5 * beta * margin)
    w = torch.ones_like(per_pair) if weights is None else weights.to(per_pair)
    loss = weighted_mean(per_pair, w)
    with torch.no_grad():  # means over the real pairs (0 without any), with no read of a device value
        real = w > 0
        count = real.sum().clamp_min(1)
        stats = {
            "dpo_ranking_acc": (real & (margin < 0)).sum() / count,
            "dpo_margin": torch.where(real, margin, 0.0).sum() / count,
        }
    return loss, stats


ADAPTIVE_FLOOR = 1e-5
"""Least mean absolute error an adaptive weight divides by (the authors' clip)."""


@LOSSES.register("nft")
def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_target: torch.Tensor,
    optimality: torch.Tensor,
    beta: float,
    error_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """DiffusionNFT's forward-process objective, per sample [B]:
        v+ = (1 - beta) v_old + beta v_theta        (implicit positive policy)
        v- = (1 + beta) v_old - beta v_theta        (implicit negative policy)
        L  = r~ l(v+ - v) + (1 - r~) l(v- - v)
    with v the regression target (flow matching: eps - x0), r~ in [0, 1] the sample's optimality probability and
    l(d) = mean(d^2) (means over elements). With ``error_scale`` k [B], the authors' adaptive weight on the
    clean-sample error e = k d (x0 implied by x_t and v±, minus x0; k = sigma for flow models):
        l(d) = mean(e^2) / sg(max(mean |e|, 1e-5))
    """
    dims = tuple(range(1, v_theta.ndim))

    def error(d: torch.Tensor) -> torch.Tensor:
        if error_scale is None:
            return d.pow(2).mean(dim=dims)
        e = d * error_scale.reshape(-1, *([1] * (d.ndim - 1))).to(d)
        return e.pow(2).mean(dim=dims) / e.detach().abs().mean(dim=dims).clamp_min(ADAPTIVE_FLOOR)

    positive = error((1 - beta) * v_old + beta * v_theta - v_target)
    negative = error((1 + beta) * v_old - beta * v_theta - v_target)
    return optimality * positive + (1 - optimality) * negative


@LOSSES.register("dgpo")
def dgpo_loss(
    loss_theta: torch.Tensor,
    loss_ref: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    form: str = "sigmoid_weighted",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group ([M, G] inputs: M groups of G samples), with s_g = beta / G sum_i A_i (l_theta_i - l_ref_i):
    "sigmoid_weighted" (the authors'): L_g = sigmoid(s_g).detach() / G sum_i A_i l_theta_i;
    "softplus": L_g = -log sigmoid(-s_g) = softplus(s_g), whose gradient is beta times the former's.
    Returns (L [M], the preference weight sigmoid(s) [M])."""
    s = beta / loss_theta.shape[1] * (advantages * (loss_theta - loss_ref)).sum(dim=1)
    weight = torch.sigmoid(s.detach())
    if form == "softplus":
        return F.softplus(s), weight
    return weight * (advantages * loss_theta).mean(dim=1), weight


@LOSSES.register("dgpo_clip")
def clip_denoising_loss(
    loss: torch.Tensor, old_loss: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' PPO-style clip of per-sample denoising losses: ratio = exp(l_old - l); where the ratio has
    left [1 - eps, 1 + eps] in the advantage's direction (A > 0: ratio > 1 + eps, else ratio < 1 - eps) the loss
    is detached (no gradient pushes it further). Returns (loss, clipped mask)."""
    ratio = torch.exp(old_loss - loss.detach())
    clipped = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(clipped, loss.detach(), loss), clipped


TimeWeighting = Literal["uniform", "sigma", "sigma**2", "huber", "ghuber"]
HUBER_EPS = 1e-10


def matching_log_prob(error: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """AWM's log p ~ -w(sigma, e) of per-sample matching errors e [B] at noise levels ``sigma`` [B], w by ``weighting``:
    e (uniform), sigma e, sigma^2 e, sigma (sqrt(e + 1e-10) - 1e-5) (huber), sigma ((e + 1e-10)^p - 1e-10^p) / p
    (ghuber, p = ``power``)."""
    if weighting == "uniform":
        return -error
    if weighting == "sigma":
        return -sigma * error
    if weighting == "sigma**2":
        return -(sigma**2) * error
    if weighting == "huber":
        return -sigma * (torch.sqrt(error + HUBER_EPS) - math.sqrt(HUBER_EPS))
    assert weighting == "ghuber", weighting
    return -sigma * ((error + HUBER_EPS) ** power - HUBER_EPS**power) / power


@LOSSES.register("awm")
def awm_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    target: torch.Tensor,
    advantages: torch.Tensor,
    sigma: torch.Tensor,
    clip_range: float,
    weights: torch.Tensor | None = None,
    weighting: str = "uniform",
    power: float = 0.25,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss on matching log-likelihoods log p = -w(sigma, mean((v - target)^2)) per sample
    ([B] each: ``advantages``, ``sigma``, ``weights`` 0 for samples left out); returns (loss, stats)."""
    log_prob = matching_log_prob(per_sample_mse(v_theta, target), sigma, weighting, power)
    old_log_prob = matching_log_prob(per_sample_mse(v_old, target), sigma, weighting, power)
    return clipped_policy_loss(advantages, log_prob, old_log_prob, clip_range, weights)


# --- differentiable rewards (refl, draft, drtune) ---------------------------------------------------------------------


def predicted_clean(training_target, x_t: torch.Tensor, prediction: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The clean sample a model output implies at x_t: with an adapter's affine ``training_target``,
    x_t = a x0 + s eps and target = c x0 + d eps, x0 = (x_t - (s / d) p) / (a - s c / d): x_t - sigma v for flow
    models, (x_t - sqrt(1 - abar) eps) / sqrt(abar) for epsilon ones (ReFL's ``pred_original_sample``)."""
    ones = torch.ones(len(sigma), 1, device=sigma.device)
    a, c = training_target(ones, torch.zeros_like(ones), sigma)
    s, d = training_target(torch.zeros_like(ones), ones, sigma)
    shape = (-1, *([1] * (x_t.ndim - 1)))
    a, c, s, d = (t.reshape(shape) for t in (a, c, s, d))
    return (x_t.float() - (s / d) * prediction) / (a - s * c / d)


@LOSSES.register("reward")
def reward_loss(rewards: torch.Tensor, form: str, margin: float = 2.0) -> torch.Tensor:
    """Per-sample loss of a differentiable reward: "negative" L = -r (DRaFT, DRTune); "hinge" L = relu(margin - r)
    (ImageReward's ReFL: F.relu(-rewards + 2))."""
    if form == "hinge":
        return F.relu(margin - rewards)
    assert form == "negative", form
    return -rewards
