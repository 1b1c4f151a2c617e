"""Typed config: defaults, YAML + overrides, and errors that name the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import Config, ConfigError, load_config
from trainer.models.sd3 import SD3Config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_job():
    config = load_config()
    assert config.model.name == "tiny" and config.algorithm.name == "grpo"
    assert config.algorithm.sampler.sde_window == 2 and config.reward.weights == {"digit": 1.0}


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: sd3\n  path: /weights/sd3\n  lora: {rank: 8}\ntrain:\n  epochs: 3\n")
    config = load_config(str(path), ["train.epochs=5", "algorithm.sampler.kind=cps", "reward.urls=[http://h:1]"])
    assert isinstance(config.model, SD3Config) and config.model.path == "/weights/sd3"
    assert config.model.lora.rank == 8 and config.model.lora.alpha == 64
    assert config.train.epochs == 5 and config.algorithm.sampler.kind == "cps"
    assert config.reward.urls == ["http://h:1"]


@pytest.mark.parametrize("override, message", [
    ("train.epoch=3", "unknown config key train.epoch; valid keys here: "),
    ("train.epochs=three", "train.epochs: expected an integer, got 'three'"),
    ("model.name=nope", "model.name='nope' is not registered"),
    ("parallel.backend=mpi", "parallel.backend: 'mpi' is not one of"),
    ("algorithm.group_size=1", "algorithm.group_size must be >= 2"),
    ("algorithm.timestep_fraction=0", "algorithm.timestep_fraction=0.0 must be in (0, 1]"),
    ("train", "must look like section.key=value"),
    ("train.epochs.x=1", "train.epochs is not a section"),
])
def test_bad_keys_and_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert message in str(info.value)


def test_every_shipped_config_file_loads():
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files, "configs/ should ship presets"
    for path in files:
        assert isinstance(load_config(str(path)), Config), path


def test_cli_help_and_config_errors():
    env_python = sys.executable
    out = subprocess.run([env_python, "trainer/main.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "section.key=value" in out.stdout
    out = subprocess.run([env_python, "trainer/main.py", "train.epochz=1"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "unknown config key train.epochz" in out.stderr
    out = subprocess.run([env_python, "trainer/main.py", "--show-config", "train.epochs=7"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "epochs: 7" in out.stdout


def test_switching_model_by_override_takes_the_new_model_defaults():
    config = load_config(overrides=["model.name=qwen_image", "model.path=/w/qwen"])
    assert config.model.name == "qwen_image" and config.model.path == "/w/qwen"
    assert config.model.dtype == "bfloat16" and config.model.resolution == 1024
    assert config.model.max_sequence_length == 512


def test_the_embedded_preset_is_the_default():
    assert load_config(str(REPO / "configs" / "embedded_digits.yaml")) == load_config()
