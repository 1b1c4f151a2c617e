"""Advantage estimators and policy-loss terms: pure functions on tensors, unit-tested on fixed values."""

from __future__ import annotations

import torch

STD_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False, clip: float = 5.0
) -> torch.Tensor:
    """GRPO advantages: A_i = (r_i - mean of r over i's group) / (std + 1e-4), clipped to [-clip, clip].

    ``std`` is the standard deviation of i's group, or of the whole batch when ``global_std`` (the
    Flow-GRPO recipe). Standard deviations are population ones (ddof = 0). NaN rewards (a failed reward
    component) are left out of every mean and std and get advantage 0: they carry no signal and are never
    counted as a zero reward.
    """
    r = rewards.double()
    valid = ~torch.isnan(r)
    adv = torch.zeros_like(r)
    batch_std = r[valid].std(unbiased=False) if valid.sum() > 1 else r.new_tensor(0.0)
    for g in torch.unique(group_ids):
        members = (group_ids == g) & valid
        if not members.any():
            continue
        values = r[members]
        std = batch_std if global_std else values.std(unbiased=False)
        adv[members] = (values - values.mean()) / (std + STD_EPS)
    return adv.clamp(-clip, clip).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def batch_advantages(rewards: torch.Tensor, clip: float = 5.0) -> torch.Tensor:
    """PPO-style advantages without grouping: (r - batch mean) / (batch std + 1e-4), NaN -> 0."""
    return group_advantages(rewards, torch.zeros_like(rewards, dtype=torch.long), global_std=True, clip=clip)


def zero_std_share(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of samples whose group has no reward spread (they get advantage 0 under per-group std)."""
    flat = 0
    for g in torch.unique(group_ids):
        values = rewards[(group_ids == g) & ~torch.isnan(rewards)]
        if len(values) > 0 and float(values.max() - values.min()) == 0.0:
            flat += len(values)
    return flat / max(len(rewards), 1)


def clipped_policy_loss(
    advantages: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip: ratio = exp(logp - logp_old); L = mean(max(-A ratio, -A clamp(ratio, 1-eps, 1+eps))).

    Returns the loss and detached diagnostics: ``approx_kl`` = 0.5 mean((logp - logp_old)^2) and
    ``clip_frac`` = mean(|ratio - 1| > eps).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "approx_kl": 0.5 * ((log_prob - old_log_prob) ** 2).mean(),
            "clip_frac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "ratio": ratio.mean(),
        }
    return loss, stats


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std_dev_t: torch.Tensor) -> torch.Tensor:
    """KL between equal-variance Gaussians in the Flow-GRPO form, per sample [B]:
    mean over elements of (mean - ref_mean)^2, divided by 2 std_dev_t^2.

    The true KL of the step divides by 2 (std_dev_t^2 * |dt|); this follows the reference recipe and drops
    the dt factor on purpose, which weights low-noise steps more.
    """
    sq = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return sq / (2 * std_dev_t.reshape(-1) ** 2)
