"""The data commands of the README, run from the repository root: each writes its committed training set (data/geneval,
data/ocr) byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.data import make_geneval_prompts as geneval
from trainer.data import make_ocr_prompts as ocr

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["make_geneval_prompts", "make_ocr_prompts"])
def test_the_committed_training_set_is_what_its_command_writes(module, tmp_path):
    """The README's command, run from the repository root, writes the committed file byte for byte."""
    source = {"make_geneval_prompts": geneval, "make_ocr_prompts": ocr}[module]
    out = tmp_path / "written"
    run = subprocess.run(
        [sys.executable, "-m", f"trainer.data.{module}", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert out.read_bytes() == (REPO / source.OUT).read_bytes()
