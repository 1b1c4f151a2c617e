"""A resume given no config file continues with the run's own settings (its config.yaml), overrides on top; a bare
``--resume auto`` used to take the defaults, and so ran the default 600-step warm-up and group size on it."""

from __future__ import annotations

import yaml

from trainer.checkpoint import Progress
from trainer.config import load_config, saved_dict
from trainer.main import main


def _a_run(tmp_path):
    """outputs/run1: the config.yaml of a run of 30 warm-up steps and 3 epochs, and a checkpoint after epoch 1."""
    run = tmp_path / "outputs" / "run1"
    checkpoint = run / "checkpoints" / "step-000030-000001"
    checkpoint.mkdir(parents=True)
    Progress(warmup_steps_done=30, epochs_done=1, rl_started=True).save(checkpoint)
    config = load_config(overrides=["train.warmup_steps=30", "train.epochs=3", "algorithm.group_size=4"])
    (run / "config.yaml").write_text(yaml.safe_dump(saved_dict(config), sort_keys=False))
    return run, checkpoint


def _shown(capsys, *argv: str) -> dict:
    assert main(["--show-config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def test_a_resume_without_a_config_file_takes_the_runs_own_settings(tmp_path, capsys):
    run, checkpoint = _a_run(tmp_path)
    out = f"logging.output_dir={tmp_path / 'outputs'}"
    shown = _shown(capsys, "--resume", "auto", out)
    assert (shown["train"]["warmup_steps"], shown["train"]["epochs"], shown["algorithm"]["group_size"]) == (30, 3, 4)
    assert shown["train"]["resume"] == "auto"
    shown = _shown(capsys, "--resume", "auto", out, "train.epochs=5")  # an override still wins
    assert (shown["train"]["warmup_steps"], shown["train"]["epochs"]) == (30, 5)
    shown = _shown(capsys, "--resume", str(checkpoint), out)  # a named checkpoint: its run's settings
    assert shown["train"]["warmup_steps"] == 30
    shown = _shown(capsys, "--resume", "auto", out, "logging.run_name=run1")
    assert shown["train"]["warmup_steps"] == 30


def test_a_config_file_or_no_run_to_continue_keeps_the_usual_settings(tmp_path, capsys):
    _a_run(tmp_path)
    out = f"logging.output_dir={tmp_path / 'outputs'}"
    shown = _shown(capsys, "--config", "configs/embedded_digits.yaml", "--resume", "auto", out)
    assert shown["train"]["warmup_steps"] == load_config("configs/embedded_digits.yaml").train.warmup_steps != 30
    shown = _shown(capsys, "--resume", "auto", f"logging.output_dir={tmp_path / 'elsewhere'}")
    assert shown["train"]["warmup_steps"] == load_config().train.warmup_steps
