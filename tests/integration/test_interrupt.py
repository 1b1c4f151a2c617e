"""Ctrl-C on a real run: it says where the run stopped and prints the command that continues it, and that
command, run as printed, continues the run from its newest checkpoint to the end."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _interrupt(run: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """Ctrl-C the job and collect its output; a job still running ``timeout`` s later fails the test with every
    thread's stack (SIGABRT: PYTHONFAULTHANDLER prints them)."""
    os.killpg(run.pid, signal.SIGINT)  # what the terminal sends to the job
    try:
        return run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGABRT)
        out, err = run.communicate(timeout=60)
        pytest.fail(f"still running {timeout:.0f} s after Ctrl-C; stdout:\n{out[-2000:]}\nstderr:\n{err[-8000:]}")


@pytest.mark.slow  # two short runs as subprocesses (~30 s); resume_command and stopped_at have unit tests
def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path, tiny_model_dir):
    """A warm-up too long to finish first, whatever the machine's load: Ctrl-C lands in it. The printed command,
    run as printed with a shorter warm-up appended (so that the test ends), continues from the checkpoint."""
    args = [f"model.path={tiny_model_dir}", f"logging.output_dir={tmp_path}", "logging.progress=false",
            "logging.tensorboard=false", "train.warmup_steps=100000", "train.warmup_checkpoint_every=2",
            "warmup.batch_size=4", "train.epochs=1", "data.prompts_per_epoch=2", "algorithm.group_size=2",
            "eval.samples_per_prompt=1", "eval.num_steps=2", "reward.replicas=1", "reward.weights={brightness: 1}"]
    run = subprocess.Popen([sys.executable, "trainer/main.py", *args], cwd=REPO, env=ENV, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("*/checkpoints/step-*/progress.json")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    out, err = _interrupt(run)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert "interrupted: stopped in the warm-up, " in out and "of 100000 steps done; continuing starts from the " \
        f"newest checkpoint, {run_dir}/checkpoints/step-" in out
    command = out.split("continue with: ", 1)[1].splitlines()[0]
    assert command == shlex.join(["python", "trainer/main.py", "--resume", "auto", *args,
                                  f"logging.run_name={run_dir.name}"])

    saved = int(re.search(r"\(warm-up steps (\d+), RL epochs 0\)", out)[1])
    resumed = subprocess.run([sys.executable, *shlex.split(command)[1:], f"train.warmup_steps={saved + 2}"],
                             cwd=REPO, env=ENV, text=True, capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step-" in resumed.stdout
    assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.slow  # one short run as a subprocess (~20 s)
def test_ctrl_c_in_rl_leaves_the_reward_replicas_to_the_trainer(tmp_path, tiny_model_dir):
    """Ctrl-C while RL epochs sample and wait on rewards: the replicas (a session of their own) are not
    interrupted under the rollout that waits on them, so the run stops as in the warm-up, saying where, with
    no reward error or traceback."""
    args = [f"model.path={tiny_model_dir}", f"logging.output_dir={tmp_path}", "logging.progress=false",
            "logging.tensorboard=false", "train.warmup_steps=2", "train.epochs=500", "train.checkpoint_every=1",
            "data.prompts_per_epoch=2", "algorithm.group_size=2", "eval.every=0", "eval.samples_per_prompt=1",
            "eval.num_steps=2", "reward.replicas=1", "reward.weights={brightness: 1}"]
    run = subprocess.Popen([sys.executable, "trainer/main.py", *args], cwd=REPO, env=ENV, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any('"phase": "rl"' in p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    out, err = _interrupt(run)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "RewardUnavailable" not in out + err, err[-3000:]
    assert "interrupted: stopped in RL epoch " in out, out[-2000:]
