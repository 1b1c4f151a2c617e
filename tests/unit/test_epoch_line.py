"""The printed RL epoch and evaluation lines say when some samples got no reward (metrics.jsonl always has it)."""

from __future__ import annotations

from trainer.logging import epoch_line
from trainer.trainer import _fmt

EPOCH = {"reward_mean": 0.5, "reward_std": 0.1, "images_per_s": 2.0, "rollout_images_per_s": 4.0,
         "zero_std_share": 0.0, "failed_share": 0.0}


def test_an_epoch_line_names_the_share_of_samples_without_a_reward():
    assert "without a reward" not in epoch_line(3, EPOCH, [])
    assert "(25% of samples without a reward: they carry no signal)" in epoch_line(3, {**EPOCH, "failed_share": 0.25}, [])


def test_an_evaluation_line_shows_failed_share_only_when_some_image_got_no_reward():
    assert _fmt({"reward_mean": 0.5, "failed_share": 0.0}) == "reward_mean 0.500"
    assert _fmt({"reward_mean": 0.5, "failed_share": 0.25}) == "reward_mean 0.500  failed_share 0.250"
