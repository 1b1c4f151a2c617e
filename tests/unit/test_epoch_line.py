"""The printed RL epoch and evaluation lines say when some samples got no reward, and why an epoch waited for its
rewards (metrics.jsonl always has the numbers)."""

from __future__ import annotations

from trainer.logging import epoch_line, eval_line

EPOCH = {
    "reward_mean": 0.5,
    "reward_std": 0.1,
    "images_per_s": 2.0,
    "rollout_images_per_s": 4.0,
    "zero_std_share": 0.0,
    "failed_share": 0.0,
}


def test_an_epoch_line_names_the_share_of_samples_without_a_reward():
    assert "without a reward" not in epoch_line(3, EPOCH, [])
    assert "(25% of samples without a reward: they carry no signal)" in epoch_line(
        3, {**EPOCH, "failed_share": 0.25}, []
    )


def test_an_evaluation_line_shows_failed_share_only_when_some_image_got_no_reward():
    assert eval_line({"reward_mean": 0.5, "failed_share": 0.0}) == "reward_mean 0.500"
    assert eval_line({"reward_mean": 0.5, "failed_share": 0.25}) == "reward_mean 0.500  failed_share 0.250"


def test_a_long_wait_for_rewards_is_put_down_to_failed_requests_where_there_were_some():
    slow = {**EPOCH, "time_reward_wait_s": 5.0, "time_epoch_s": 10.0, "reward_failed_attempts": 0}
    assert "(waited 50% of the epoch for rewards after sampling: the reward servers score slower" in epoch_line(
        1, slow, []
    )
    failing = epoch_line(1, {**slow, "reward_failed_attempts": 4}, [])
    assert failing.endswith(
        "(waited 50% of the epoch for rewards after sampling; 4 reward requests failed and were "
        "retried: see the reward servers' logs)"
    )
    assert "waited" not in epoch_line(1, {**slow, "time_reward_wait_s": 1.0}, [])
