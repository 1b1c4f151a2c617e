"""python trainer/main.py with a training file that shares prompts with its evaluation file: the run stops before
any model loads, naming how many and the first three, and leaves no run directory; eval.allow_overlap=true runs it,
printing the overlap, and its saved config says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["train 0", "test 7", "train 1", "test 2", "test 9", "test 0"]
TEST = [f"test {i}" for i in range(12)]
SHARED = "data.path='{train}' and eval.path='{test}' share 4 prompts (first three: 'test 7', 'test 2', 'test 9')"


def _job(tmp_path: Path, model: str, *overrides: str) -> subprocess.CompletedProcess:
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("".join(p + "\n" for p in TRAIN))
    test.write_text("".join(p + "\n" for p in TEST))
    args = [
        f"model.path={model}",
        f"logging.output_dir={tmp_path / 'out'}",
        "logging.run_name=run",
        "logging.progress=false",
        "logging.tensorboard=false",
        "data.name=prompt_file",
        f"data.path={train}",
        f"eval.path={test}",
        "train.warmup_steps=0",
        "train.epochs=1",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=2",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "eval.samples_per_prompt=1",
        "eval.num_steps=1",
        "eval.prompts=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
        *overrides,
    ]
    return subprocess.run(
        [sys.executable, "trainer/main.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_a_run_evaluating_on_prompts_it_trains_on_stops_before_its_model_loads(tmp_path):
    """The model path does not exist either: the pre-flight names both problems, so the overlap was found before
    any model loads."""
    run = _job(tmp_path, str(tmp_path / "no-model"))
    shared = SHARED.format(train=tmp_path / "train.txt", test=tmp_path / "test.txt")
    assert run.returncode == 2 and "2 things to fix" in run.stderr and f"  - {shared}: " in run.stderr, run.stderr
    assert "eval.allow_overlap=true" in run.stderr and "no-model': no such folder" in run.stderr
    assert not (tmp_path / "out").exists()  # the run directory it made is removed


def test_allow_overlap_runs_and_the_run_says_so(tmp_path, tiny_model_dir):
    run = _job(tmp_path, tiny_model_dir, "eval.allow_overlap=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (
        "note: eval.allow_overlap=true: data.path and eval.path share 4 prompts (first three: 'test 7', 'test 2', "
        "'test 9'): the evaluation is not on held-out examples"
    ) in run.stdout
    saved = yaml.safe_load((tmp_path / "out" / "run" / "config.yaml").read_text())
    assert saved["eval"]["allow_overlap"] is True
    assert (tmp_path / "out" / "run" / "final").is_dir()
