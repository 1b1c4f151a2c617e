"""The multi-node launch scripts: valid bash, and the torchrun command line they build from SLURM's
environment (``--dry-run`` prints it instead of running it)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "launch_multinode.sh"
CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith("SLURM_") and k not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR",
                                                      "MASTER_PORT", "RDZV_ID")}


@pytest.mark.parametrize("script", ["launch_multinode.sh", "slurm.sbatch"])
def test_scripts_are_valid_bash(script):
    out = subprocess.run(["bash", "-n", str(REPO / "deploy" / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), "--dry-run", *args], env={**CLEAN, **env}, capture_output=True,
                          text=True, timeout=30)


def test_slurm_environment_becomes_the_torchrun_command_line():
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "4242",
           "MASTER_ADDR": "gpu-node-01", "MASTER_PORT": "29611"}
    out = _dry_run(env, "--config", "configs/presets/sd3_grpo_ocr.yaml", "parallel.backend=fsdp2", "logging.run_name=a b")
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout) == [
        "torchrun", "--nnodes=4", "--node_rank=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu-node-01:29611", "--rdzv_id=4242", "trainer/main.py",
        "--config", "configs/presets/sd3_grpo_ocr.yaml", "parallel.backend=fsdp2", "logging.run_name=a b"]


def test_explicit_variables_override_slurm_and_several_nodes_need_a_master():
    out = _dry_run({"SLURM_NNODES": "4", "SLURM_NODEID": "2", "NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2",
                    "MASTER_ADDR": "10.0.0.5"})
    assert "--nnodes=2 --node_rank=1 --nproc_per_node=2" in out.stdout and "--rdzv_endpoint=10.0.0.5:29500" in out.stdout
    missing = _dry_run({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "NPROC_PER_NODE": "1"})
    assert missing.returncode == 2 and "MASTER_ADDR must name the rendezvous host" in missing.stderr


def test_a_rank_that_does_not_see_the_run_directory_fails_before_training(tmp_path):
    """A node-local logging.output_dir on several machines: the other machines' ranks do not see the directory
    rank 0 made, and would fail at the first checkpoint (rank 0 renames what every rank wrote there)."""
    from trainer.build import require_shared_run_dir

    require_shared_run_dir(tmp_path, 1)
    with pytest.raises(ValueError, match=r"rank 3 does not see the run directory .*/missing.*logging\.output_dir"):
        require_shared_run_dir(tmp_path / "missing", 3)
