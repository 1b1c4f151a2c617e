"""The embedded video job (configs/embedded_video.yaml at toy size) end to end: the tiny Wan built on first use, the
job's own replicas serving ``digit`` and ``motion``, evaluations logging both task metrics, animated grids and
best/ chosen by direction accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOY = [
    "train.warmup_steps=3",
    "data.misnamed_from=1",  # the config's misnamed captions, from the second warm-up step
    "train.epochs=2",
    "algorithm.group_size=2",
    "data.prompts_per_epoch=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "eval.num_steps=2",
    "eval.samples_per_prompt=1",
    "eval.prompts=4",
    "eval.every=1",
    "logging.progress=false",
    "train.checkpoint_every=0",
]


@pytest.mark.slow
def test_the_video_job_logs_both_metrics_writes_animated_grids_and_keeps_best(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(REPO / "trainer" / "main.py"), "--config", str(REPO / "configs" / "embedded_video.yaml")]
    cmd += [f"model.path={tmp_path / 'tiny-wan'}", "model.build_if_missing=true", f"logging.output_dir={tmp_path}"]
    run = subprocess.run([*cmd, "logging.run_name=toy", *TOY], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    run_dir = tmp_path / "toy"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["phase"] == "eval"]
    assert len(evals) == 3
    assert all(0 <= r["direction_accuracy"] <= 1 and 0 <= r["digit_accuracy"] <= 1 for r in evals)
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["failed_share"] == 0.0 for r in rl)  # both rewards scored every clip
    for name in ("samples_before.gif", "samples_after.gif", "reward_curve.png"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "best" / "meta.json").read_text())["select_by"] == "direction_accuracy"
    assert (run_dir / "best" / "trainable.safetensors").is_file()
