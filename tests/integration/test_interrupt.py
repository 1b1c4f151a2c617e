"""Ctrl-C on a real run: it says where the run stopped and prints the command that continues it, and that
command, run as printed, continues the run from its newest checkpoint to the end."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two short runs as subprocesses (~30 s); resume_command and stopped_at have unit tests
def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path, tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args = [f"model.path={tiny_model_dir}", f"logging.output_dir={tmp_path}", "logging.progress=false",
            "logging.tensorboard=false", "train.warmup_steps=400", "train.warmup_checkpoint_every=2",
            "warmup.batch_size=4", "train.epochs=1", "data.prompts_per_epoch=2", "algorithm.group_size=2",
            "eval.samples_per_prompt=1", "eval.num_steps=2", "reward.replicas=1", "reward.weights={brightness: 1}"]
    run = subprocess.Popen([sys.executable, "trainer/main.py", *args], cwd=REPO, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("*/checkpoints/step-*/progress.json")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)  # what the terminal sends to the job and its reward servers
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "interrupted: stopped in the warm-up, " in out and "of 400 steps done; continuing starts from the newest " \
        f"checkpoint, {run_dir}/checkpoints/step-" in out
    command = out.split("continue with: ", 1)[1].splitlines()[0]
    assert command == shlex.join(["python", "trainer/main.py", "--resume", "auto", *args,
                                  f"logging.run_name={run_dir.name}"])

    resumed = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, env=env, text=True,
                             capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step-" in resumed.stdout
    assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file()
