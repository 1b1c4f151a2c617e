"""bench/algorithms.py end to end at toy size: one algorithm, two seeds from one shared warm-up, one RL epoch
each (the rows per algorithm are unit-tested in tests/unit/test_bench_time_to_target.py); its markdown table parses
and says which seeds reached the target."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
SPEC = importlib.util.spec_from_file_location("bench_algorithms", REPO / "bench" / "algorithms.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


@pytest.mark.slow  # three trainer jobs, each starting its reward replica (five took 99 s on 2 idle cores)
def test_a_toy_bench_runs_and_its_table_parses(tmp_path, tiny_model_dir):
    command = [
        sys.executable,
        "bench/algorithms.py",
        "--only",
        "grpo",
        "--seeds",
        "0,1",
        "--epochs",
        "1",
        "--warmup-steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    toy = [
        "--set",
        f"model.path={tiny_model_dir}",
        "reward.replicas=1",
        "data.prompts_per_epoch=1",
        "algorithm.group_size=4",
        "eval.samples_per_prompt=1",
        "warmup.batch_size=4",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([*command, "--target", "0", *toy], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    rows = bench.parse_markdown((tmp_path / "time_to_target.md").read_text())
    assert [r["algorithm"] for r in rows] == ["grpo"]
    assert all(r["reached"] == "2/2" and r["images to target"] == "0" for r in rows)  # target 0: before RL
    assert (tmp_path / "time_to_target.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["grpo-seed0", "grpo-seed1", "warmup-seed0"]
    # the same runs against an unreachable target, without running anything again
    subprocess.run(
        [*command, "--target", "2", "--table-only"], cwd=REPO, env=env, check=True, capture_output=True, text=True
    )
    rows = bench.parse_markdown((tmp_path / "time_to_target.md").read_text())
    assert all(r["reached"] == "0/2" and r["epochs to target"] == "n.r." for r in rows)
