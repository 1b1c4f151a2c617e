"""Checks that stop a run which went wrong, with a message saying where and what to change: too many samples
without a reward, non-finite samples, and optimizer steps with non-finite gradients too many times in a row."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Future

import numpy as np
import torch

from shared.rewards import RewardResult
from trainer.rewards.errors import RewardClientError

logger = logging.getLogger("rewardflow.rewards")


class RewardFailure(RuntimeError):
    """Too many samples of an epoch have no reward (training on the rest would be biased), or the reward pool did
    not score an evaluation: the run stops, with a checkpoint of what it finished (``Trainer.fit``)."""


class TrainingDiverged(RuntimeError):
    """The policy's weights or gradients are no longer finite."""


ADVICE = (
    "lower the learning rate or clip gradients harder (a smaller train.max_grad_norm, whose 0 clips none), and "
    "start again or continue from a checkpoint before it (train.resume)"
)


def check_failed_share(failed: float, limit: float, epoch: int, reason: str | None = None) -> None:
    """RewardFailure when a share ``failed`` of RL epoch ``epoch``'s samples (1-based) has no reward, over ``limit``
    (``reason``: why, where this rank knows one)."""
    if failed > limit:
        why = (f"{reason}; " if reason else "") + "check the reward servers' logs"
        raise RewardFailure(
            f"epoch {epoch}: {failed:.0%} of samples have no reward (reward.max_failed_share = {limit:.0%}): {why}"
        )


def scored_or_unscored(future: Future, size: int, scorers: list[str], what: str) -> RewardResult:
    """The rewards of a chunk of ``size`` samples, or, where the reward pool could not score it (every replica out
    past ``reward.outage_s``, a request it refused), NaN for each with the reason: unscored samples count against
    ``reward.max_failed_share`` like any failed reward, instead of ending the run where they are few."""
    try:
        return future.result()
    except RewardClientError as exc:
        logger.warning("%s: %d samples got no reward: %s", what, size, exc)
        nan = np.full(size, np.nan)
        return RewardResult(
            {name: nan.copy() for name in scorers},
            nan.copy(),
            {name: dict.fromkeys(range(size), f"{UNSCORED}: {exc}") for name in scorers},
        )


def group_scored(
    backend, futures: list[Future | None], sizes: list[int], scorers: list[str], what: str
) -> list[RewardResult]:
    """The rewards of each chunk (``scored_or_unscored``) from this rank's requests, or, on a rank that sent none
    (not the first of its sequence-parallel group, whose ranks hold the same samples), from the group's first rank:
    one request per group. An error on the first rank is raised on every rank of the group."""
    try:
        asked = any(future is not None for future in futures)
        mine = [scored_or_unscored(*a, scorers, what) for a in zip(futures, sizes, strict=True)] if asked else None
    except Exception as exc:  # handed to the group (as its message: any exception pickles so), raised here as is
        backend.from_group_leader(RuntimeError(f"{type(exc).__name__}: {exc}"))
        raise
    shared = backend.from_group_leader(mine)
    if isinstance(shared, Exception):
        raise shared
    return shared


UNSCORED = "UNAVAILABLE"
"""The error code of a sample whose chunk no replica scored (:func:`scored_or_unscored`)."""


def unscored(result: RewardResult) -> torch.Tensor:
    """Per sample of ``result`` (float32): 1 where no replica scored it (lost), else 0; a NaN reward that is not lost
    came back from a scorer as an item error (a scorer's timeout or failure) and gets advantage 0."""
    lost = torch.zeros(len(result.combined))
    for errors in result.errors.values():
        lost[[i for i, error in errors.items() if error.startswith(f"{UNSCORED}:")]] = 1.0
    return lost


def first_error(result: RewardResult) -> str | None:
    """One of ``result``'s item errors, for a message (None: none)."""
    return next((f"{name}: {error}" for name, errors in result.errors.items() for error in errors.values()), None)


def check_samples(finite: torch.Tensor, epoch: int) -> None:
    """TrainingDiverged unless every rollout image of RL epoch ``epoch`` is finite (``finite``: a flag per sample of
    every rank, so that all ranks stop alike): weights that overflowed sample NaN, whose rewards are those of its
    8-bit conversion (0); called before the epoch trains on them."""
    if not bool(finite.all()):
        raise TrainingDiverged(
            f"RL epoch {epoch}: the policy sampled {int((finite == 0).sum())} non-finite images (its "
            f"weights or activations overflowed): the run diverged and stops; {ADVICE}"
        )


def count_skipped(progress, norm: float, limit: int) -> None:
    """Count in ``progress.skipped_in_a_row`` the optimizer steps in a row whose gradient ``norm`` was not finite
    (the backend skipped them); TrainingDiverged when it reaches ``limit``, naming the step ``progress`` is at."""
    progress.skipped_in_a_row = 0 if math.isfinite(norm) else progress.skipped_in_a_row + 1
    if progress.skipped_in_a_row >= limit:
        where = (
            f"RL epoch {progress.epochs_done + 1}"
            if progress.rl_started
            else f"warm-up step {progress.warmup_steps_done + 1}"
        )
        raise TrainingDiverged(
            f"{limit} optimizer steps in a row had non-finite gradients (inf or NaN), the last in "
            f"{where}: the run diverged and stops (those steps were skipped: the weights are the last "
            f"finite step's); {ADVICE}"
        )
