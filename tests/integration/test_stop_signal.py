"""SIGTERM mid-run (a scheduler's preemption): the run ends the step it is in, writes a checkpoint and stops;
resumed from it, the run goes on exactly as the one never stopped (CPU: bit-identical), the evaluation the stop
put off included."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from warm_start import tiny_trainer

from trainer.checkpoint import Progress
from trainer.stopping import StopSignalled

ARGS = [
    "algorithm.group_size=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "algorithm.kl_beta=0.01",
    "data.prompts_per_epoch=4",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "eval.every=2",
    "train.warmup_steps=3",
    "train.epochs=4",
    "train.checkpoint_every=0",
    "train.ema_decay=0.5",
    "logging.progress=false",
]
TIMES = ("images_per_s", "rollout_images_per_s", "time_", "time")


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without checkpoint records and wall-clock figures."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in r.items() if not k.startswith(TIMES)} for r in records if r["phase"] != "checkpoint"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """The run never stopped."""
    trainer = tiny_trainer(tmp_path_factory.mktemp("straight"), tiny_model_dir, *ARGS)
    trainer.fit()
    trainer.logger.close()
    return trainer


@pytest.mark.parametrize(
    ("phase", "at", "saved"),
    [("warmup_step", 1, Progress(2, 0)), ("rl_epoch", 1, Progress(3, 2, True, 2, eval_due=True))],
)
def test_a_stop_signal_checkpoints_the_step_and_a_resume_continues_exactly(
    tmp_path, tiny_model_dir, straight, phase, at, saved, capsys
):

    stopped = tiny_trainer(tmp_path / "stopped", tiny_model_dir, *ARGS)
    step = getattr(stopped, phase)

    def signalled(n: int):  # SIGTERM arrives while step ``at`` runs
        if n == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(n)

    setattr(stopped, phase, signalled)
    with stopped.stops, pytest.raises(StopSignalled):
        stopped.fit()
    stopped.logger.close()
    (checkpoint,) = stopped.checkpoints.directory.iterdir()
    assert Progress.load(checkpoint) == saved
    assert not list((tmp_path / "stopped").glob("samples_epoch*.png"))  # the epoch-2 evaluation was put off

    resumed = tiny_trainer(tmp_path / "stopped", tiny_model_dir, *ARGS)
    capsys.readouterr()
    resumed.resume(checkpoint)
    said = capsys.readouterr().out
    assert ("first the evaluation a stop signal put off" in said) == saved.eval_due, said
    resumed.fit()
    resumed.logger.close()
    assert _records(tmp_path / "stopped") == _records(straight.logger.run_dir)
    assert [r["step"] for r in _records(tmp_path / "stopped") if r["phase"] == "eval"] == [0, 2, 4]
    for a, b in zip(straight.adapter.trainable.parameters(), resumed.adapter.trainable.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(straight.ema.shadow, resumed.ema.shadow, strict=True))
