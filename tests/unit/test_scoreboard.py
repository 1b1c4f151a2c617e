"""The scoreboard's decisions on hand-made evaluation series: the hacking alarm, the best evaluation, early stop, and
its checkpoint state; and the held-out split and the progress line's statistics it goes with."""

from __future__ import annotations

import math

import pytest

from trainer.algorithms import build_algorithm
from trainer.config import load_config
from trainer.data import DigitsTask, PromptFileTask, build_tasks, training_items
from trainer.scoreboard import REWARD, Scoreboard, hacking_alarm


def test_alarm_fires_when_the_reward_rises_while_an_alarm_metric_falls_past_the_margin():
    epochs = [0, 5, 10, 15]
    history = {
        REWARD: [0.50, 0.70, 0.80, 0.90],
        "digit_accuracy": [0.80, 0.90, 0.85, 0.75],
        "alarm/aesthetic": [5.0, 5.0, 5.0, 5.0],
    }
    alarm = hacking_alarm(epochs, history, window=2, margin=0.1)
    # compared with epoch 5: reward 0.70 -> 0.90, accuracy 0.90 -> 0.75 (a fall of 0.15 > 0.1)
    assert alarm is not None and (alarm.epoch, alarm.since, alarm.metric) == (15, 5, "digit_accuracy")
    assert (alarm.reward_then, alarm.reward_now, alarm.metric_then, alarm.metric_now) == (0.70, 0.90, 0.90, 0.75)
    assert "0.700 -> 0.900" in alarm.message() and "digit_accuracy fell 0.900 -> 0.750" in alarm.message()
    assert hacking_alarm(epochs, history, window=2, margin=0.2) is None  # a fall of 0.15 is within 0.2
    assert hacking_alarm(epochs, history, window=1, margin=0.05) is not None  # 0.85 -> 0.75 over one
    assert hacking_alarm(epochs, history, window=4, margin=0.0) is None  # fewer than 5 evaluations


def test_no_alarm_when_the_reward_does_not_rise():
    history = {REWARD: [0.9, 0.8, 0.9], "digit_accuracy": [0.9, 0.8, 0.5]}
    assert hacking_alarm([0, 1, 2], history, window=2, margin=0.1) is None  # 0.9 -> 0.9: no rise
    history[REWARD] = [0.9, 0.8, math.nan]  # a failed reward never rises
    assert hacking_alarm([0, 1, 2], history, window=2, margin=0.1) is None


def _observe(board: Scoreboard, series: list[tuple[float, float]]) -> list:
    return [board.observe(5 * i, {REWARD: r, "digit_accuracy": a}) for i, (r, a) in enumerate(series)]


def test_scoreboard_keeps_the_best_stops_early_and_raises_an_alarm_once():
    board = Scoreboard("digit_accuracy", early_stop=2, alarm_window=1, alarm_margin=0.05)
    verdicts = _observe(board, [(0.5, 0.80), (0.6, 0.95), (0.7, 0.85), (0.8, 0.80), (0.9, 0.70)])
    assert [v.improved for v in verdicts] == [True, True, False, False, False]
    assert (board.best_epoch, board.best_value) == (5, 0.95)
    # alarms: 0.95 -> 0.85 at epoch 10 (raised), later falls are the same episode (no new best since)
    assert [v.alarm is not None for v in verdicts] == [False, False, True, False, False]
    assert [bool(v.stop) for v in verdicts] == [False, False, False, True, True]
    assert "not improved on epoch 5's 0.95 in 2 evaluations" in verdicts[3].stop


def test_the_best_line_names_an_export_command_that_pastes_as_it_is():
    """A run folder with a space broke the printed export command on paste (the continue line was quoted)."""
    board = Scoreboard("digit_accuracy", early_stop=0, alarm_window=1, alarm_margin=0.05)
    _observe(board, [(0.5, 0.80)])
    line = board.report("/runs/my run/best", "--ema ")
    assert line.endswith("(export: python -m trainer.export --checkpoint '/runs/my run/best' --ema --out DIR)"), line


def test_scoreboard_state_round_trips_and_judges_the_same_afterwards():
    series = [(0.5, 0.80), (0.6, 0.95), (0.7, 0.85)]
    board = Scoreboard("digit_accuracy", early_stop=3, alarm_window=2, alarm_margin=0.05)
    _observe(board, series)
    board.stopped = True
    saved = {name: state.tensors for name, state in board.checkpoint_state().items()}
    restored = Scoreboard("digit_accuracy", early_stop=3, alarm_window=2, alarm_margin=0.05)
    restored.load_checkpoint_state(saved, "test")
    assert vars(restored) == vars(board)
    more = {REWARD: 0.9, "digit_accuracy": 0.80}
    assert restored.observe(15, dict(more)) == board.observe(15, dict(more))


