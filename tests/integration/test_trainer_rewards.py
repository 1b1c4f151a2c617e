"""The trainer never trains on missing rewards: NaN rewards get advantage 0, and too many abort the epoch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from warm_start import tiny_trainer

from trainer.algorithms.core_algos import group_advantages
from trainer.data import DigitsTask
from trainer.health import RewardFailure
from trainer.trainer import Trainer


class _NoDigitTask(DigitsTask):
    """Digits, except that half the prompts name no digit: the digit scorer answers PARSE errors."""

    def __init__(self, failing: int):
        super().__init__(16)
        self.prompts = self.prompts[: 10 - failing] + ["a handwritten squiggle"] * failing

    def metadata(self, prompt: str) -> dict:
        return {}

    def metrics(self, images, prompts, scores):
        return {}


def _trainer(tmp_path: Path, tiny_model_dir: str, failing: int, limit: float) -> Trainer:
    return tiny_trainer(
        tmp_path,
        tiny_model_dir,
        "algorithm.group_size=2",
        "data.prompts_per_epoch=10",
        f"reward.max_failed_share={limit}",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        task=_NoDigitTask(failing),
        log=False,
    )


def test_failed_rewards_are_counted_and_get_no_advantage(tmp_path, tiny_model_dir):
    """GRPO with its default batch std: the failed samples' advantages are exactly 0 at every step, the
    others' are those of the valid rewards alone (a NaN in the std would make every advantage NaN), and the
    epoch's loss and gradient stay finite."""
    trainer = _trainer(tmp_path, tiny_model_dir, failing=3, limit=0.5)
    assert trainer.config.algorithm.name == "grpo" and trainer.algorithm.config.global_std
    batches = []
    make_batch = trainer.algorithm.make_batch

    def recorded(rollout, rewards):  # the real make_batch, its batch kept to read its advantages
        batches.append(make_batch(rollout, rewards))
        return batches[-1]

    trainer.algorithm.make_batch = recorded
    metrics = trainer.rl_epoch(0)
    assert metrics["failed_share"] == pytest.approx(0.3)
    assert (metrics["reward_zeroed"], metrics["reward_lost"]) == (6, 0)  # the scorer's item errors; every chunk scored
    assert math.isfinite(metrics["reward_mean"])  # NaNs are left out, never averaged in as 0
    assert math.isfinite(metrics["policy_loss"]) and math.isfinite(metrics["grad_norm"])

    (batch,) = batches
    rewards = batch.rewards
    failed = torch.isnan(rewards.local)
    assert int(failed.sum()) == 6  # 3 prompts of 10, 2 samples each
    adv = batch.advantages
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[failed], torch.zeros_like(adv[failed]))
    ok = ~torch.isnan(rewards.all)
    expected = group_advantages(rewards.all[ok], rewards.group_ids_all[ok], global_std=True)
    assert expected.abs().max() > 0  # the valid rewards carry a signal
    torch.testing.assert_close(adv[~failed], expected[:, None].expand(-1, adv.shape[1]).to(adv))


def test_an_epoch_aborts_past_the_failed_share(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, tiny_model_dir, failing=6, limit=0.5)
    with pytest.raises(RewardFailure, match="60% of samples have no reward"):
        trainer.rl_epoch(0)
