"""A run whose disk fills up: one line saying so and how to continue, the checkpoints before it whole, and a
continuation that finishes once there is room. The disk is a real tmpfs of a few MiB, mounted in a mount
namespace of the test's own (``unshare --mount``, as root); where that cannot be made the test is skipped, and
with RF_REQUIRE_SYSTEM_DEPS set (as in CI) it fails."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _namespaces_work() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None."""
    with tempfile.TemporaryDirectory() as point:
        try:
            made = subprocess.run(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    f"mount -t tmpfs -o size=1m rf-probe {point}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
    return None if made.returncode == 0 else made.stderr.strip() or f"exit status {made.returncode}"


WHY_NOT = _namespaces_work()
if WHY_NOT and os.environ.get("RF_REQUIRE_SYSTEM_DEPS"):
    raise RuntimeError(f"a private tmpfs is required here (RF_REQUIRE_SYSTEM_DEPS is set): {WHY_NOT}")
pytestmark = [
    pytest.mark.slow,  # two tiny runs: about 50 s
    pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot mount a private tmpfs: {WHY_NOT}"),
]


def test_a_full_disk_stops_the_run_in_one_line_and_a_continuation_finishes(tmp_path, tiny_model_dir):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    logs.mkdir()
    job = [
        sys.executable,
        "trainer/main.py",
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={out}",
        "logging.run_name=full",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=4",
        "train.warmup_checkpoint_every=2",
        "train.epochs=1",
        "train.checkpoint_every=1",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=2",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "eval.every=0",
        "reward.replicas=1",
    ]
    checker = (
        "from pathlib import Path; from trainer.checkpoint import Checkpoints, damaged; "
        f"c = Checkpoints(Path('{out}/full/checkpoints'), 0, False).latest(); print(c.name, damaged(c))"
    )
    # A checkpoint of the tiny model takes about 9.5 MiB: the first fits in 14 MiB, the second does not.
    script = f"""
        mount -t tmpfs -o size=14m rf-full {out}
        head -c 14m /dev/zero > {out}/filler 2> /dev/null || true
        {shlex.join(job)} > {logs}/start.out 2> {logs}/start.err; echo $? > {logs}/start.rc
        ls -A {out} > {logs}/start.listing
        rm {out}/filler
        {shlex.join(job)} > {logs}/first.out 2> {logs}/first.err; echo $? > {logs}/first.rc
        ls -a {out}/full/checkpoints > {logs}/listing
        {shlex.join([sys.executable, "-c", checker])} > {logs}/latest 2>&1
        mount -o remount,size=200m {out}
        {shlex.join([*job, "--resume", "auto"])} > {logs}/second.out 2> {logs}/second.err; echo $? > {logs}/second.rc
    """
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    # a disk full before the run starts: its config.yaml cannot be written; one line, nothing left behind
    start = (logs / "start.out").read_text() + (logs / "start.err").read_text()
    assert (logs / "start.rc").read_text().strip() == "2", start[-3000:]
    assert (
        f"error: cannot write {out}: No space left on device: make room there, or set "
        "logging.output_dir to a folder with room"
    ) in start and "Traceback" not in start, start[-3000:]
    assert (logs / "start.listing").read_text().split() == ["filler"]
    first = (logs / "first.out").read_text() + (logs / "first.err").read_text()
    assert (logs / "first.rc").read_text().strip() == "1", first[-3000:]
    assert "Traceback" not in first, first[-3000:]
    assert f"cannot write {out}/full/checkpoints: No space left on device (" in first, first[-3000:]
    needed = float(re.search(r"make room \(a checkpoint of this run takes ([0-9.]+) MiB\), then continue", first)[1])
    assert 8 < needed < 12, first[-3000:]  # the tiny model's: about 9.5 MiB
    # the warm-up's last step is not checkpointed: the run's final checkpoint is the one that found the disk full
    assert (
        "stopped in the final evaluation, every epoch done; continuing starts from the newest checkpoint, "
        f"{out}/full/checkpoints/step-000002-000000 (warm-up steps 2, RL epochs 0)"
    ) in first
    assert "continue with: python trainer/main.py" in first and "--resume auto" in first
    # what the failed write took is free again, and the checkpoint before it is whole
    assert (logs / "listing").read_text().split() == [".", "..", "step-000002-000000"]
    assert (logs / "latest").read_text().split() == ["step-000002-000000", "None"]
    second = (logs / "second.out").read_text()
    assert (logs / "second.rc").read_text().strip() == "0", (logs / "second.err").read_text()[-3000:]
    assert "resumed from" in second and "step-000002-000000" in second and "done:" in second
