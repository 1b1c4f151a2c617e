"""A diverging real (tiny) run. Non-finite gradients, injected into the loss as a fault: each such optimizer step is
skipped and counted, and ``train.max_skipped_steps`` of them in a row stop the run with a message naming where and
what to change, the weights those of the last finite step. Weights that overflowed: their non-finite samples stop
the run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from warm_start import tiny_trainer

from trainer.health import TrainingDiverged

JOB = (
    "train.max_skipped_steps=3",
    "warmup.batch_size=4",
    "data.prompts_per_epoch=2",
    "algorithm.group_size=4",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "eval.samples_per_prompt=1",
    "eval.num_steps=1",
    "eval.every=0",
    "logging.progress=false",
)


def _poison(objective, bad) -> None:
    """Multiply ``objective``'s loss by NaN in the optimizer steps for which ``bad()`` is true."""
    loss = objective.loss
    objective.loss = lambda ctx, unit: (lambda value, stats: (value * math.nan if bad() else value, stats))(
        *loss(ctx, unit)
    )


def _records(run_dir, phase: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == phase]


def test_steps_with_non_finite_gradients_are_skipped_and_counted(tmp_path, tiny_model_dir, capsys):
    """Warm-up steps 2-3 and RL epoch 2's steps are poisoned (fewer in a row than the limit): those steps leave
    the weights as they were, are counted in skipped_steps and on the epoch's line, and the run goes on."""
    trainer = tiny_trainer(tmp_path / "run", tiny_model_dir, *JOB, "train.warmup_steps=5", "train.epochs=3")
    _poison(trainer.warmup, lambda: trainer.progress.warmup_steps_done in (1, 2))
    _poison(trainer.algorithm, lambda: trainer.progress.epochs_done == 1)
    weights = {}
    step = trainer.warmup_step

    def recorded(i):  # the trainable weights after each warm-up step
        stats = step(i)
        weights[i] = [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
        return stats

    trainer.warmup_step = recorded
    trainer.fit()
    trainer.logger.close()
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[2], strict=True))  # steps 1 and 2 skipped
    assert not all(torch.equal(a, b) for a, b in zip(weights[2], weights[3], strict=True))
    rl = _records(tmp_path / "run", "rl")
    assert [r["skipped_steps"] for r in rl] == [0, 1, 0] and math.isnan(rl[1]["grad_norm"])
    assert all(math.isfinite(r["grad_norm"]) for r in (rl[0], rl[2]))
    assert all(bool(torch.isfinite(p).all()) for p in trainer.adapter.trainable.parameters())
    assert "(1 steps skipped: gradients not finite)" in capsys.readouterr().out
    assert trainer.progress.skipped_in_a_row == 0


@pytest.mark.parametrize("phase", ["warm-up", "RL"])
def test_as_many_in_a_row_as_the_limit_stop_the_run_where_it_diverged(tmp_path, tiny_model_dir, phase):
    trainer = tiny_trainer(
        tmp_path / "run", tiny_model_dir, *JOB, "train.warmup_steps=6", "train.epochs=6", "algorithm.steps_per_epoch=2"
    )
    if phase == "warm-up":
        _poison(trainer.warmup, lambda: trainer.progress.warmup_steps_done >= 1)
        where = "warm-up step 4"  # steps 2, 3 and 4
    else:
        _poison(trainer.algorithm, lambda: trainer.progress.epochs_done >= 1)
        where = "RL epoch 3"  # 2 steps in epoch 2, the first of epoch 3
    before = None
    if phase == "warm-up":
        step = trainer.warmup_step

        def first(i):
            nonlocal before
            stats = step(i)
            before = before or [p.detach().clone() for p in trainer.adapter.trainable.parameters()]
            return stats

        trainer.warmup_step = first
    with pytest.raises(
        TrainingDiverged,
        match=rf"3 optimizer steps in a row had non-finite gradients .*, the last in "
        rf"{where}: .* lower the learning rate or clip gradients harder \(a smaller train.max_grad_norm",
    ):
        trainer.fit()
    trainer.logger.close()
    if before is not None:  # the weights are the last finite step's: warm-up step 1's
        assert all(torch.equal(a, b) for a, b in zip(before, trainer.adapter.trainable.parameters(), strict=True))
    assert all(bool(torch.isfinite(p).all()) for p in trainer.adapter.trainable.parameters())


def test_a_policy_that_samples_non_finite_images_stops_the_run_before_they_are_trained_on(tmp_path, tiny_model_dir):
    """A learning rate of 1e30: the first RL step's gradients are finite, its update overflows the weights, and the
    next epoch's rollouts are NaN; the run stops there, on every rank alike (the verdict is gathered), before it
    trains on them or the task's metric reads them."""
    trainer = tiny_trainer(
        tmp_path / "run", tiny_model_dir, *JOB, "train.warmup_steps=0", "train.epochs=4", "train.learning_rate=1e30"
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"RL epoch 2: the policy sampled 8 non-finite images .* lower the "
        r"learning rate",
    ):
        trainer.fit()
    trainer.logger.close()
    assert [r["step"] for r in _records(tmp_path / "run", "rl")] == [1]


def test_a_warm_up_whose_weights_overflowed_stops_at_the_evaluation_naming_its_learning_rate(tmp_path, tiny_model_dir):
    """A warm-up learning rate of 1e30: its steps' gradients are finite, its weights overflow, and the evaluation
    before RL samples NaN. It used to reach the digits classifier, whose scikit-learn error ('Input X contains NaN')
    ended the run."""
    trainer = tiny_trainer(
        tmp_path / "run",
        tiny_model_dir,
        *JOB,
        "train.warmup_steps=2",
        "train.epochs=2",
        "train.warmup_learning_rate=1e30",
        "eval.every=1",
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"^the evaluation before RL sampled 10 non-finite images \(.*: lower "
        r"train\.warmup_learning_rate",
    ):
        trainer.fit()
    trainer.logger.close()
    assert _records(tmp_path / "run", "rl") == []


def test_the_job_ends_with_the_message_in_one_line_and_exit_status_1(tmp_path, tiny_model_dir, capsys):
    """trainer/main.py (its reward replicas started by the job): a diverged run is reported as an error line, not
    a traceback, and the job exits 1 (a configuration it refuses exits 2)."""
    from trainer.main import main

    job = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.run_name=lr",
        "reward.replicas=1",
        "train.warmup_steps=0",
        "train.epochs=3",
        "train.learning_rate=1e30",
        *JOB,
    ]
    assert main(job) == 1
    err = capsys.readouterr().err
    assert "error: RL epoch 2: the policy sampled 8 non-finite images" in err and "Traceback" not in err
