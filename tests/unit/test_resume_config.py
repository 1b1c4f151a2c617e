"""A resume given no config file continues with the run's own settings (its config.yaml), overrides on top; a bare
``--resume auto`` used to take the defaults, and so ran the default 600-step warm-up and group size on it."""

from __future__ import annotations

import yaml

from trainer.checkpoint import Progress
from trainer.config import load_config, saved_dict, to_dict
from trainer.main import main
from trainer.models.tiny import DEFAULT_TINY_PATH
from trainer.resume import config_changes


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


def test_a_run_saves_the_files_it_reads_as_absolute_paths(tmp_path, monkeypatch):
    """config.yaml and checkpoints hold every input path absolute (a resume, generate or export started in another
    folder finds them), except a Hub id given for a folder and what is empty; other text is kept as written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "encoders" / "clip").mkdir(parents=True)  # a folder here, though it reads as a Hub id too
    config = load_config(
        overrides=[
            "model.name=flux",
            "model.path=some-org/some-model",
            "model.text_embeddings=emb",
            "model.ip_adapter.image_encoder=encoders/clip",
            "model.ip_adapter.weights=ip",
            "data.name=prompt_file",
            "data.path=../prompts.txt",
            "eval.path=/data/eval.txt",
            "train.init_from=runs/a/best",
            "model.negative_prompt=blurry/grainy",
        ]
    )
    saved = saved_dict(config)
    assert saved["model"]["path"] == "some-org/some-model"  # model.path's error names `hf download`
    assert saved["model"]["text_embeddings"] == str(tmp_path / "emb") and saved["model"]["image_latents"] == ""
    assert saved["model"]["ip_adapter"]["image_encoder"] == str(tmp_path / "encoders" / "clip")
    assert saved["model"]["ip_adapter"]["weights"] == str(tmp_path / "ip")
    assert saved["data"]["path"] == str(tmp_path.parent / "prompts.txt") and saved["eval"]["path"] == "/data/eval.txt"
    assert saved["train"]["init_from"] == str(tmp_path / "runs" / "a" / "best")
    assert saved["model"]["negative_prompt"] == "blurry/grainy" and saved["reward"]["model_dir"] == ""
    assert load_config([]).model.path == DEFAULT_TINY_PATH  # the config itself keeps what was given
    # a checkpoint of an older run, which kept relative paths, is resumed without a warning about them
    older = to_dict(config)
    assert config_changes(older, saved) == []
    older["model"]["ip_adapter"]["image_encoder"] = "encoders/siglip"
    assert config_changes(older, saved) == [
        f"model.ip_adapter.image_encoder: 'encoders/siglip' -> {str(tmp_path / 'encoders' / 'clip')!r}"
    ]
