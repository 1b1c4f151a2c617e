"""deploy/slurm.sbatch on a real SLURM cluster of one node (tests/slurm_cluster.py): SLURM's warning before the time
limit stops the training after its epoch with a checkpoint, the job requeues itself, and its next allocation
continues the same run to its end. Skipped without SLURM's packages (``make slurm-deps``) or root; with
RF_REQUIRE_SYSTEM_DEPS set (as in CI) their absence is an error."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from servers import free_port
from slurm_cluster import SlurmCluster, missing

REPO = Path(__file__).resolve().parents[2]
WHY_NOT = missing()
if WHY_NOT and os.environ.get("RF_REQUIRE_SYSTEM_DEPS"):
    raise RuntimeError(f"SLURM is required here (RF_REQUIRE_SYSTEM_DEPS is set): {WHY_NOT}")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))]
EPOCHS = 8  # the warning comes after the first; each takes ~1 s here


def _until(condition, what: str, cluster: SlurmCluster, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            text = log.read_text() if log.exists() else "(no output yet)"
            pytest.fail(
                f"no {what} within {timeout_s} s; squeue:\n{cluster.run('squeue').stdout}\njob output:\n{text[-6000:]}"
            )
        time.sleep(0.2)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_job_warned_of_its_time_limit_requeues_itself_and_its_next_allocation_finishes_the_run(
    tmp_path, tiny_model_dir
):
    """``scancel --signal=USR1 --batch`` is what ``--signal=B:USR1@600`` makes SLURM do 10 minutes before the
    limit. The requeued job waits for its begin time (SLURM's 121 s after a requeue), moved nearer here."""
    out_dir = tmp_path / "runs"
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={out_dir}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=2",
        f"train.epochs={EPOCHS}",
        "train.checkpoint_every=0",
        "data.prompts_per_epoch=4",
        "algorithm.group_size=2",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
    ]
    log = tmp_path / "job.out"
    with SlurmCluster(tmp_path / "slurm") as cluster:
        cluster.env.update(
            PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            OMP_NUM_THREADS="1",
            NPROC_PER_NODE="1",
            MASTER_PORT=str(free_port()),
            PYTHONUNBUFFERED="1",
        )
        job = cluster.run(
            "sbatch",
            "--parsable",
            "--nodes=1",
            "--gpus-per-node=0",
            "--cpus-per-task=2",
            f"--output={log}",
            f"--chdir={REPO}",
            str(REPO / "deploy" / "slurm.sbatch"),
            *args,
        ).stdout.strip()
        run_dir = out_dir / f"slurm-{job}"
        _until(lambda: any(r["phase"] == "rl" for r in _records(run_dir)), "first RL epoch", cluster, log)
        cluster.run("scancel", "--signal=USR1", "--batch", job)
        _until(lambda: cluster.job(job)["JobState"] == "PENDING", "requeue", cluster, log)
        state = cluster.job(job)
        first = log.read_text()
        assert state["Restarts"] == "1", state  # its Reason becomes BeginTime once the scheduler looks at it
        assert "SIGUSR1 received: stopped after RL epoch" in first, first[-3000:]
        assert f"slurm.sbatch: requeueing job {job} (allocation 2)" in first, first[-3000:]
        (checkpoint,) = (run_dir / "checkpoints").iterdir()
        stopped_at = json.loads((checkpoint / "progress.json").read_text())["epochs_done"]
        assert 1 <= stopped_at < EPOCHS
        # the hold covers the first allocation's teardown: its step ends after the batch script, and slurmd refuses
        # to start the job again within the second it revoked its credential ("Job 1 already killed")
        _until(lambda: cluster.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", "idle node", cluster, log)
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+2")
        _until(lambda: cluster.job(job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"), "end", cluster, log)
        state = cluster.job(job)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, text[-3000:])
    assert f"resumed from {checkpoint}" in text[len(first) :], text[len(first) :][-3000:]
    records = _records(run_dir)
    epochs = [r["step"] for r in records if r["phase"] == "rl"]
    assert epochs == list(range(1, EPOCHS + 1)), epochs  # each epoch once, over both allocations
    assert records[-1]["phase"] == "final" and text.count("requeueing job") == 1