def test_a_checkpoint_from_before_the_rename_restores_the_scoreboard():
    """Checkpoints before 2026-12 kept it as "guard", its scorers' means as guard/<scorer>."""
    board = Scoreboard("alarm/aesthetic", early_stop=3, alarm_window=2, alarm_margin=0.05)
    board.observe(0, {REWARD: 0.5, "alarm/aesthetic": 5.0})
    (state,) = board.checkpoint_state().values()
    old = {"guard": {key.replace("alarm/", "guard/"): value for key, value in state.tensors.items()}}
    restored = Scoreboard("alarm/aesthetic", early_stop=3, alarm_window=2, alarm_margin=0.05)
    restored.load_checkpoint_state(old, "test")
    assert vars(restored) == vars(board) and restored.history["alarm/aesthetic"] == [5.0]


def test_scoreboard_refuses_a_select_by_the_evaluation_does_not_log():
    with pytest.raises(
        ValueError,
        match="train.select_by='aesthetic' is not an evaluation metric; the evaluation "
        "logs: digit_accuracy, reward_mean",
    ):
        Scoreboard("aesthetic", 0, 2, 0.1).observe(0, {REWARD: 0.5, "digit_accuracy": 0.9})


def test_evaluation_prompts_are_held_out_of_training(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(20)))
    task = PromptFileTask(str(prompts))
    assert task.eval_prompts == [f"prompt {i}" for i in range(8)] and training_items(task) == list(range(8, 20))
    prompts.write_text("".join(f"prompt {i}\n" for i in range(12)))  # 4 others for 8 evaluated: all are trained
    assert training_items(PromptFileTask(str(prompts))) == list(range(12))
    assert training_items(DigitsTask(16)) == list(range(10))  # one prompt per class


def test_an_evaluation_file_or_count_sets_what_is_evaluated_and_what_rl_keeps(tmp_path):
    """eval.prompts cuts or widens the held-out items; eval.path evaluates another file of the same format (the
    test split) and gives RL every item of data.path; an embedded task keeps its own prompts."""
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("".join(f"prompt {i}\n" for i in range(30)))
    test.write_text("".join(f"test {i}\n" for i in range(20)))

    def tasks(*overrides: str):
        config = load_config(overrides=["data.name=prompt_file", f"data.path={train}", *overrides])
        return build_tasks(config.data, config.eval)

    task, evaluated = tasks("eval.prompts=12")
    assert evaluated is task and task.eval_prompts == [f"prompt {i}" for i in range(12)]
    assert training_items(task) == list(range(12, 30))
    task, evaluated = tasks(f"eval.path={test}")
    assert evaluated.eval_prompts == [f"test {i}" for i in range(20)] and evaluated.eval_indices == list(range(20))
    assert task.eval_prompts == [] and training_items(task) == list(range(30))
    assert tasks(f"eval.path={test}", "eval.prompts=5")[1].eval_prompts == [f"test {i}" for i in range(5)]
    config = load_config(overrides=["eval.prompts=4"])
    task, evaluated = build_tasks(config.data, config.eval)
    assert evaluated is task and task.eval_prompts == task.prompts[:4] and training_items(task) == list(range(10))
    with pytest.raises(
        ValueError,
        match=r"eval.path='.*test.txt' is not read by data.name='digits', an embedded task "
        r"that evaluates its own prompts; remove eval.path",
    ):
        build_tasks(config.data, load_config(overrides=[f"eval.path={test}"]).eval)
    with pytest.raises(ValueError, match=r"^eval.path='.*missing.txt': no such file"):
        tasks(f"eval.path={tmp_path / 'missing.txt'}")
    # more than there are: refused naming the count, where it was cut to what there was without a word
    with pytest.raises(
        ValueError,
        match=r"^eval.prompts=11 but data.name='digits' has 10 items: set eval.prompts to "
        r"at most that",
    ):
        build_tasks(config.data, load_config(overrides=["eval.prompts=11"]).eval)
    with pytest.raises(ValueError, match=r"^eval.prompts=31 but data.path='.*train.txt' has 30 items"):
        tasks("eval.prompts=31")
    with pytest.raises(ValueError, match=r"^eval.prompts=21 but eval.path='.*test.txt' has 20 items"):
        tasks(f"eval.path={test}", "eval.prompts=21")


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ([], ()),  # one optimizer step per rollout batch: the ratio is 1, its statistics say nothing
        (["algorithm.steps_per_epoch=2"], ("approx_kl", "clip_frac", "logp_gap")),  # later steps: the rollout's log p
        (["algorithm.inner_epochs=2", "algorithm.kl_beta=0.01"], ("approx_kl", "clip_frac", "kl")),
        (["algorithm.name=ppo_critic"], ("value_loss",)),
    ],
)
def test_the_progress_line_shows_ratio_statistics_only_off_policy(overrides, shown):
    config = load_config(overrides=overrides)
    assert build_algorithm(config.algorithm).shown_metrics == shown
