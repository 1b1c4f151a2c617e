"""The multi-node launch scripts: valid bash, and the torchrun command line they build from SLURM's
environment (``--dry-run`` prints it instead of running it)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "deploy" / "launch_multinode.sh"
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith("SLURM_")
    and k
    not in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "CUDA_VISIBLE_DEVICES")
}


@pytest.mark.parametrize("script", ["launch_multinode.sh", "slurm.sbatch"])
def test_scripts_are_valid_bash(script):
    out = subprocess.run(["bash", "-n", str(REPO / "deploy" / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH), "--dry-run", *args], env={**CLEAN, **env}, capture_output=True, text=True, timeout=30
    )


def test_slurm_environment_becomes_the_torchrun_command_line():
    env = {
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_JOB_ID": "4242",
        "MASTER_ADDR": "gpu-node-01",
        "MASTER_PORT": "29611",
    }
    out = _dry_run(
        env, "--config", "configs/presets/sd3_grpo_ocr.yaml", "parallel.backend=fsdp2", "logging.run_name=a b"
    )
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout) == [
        "torchrun",
        "--nnodes=4",
        "--node_rank=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=gpu-node-01:29611",
        "--rdzv_id=4242",
        "trainer/main.py",
        "--config",
        "configs/presets/sd3_grpo_ocr.yaml",
        "parallel.backend=fsdp2",
        "logging.run_name=a b",
    ]


def test_explicit_variables_override_slurm_and_several_nodes_need_a_master():
    out = _dry_run(
        {
            "SLURM_NNODES": "4",
            "SLURM_NODEID": "2",
            "NNODES": "2",
            "NODE_RANK": "1",
            "NPROC_PER_NODE": "2",
            "MASTER_ADDR": "10.0.0.5",
        }
    )
    assert (
        "--nnodes=2 --node_rank=1 --nproc_per_node=2" in out.stdout and "--rdzv_endpoint=10.0.0.5:29500" in out.stdout
    )
    missing = _dry_run({"SLURM_NNODES": "2", "SLURM_NODEID": "0", "NPROC_PER_NODE": "1"})
    assert missing.returncode == 2 and "MASTER_ADDR must name the rendezvous host" in missing.stderr


def _fake_nvidia_smi(tmp_path: Path, script: str) -> dict[str, str]:
    """PATH with an ``nvidia-smi`` that runs ``script`` (this machine has no NVIDIA driver)."""
    (tmp_path / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{script}\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def _nproc(out: subprocess.CompletedProcess) -> str:
    return next(arg for arg in shlex.split(out.stdout) if arg.startswith("--nproc_per_node="))


LISTS_FOUR_GPUS = 'for i in 0 1 2 3; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done'


def test_cuda_visible_devices_sets_the_process_count_before_slurm_and_nvidia_smi(tmp_path):
    """nvidia-smi lists every GPU of the machine, also those CUDA_VISIBLE_DEVICES hides: one process per listed
    GPU would start ranks on GPUs the job was not given (or several ranks on one)."""
    fake = _fake_nvidia_smi(tmp_path, LISTS_FOUR_GPUS)
    out = _dry_run({**fake, "CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_ON_NODE": "4"})
    assert out.returncode == 0, out.stderr
    assert _nproc(out) == "--nproc_per_node=2"
    assert "2 process(es) on this node (from CUDA_VISIBLE_DEVICES=2,3)" in out.stderr
    out = _dry_run(fake)
    assert _nproc(out) == "--nproc_per_node=4" and "from the GPUs 'nvidia-smi -L' lists" in out.stderr
    assert _nproc(_dry_run({**fake, "CUDA_VISIBLE_DEVICES": "2,3", "NPROC_PER_NODE": "1"})) == "--nproc_per_node=1"


def test_a_failing_nvidia_smi_or_no_visible_gpu_stops_with_a_message(tmp_path):
    """Under ``set -euo pipefail`` a failing ``nvidia-smi | wc -l`` ended the script without a word."""
    fake = _fake_nvidia_smi(
        tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9'
    )
    out = _dry_run(fake)
    assert out.returncode == 2 and not out.stdout
    assert "couldn't communicate with the NVIDIA driver" in out.stderr and "set NPROC_PER_NODE" in out.stderr
    assert _nproc(_dry_run({**fake, "NPROC_PER_NODE": "2"})) == "--nproc_per_node=2"
    hidden = _dry_run({**fake, "CUDA_VISIBLE_DEVICES": ""})
    assert hidden.returncode == 2 and "set NPROC_PER_NODE" in hidden.stderr


def test_the_sbatch_script_gives_srun_the_jobs_cpus_per_task(tmp_path):
    """Slurm 22.05-23.02 do not hand the job's --cpus-per-task to srun: unless srun repeats it, torchrun and
    every rank it starts share one CPU. ``srun`` and ``scontrol`` are stand-ins: srun prints MASTER_ADDR and its
    arguments; scontrol writes one host at a time, as a long node list comes (``| head -n 1`` then ended the
    script with SIGPIPE under pipefail)."""
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\necho "$MASTER_ADDR"\nprintf "%s\\n" "$@"\n')
    (tmp_path / "scontrol").write_text("#!/usr/bin/env bash\necho gpu-node-01\nsleep 0.2\necho gpu-node-02\n")
    for tool in ("srun", "scontrol"):
        (tmp_path / tool).chmod(0o755)
    sbatch = (REPO / "deploy" / "slurm.sbatch").read_text()
    cpus = re.search(r"^#SBATCH --cpus-per-task=(\d+)$", sbatch, re.MULTILINE).group(1)
    env = {
        **CLEAN,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-node-[01-02]",
        "SLURM_CPUS_PER_TASK": cpus,
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_ID": "4242",
    }

    def sbatch(*args: str) -> list[str]:
        out = subprocess.run(
            ["bash", str(REPO / "deploy" / "slurm.sbatch"), *args], env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0, out.stderr
        master, *srun_args = out.stdout.splitlines()
        assert master == "gpu-node-01"
        assert f"--cpus-per-task={cpus}" in srun_args
        return srun_args[srun_args.index("bash") :]

    # every allocation of the job continues one run: its own name and --resume auto, unless the command says
    assert sbatch("--config", "configs/my.yaml") == [
        "bash",
        str(LAUNCH),
        "--config",
        "configs/my.yaml",
        "logging.run_name=slurm-4242",
        "--resume",
        "auto",
    ]
    mine = ["--config", "configs/my.yaml", "logging.run_name=mine", "train.resume=outputs/x/checkpoints/step-1"]
    assert sbatch(*mine) == ["bash", str(LAUNCH), *mine]


def test_slurms_stop_signal_reaches_the_ranks_but_not_torchrun(tmp_path):
    """slurm.sbatch asks SLURM for SIGUSR1 before the time limit (and passes it to the job's processes:
    tests/integration/test_slurm.py); the launch script starts torchrun with SIGUSR1 ignored (torchrun has no handler
    for it and would die of it; the ranks install their own). ``torchrun`` is a
    stand-in that prints its ignored-signals mask."""
    sbatch = (REPO / "deploy" / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR1@\d+$", sbatch, re.MULTILINE)  # the script passes it on
    assert re.search(r"^#SBATCH --requeue$", sbatch, re.MULTILINE)
    (tmp_path / "torchrun").write_text("#!/usr/bin/env bash\ngrep '^SigIgn:' /proc/self/status\n")
    (tmp_path / "torchrun").chmod(0o755)
    env = {**CLEAN, "PATH": f"{tmp_path}:{os.environ['PATH']}", "NPROC_PER_NODE": "1"}
    out = subprocess.run(["bash", str(LAUNCH)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    ignored = int(out.stdout.split()[1], 16)
    assert ignored & (1 << (signal.SIGUSR1 - 1)) and not ignored & (1 << (signal.SIGTERM - 1))


def test_a_rank_that_does_not_see_the_run_directory_fails_before_training(tmp_path):
    """A node-local logging.output_dir on several machines: the other machines' ranks do not see the directory
    rank 0 made, and would fail at the first checkpoint (rank 0 renames what every rank wrote there)."""
    from trainer.build import require_shared_run_dir

    require_shared_run_dir(tmp_path, 1)
    with pytest.raises(ValueError, match=r"rank 3 does not see the run directory .*/missing.*logging\.output_dir"):
        require_shared_run_dir(tmp_path / "missing", 3)
