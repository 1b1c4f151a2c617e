"""What an RL epoch measures besides its losses: every rank's rewards gathered and checked (samples that diverged or
lost their rewards stop the run before it trains on them), the epoch's reward figures and where its time went."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.rewards import RewardResult, failed_share
from trainer.algorithms.base import Rewards
from trainer.algorithms.core_algos import zero_std_share
from trainer.health import check_failed_share, check_samples, first_error, unscored


@dataclass
class EpochRewards:
    """An RL epoch's rewards on every rank: ``gathered`` holds each sample's reward, group, finite flag and lost
    flag (no replica scored it); ``scored`` the rewards on the CPU; ``failed`` the share without a reward."""

    rewards: Rewards
    gathered: torch.Tensor
    scored: torch.Tensor
    failed: float

    @classmethod
    def gather(
        cls, result: RewardResult, images: torch.Tensor, group_ids: torch.Tensor, backend, epoch: int, limit: float
    ) -> EpochRewards:
        """This rank's ``result`` for its ``images``, gathered; TrainingDiverged or RewardFailure, alike on every
        rank, when a sample is not finite or more than ``limit`` of RL epoch ``epoch``'s (1-based) have no reward."""
        local = torch.as_tensor(result.combined, dtype=torch.float32)
        finite = torch.isfinite(images.flatten(1)).all(1).float().cpu()  # each rank's, gathered: one verdict
        gathered = backend.gather_replicas(torch.stack([local, group_ids.float(), finite, unscored(result)], dim=1))
        offset = backend.world.replica * len(local)
        local = gathered[offset : offset + len(local), 0].to(local.device)  # a replica's ranks train on one copy
        rewards = Rewards(local, gathered[:, 0], gathered[:, 1].long(), offset)
        check_samples(gathered[:, 2], epoch)
        scored = rewards.all.cpu()  # gathered on the device under NCCL: read once
        failed = failed_share(scored)
        check_failed_share(failed, limit, epoch, first_error(result))
        return cls(rewards, gathered, scored, failed)

    def metrics(self) -> dict[str, float]:
        """The rewards' mean and spread, and how many samples lost their reward and why."""
        valid = self.rewards.all[~torch.isnan(self.rewards.all)]
        return {
            "reward_mean": float(valid.mean()) if len(valid) else math.nan,
            "reward_std": float(valid.std(unbiased=False)) if len(valid) else math.nan,
            "failed_share": self.failed,
            "reward_lost": float(self.gathered[:, 3].sum()),  # no replica scored them
            "reward_zeroed": float((self.scored.isnan() & (self.gathered[:, 3].cpu() == 0)).sum()),  # an item error
            "zero_std_share": zero_std_share(self.scored, self.rewards.group_ids_all.cpu()),  # no spread: advantage 0
        }


@dataclass
class EpochClock:
    """Where an RL epoch's time went: sampling, the wait for rewards after it, the updates (wall time), and the
    process's CPU time (load-independent, unlike wall time)."""

    start: float = field(default_factory=time.perf_counter)
    cpu_start: float = field(default_factory=time.process_time)
    sampled_at: float = 0.0
    reward_wait: float = 0.0
    trained_at: float = 0.0
    cpu_end: float = 0.0

    def sampled(self, reward_wait: float) -> None:
        self.sampled_at, self.reward_wait = time.perf_counter(), reward_wait

    def trained(self) -> None:
        self.trained_at, self.cpu_end = time.perf_counter(), time.process_time()

    def metrics(self, images: int) -> dict[str, float]:
        """Throughput and times of an epoch of ``images`` samples on every rank."""
        t0, t1, t2, t_wait = self.start, self.sampled_at, self.trained_at, self.reward_wait
        return {
            "images_per_s": images / (t2 - t0),  # the whole epoch: sampling, reward wait, updates
            "rollout_images_per_s": images / max(t1 - t0 - t_wait, 1e-9),  # sampling alone
            "time_rollout_s": t1 - t0 - t_wait,
            "time_reward_wait_s": t_wait,
            "time_train_s": t2 - t1,
            "time_epoch_s": t2 - t0,
            "time_epoch_cpu_s": self.cpu_end - self.cpu_start,
            "images": images,
        }


def log_rollout_samples(
    logger, config, task, epoch: int, images: torch.Tensor, indices: torch.Tensor, result: RewardResult
) -> None:
    """Rank 0's first ``logging.rollout_samples`` rollouts of every ``logging.rollout_samples_every``-th epoch
    and the last, with their prompts, rewards and image inputs (before a reward failure stops the run: they
    show it)."""
    n, every = config.logging.rollout_samples, config.logging.rollout_samples_every
    if n and logger.enabled and ((epoch + 1) % every == 0 or epoch + 1 == config.train.epochs):
        shown = indices[:n].tolist()
        logger.rollout_samples(
            epoch + 1,
            images[:n],
            [task.prompts[i] for i in shown],
            np.asarray(result.combined, dtype=float)[:n].tolist(),
            {name: np.asarray(v, dtype=float)[:n].tolist() for name, v in result.components.items()},
            task.inputs(shown),
        )


def rollout_metrics(task, ro, prompts: list[str], result: RewardResult) -> dict[str, float]:
    """This rank's rollouts' (``ro``, a Rollout) mean score by scorer (``reward/<name>``), the task's metrics of them,
    named apart from the evaluation's (``rollout_<name>``: other prompts, noise and weights), and the denoiser
    forwards per image (``rollout_forwards_per_image``: T, fewer where groups share a branching prefix)."""
    images = ro.images
    metrics = {"rollout_forwards_per_image": ro.forwards / len(images)}
    for name, values in result.components.items():
        metrics[f"reward/{name}"] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
    return {**metrics, **{f"rollout_{k}": v for k, v in task.metrics(images, prompts, result.components).items()}}
