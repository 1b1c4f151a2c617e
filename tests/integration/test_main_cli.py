"""`python trainer/main.py` as its own process: its help, and what reading a config imports (no diffusers or
transformers before a model loads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.main import main

REPO = Path(__file__).resolve().parents[2]


def test_cli_help_and_config_errors(capsys):
    out = subprocess.run([sys.executable, "trainer/main.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "section.key=value" in out.stdout
    assert main(["train.epochz=1"]) == 2 and "unknown config key train.epochz" in capsys.readouterr().err
    assert main(["--show-config", "train.epochs=7"]) == 0 and "epochs: 7" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args", [["model.name=nosuch"], ["--show-config", "--config", "configs/presets/flux_fill_ip_adapter_grpo.yaml"]]
)
def test_reading_a_config_imports_no_diffusers_or_transformers(args):
    """Every adapter module is imported for its config class; their libraries load only when a model does (they
    took a config error 4 s here, ~20 s on a slower machine)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "trainer/main.py", *args], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == (2 if "model.name=nosuch" in args else 0), out.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in out.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "torch" in imported and "trainer" in imported  # the import log was read
    assert not imported & {"diffusers", "transformers", "peft", "accelerate"}, imported & {"diffusers", "transformers"}
