"""The scoreboard in real (tiny) runs: best/ holds exactly the weights its evaluation sampled with, early stop stops
and stays stopped on resume, and the hacking alarm fires on a reward that the task's metric contradicts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from warm_start import tiny_trainer

from trainer.export import export_checkpoint
from trainer.trainer import Trainer

TINY = [
    "algorithm.group_size=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "data.prompts_per_epoch=4",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "eval.every=1",
    "train.warmup_steps=0",
    "train.checkpoint_every=1",
    "train.keep_checkpoints=0",
    "logging.progress=false",
]


def _trainer(run_dir: Path, model_dir: str, *overrides: str, reward: str = "digit") -> Trainer:
    return tiny_trainer(run_dir, model_dir, *TINY, *overrides, reward=reward)


def _records(run_dir: Path, phase: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["phase"] == phase]


def test_best_holds_the_weights_its_evaluation_sampled_with(tmp_path, tiny_model_dir, capsys):
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        "train.epochs=2",
        "train.select_by=reward_mean",
        "train.ema_decay=0.5",
        "eval.alarm_scorers=[brightness]",
    )
    seen: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    evaluate = trainer.evaluate

    def recorded(step, grid_name):  # the trained weights, and those the evaluation's first forward reads
        trained = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]

        def first_forward(module, args) -> None:
            if step not in seen:
                seen[step] = trained, [p.detach().clone() for p in trainer.adapter.trainable.parameters()]

        hook = trainer.adapter.denoiser.register_forward_pre_hook(first_forward)
        try:
            return evaluate(step, grid_name)
        finally:
            hook.remove()

    trainer.evaluate = recorded
    trainer.fit()
    trainer.logger.close()
    evals = _records(tmp_path, "eval")
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(0 < r["alarm/brightness"] < 1 for r in evals)  # an alarm scorer, scored on the same images
    best = max(evals, key=lambda r: r["reward_mean"])  # the first of equal ones
    meta = json.loads((tmp_path / "best" / "meta.json").read_text())
    assert (meta["epoch"], meta["value"], meta["evaluated"]) == (best["step"], best["reward_mean"], "ema")
    trained, evaluated = seen[best["step"]]
    assert not all(torch.equal(a, b) for a, b in zip(trained, evaluated, strict=True)) or best["step"] == 0
    saved = load_file(tmp_path / "best" / "trainable.safetensors")
    names = [n for n, _ in trainer.adapter.denoiser.named_parameters() if _.requires_grad]
    assert all(torch.equal(saved[n], t) for n, t in zip(names, trained, strict=True))
    ema = load_file(tmp_path / "best" / "ema.safetensors")
    assert all(torch.equal(ema[f"{i:05d}"], t) for i, t in enumerate(evaluated))
    # export takes best/ as it takes a checkpoint: --ema gives the evaluated weights
    export_checkpoint(tmp_path / "best", tmp_path / "exported", ema=True)
    exported = load_file(tmp_path / "exported" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported[n], t) for n, t in zip(names, evaluated, strict=True))
    out = capsys.readouterr().out
    which = "before RL" if best["step"] == 0 else f"epoch {best['step']}"
    assert f"best: {which}, reward_mean {best['reward_mean']:.3f}" in out and f"{tmp_path / 'best'}" in out
    # eval.on_alarm=rollback restores exactly these trained weights and EMA
    with torch.no_grad():
        for p in trainer.adapter.trainable.parameters():
            p.add_(1.0)
    trainer.judge.restore_best()
    assert all(torch.equal(a, b) for a, b in zip(trainer.adapter.trainable.parameters(), trained, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.shadow, evaluated, strict=True))


def test_a_select_by_the_evaluation_does_not_log_is_refused_before_training(tmp_path, tiny_model_dir):
    with pytest.raises(
        ValueError,
        match="train.select_by='aesthetic' is not a metric this run's evaluation logs; "
        "choose one of: digit_accuracy, reward_mean, alarm/brightness",
    ):
        _trainer(tmp_path, tiny_model_dir, "train.select_by=aesthetic", "eval.alarm_scorers=[brightness]")


def test_early_stop_stops_and_a_resume_stays_stopped(tmp_path, tiny_model_dir, capsys):
    """With learning rate 0 every evaluation equals the first: two without improvement stop the run at epoch 2
    of 6; resuming its last checkpoint restores the scoreboard, which trains no further epoch."""
    args = ("train.epochs=6", "train.learning_rate=0", "train.early_stop=2", "train.ema_decay=0")
    trainer = _trainer(tmp_path / "run", tiny_model_dir, *args)
    trainer.fit()
    trainer.logger.close()
    assert len(_records(tmp_path / "run", "rl")) == 2 and trainer.progress.epochs_done == 2
    assert "early stop: digit_accuracy has not improved on epoch 0's" in capsys.readouterr().out
    (final,) = _records(tmp_path / "run", "final")
    assert final["step"] == 2 and (final["best_epoch"], final["best_value"]) == (0, final["digit_accuracy"])
    # the weights that stopped were evaluated at epoch 2: the final evaluation is that one, not run again
    assert [r["step"] for r in _records(tmp_path / "run", "eval")] == [0, 1, 2]
    assert final["digit_accuracy"] == _records(tmp_path / "run", "eval")[-1]["digit_accuracy"]
    grids = tmp_path / "run" / "samples_after.png", tmp_path / "run" / "samples_epoch0002.png"
    assert grids[0].read_bytes() == grids[1].read_bytes()
    resumed = _trainer(tmp_path / "resumed", tiny_model_dir, *args)
    resumed.resume(trainer.checkpoints.latest())
    assert vars(resumed.scoreboard) == vars(trainer.scoreboard)  # the tracker: history, best, counters, stopped
    resumed.fit()
    resumed.logger.close()
    assert resumed.progress.epochs_done == 2 and not _records(tmp_path / "resumed", "rl")


def test_a_rollback_restores_best_and_an_early_stop_with_it_evaluates_the_restored_weights(
    tmp_path, tiny_model_dir, capsys
):
    """eval.on_alarm=rollback with an evaluation scripted to look hacked at epoch 2 (reward up, accuracy down: the
    real hacked run is the slow test below): the weights go back to best/'s (epoch 1's), and as early stop stops
    there too, the final evaluation samples the restored weights instead of reusing epoch 2's."""
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        "train.epochs=4",
        "train.ema_decay=0",
        "eval.on_alarm=rollback",
        "eval.alarm_window=1",
        "train.early_stop=1",
    )
    script = {0: (0.1, 0.5), 1: (0.2, 0.9), 2: (0.6, 0.3)}  # step: (reward_mean, digit_accuracy)
    evaluate, calls, weights = trainer.evaluate, [], {}

    def scripted(step, grid_name):
        metrics = evaluate(step, grid_name)
        calls.append((step, grid_name))
        weights[step, grid_name] = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
        reward, accuracy = script.get(step, (0.0, 0.0))
        return {**metrics, "reward_mean": reward, "digit_accuracy": accuracy}

    trainer.evaluate = scripted
    trainer.fit()
    trainer.logger.close()
    assert calls == [(0, "samples_before"), (1, None), (2, None), (2, "samples_after")]
    assert "rolled back to the weights of epoch 1" in capsys.readouterr().out
    (alarm,) = _records(tmp_path, "alarm")
    assert (alarm["step"], alarm["metric"]) == (2, "digit_accuracy")
    best = load_file(tmp_path / "best" / "trainable.safetensors")
    names = [n for n, p in trainer.adapter.denoiser.named_parameters() if p.requires_grad]
    assert all(torch.equal(best[n], w) for n, w in zip(names, weights[1, None], strict=True))
    assert all(torch.equal(best[n], w) for n, w in zip(names, weights[2, "samples_after"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights[2, None], weights[1, None], strict=True))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_alarm_fires_on_a_hacked_reward_and_not_on_the_task_reward(
    tmp_path, tiny_model_dir, warmed_tiny_checkpoint, capsys
):
    """GRPO twice from the warmed-up model: against the digit reward, the alarm stays quiet; against the
    brightness reward (bright blobs score, digits do not), digit accuracy falls while the reward rises, and
    the alarm (eval.on_alarm=stop) stops the run (epoch 8 of 12 here); best/ keeps the best accuracy's weights."""
    start = f"train.init_from={warmed_tiny_checkpoint}"
    rl = (
        "eval.every=2",
        "eval.samples_per_prompt=4",
        "eval.num_steps=10",
        "algorithm.group_size=8",
        "algorithm.sampler.num_steps=10",
        "algorithm.sampler.window_range=[0,3]",
        "eval.on_alarm=stop",
        start,
    )
    for name, reward, epochs in ("normal", "digit", 8), ("hacked", "brightness", 12):
        trainer = _trainer(tmp_path / name, tiny_model_dir, *rl, f"train.epochs={epochs}", reward=reward)
        trainer.init_from(Path(warmed_tiny_checkpoint))
        trainer.fit()
        trainer.logger.close()
    assert not _records(tmp_path / "normal", "alarm")
    (alarm,) = _records(tmp_path / "hacked", "alarm")
    assert alarm["metric"] == "digit_accuracy" and alarm["metric_then"] - alarm["metric_now"] > 0.1
    assert alarm["reward_now"] > alarm["reward_then"]
    assert alarm["alert"].startswith(f"reward-hacking alarm at epoch {alarm['step']}: ")  # what W&B sends on
    evals = _records(tmp_path / "hacked", "eval")
    assert evals[-1]["step"] == alarm["step"] < 12, evals  # stopped there
    best = json.loads((tmp_path / "hacked" / "best" / "meta.json").read_text())
    assert best["value"] == max(r["digit_accuracy"] for r in evals) and not math.isnan(best["value"])
    assert "reward-hacking alarm at epoch" in capsys.readouterr().out


def _scripted(trainer: Trainer, script: dict[int, tuple[float, float]]) -> None:
    """The trainer's evaluations report ``script[step]`` as (reward_mean, digit_accuracy); (0, 0) off the script."""
    evaluate = trainer.evaluate

    def scripted(step, grid_name):
        reward, accuracy = script.get(step, (0.0, 0.0))
        return {**evaluate(step, grid_name), "reward_mean": reward, "digit_accuracy": accuracy}

    trainer.evaluate = scripted


def test_a_run_continuing_a_checkpoint_whose_best_weights_are_gone_says_so_and_cannot_roll_back(
    tmp_path, tiny_model_dir, capsys
):
    """The first run went on from its epoch-1 checkpoint to a better epoch 2, so its best/ no longer holds the epoch-1
    weights that checkpoint's scoreboard names best. A run continuing that checkpoint had no best/, yet its closing
    line named one, and a rollback would have failed loading it."""
    first = _trainer(tmp_path / "first", tiny_model_dir, "train.epochs=2", "train.ema_decay=0")
    _scripted(first, {0: (0.1, 0.5), 1: (0.2, 0.9), 2: (0.3, 0.95)})
    first.fit()
    first.logger.close()
    assert json.loads((tmp_path / "first" / "best" / "meta.json").read_text())["epoch"] == 2
    again = _trainer(
        tmp_path / "again",
        tiny_model_dir,
        "train.epochs=4",
        "train.ema_decay=0",
        "eval.on_alarm=rollback",
        "eval.alarm_window=1",
    )
    _scripted(again, {2: (0.6, 0.3)})  # reward up, accuracy down: the alarm
    again.resume(tmp_path / "first" / "checkpoints" / "step-000000-000001")
    assert (
        f"note: best/ starts empty: {tmp_path / 'first' / 'best'} holds epoch 2's weights, not those of epoch 1, the "
        "best evaluation this checkpoint knows"
    ) in capsys.readouterr().out
    again.fit()
    again.logger.close()
    out = capsys.readouterr().out
    assert (
        "stopped by the reward-hacking alarm: eval.on_alarm=rollback has no best/ to roll back to (epoch 1's "
        "weights were not carried into this run)"
    ) in out
    assert "its weights: not in this run (it continued a checkpoint of another run, which no longer holds them)" in out
    assert again.progress.epochs_done == 2 and not (tmp_path / "again" / "best").exists()
