"""Ctrl-C on a real run: it says where the run stopped and prints the command that continues it, and that
command, run as printed, continues the run from its newest checkpoint to the end. Stop signals from a scheduler
or a killed torchrun, during training and before it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_series import kill_tree
from servers import free_port, replicas_of

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def _interrupt(run: subprocess.Popen, timeout: float = 120, again_after: float | None = None) -> tuple[str, str]:
    """Ctrl-C the job (``again_after`` s later once more: an impatient user) and collect its output; a job still
    running ``timeout`` s later fails the test with every thread's stack (SIGABRT: PYTHONFAULTHANDLER prints them)."""
    os.killpg(run.pid, signal.SIGINT)  # what the terminal sends to the job
    if again_after is not None:
        time.sleep(again_after)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGINT)
    try:
        return run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        masks = f"job: {_signal_masks(run.pid)}; test: {_signal_masks(os.getpid())}"  # SIGINT is bit 2
        os.killpg(run.pid, signal.SIGABRT)
        out, err = run.communicate(timeout=60)
        pytest.fail(
            f"still running {timeout:.0f} s after Ctrl-C ({masks}); stdout:\n{out[-2000:]}\nstderr:\n{err[-8000:]}"
        )


def _as_a_shell_starts_it() -> None:
    """In the job's process before it runs: SIGINT as a shell leaves it to a job it starts. In the whole slow tier both
    Ctrl-C tests failed twice (2026-11-29), their jobs training on 120 s past Ctrl-C, while alone they pass: the
    likeliest cause is a SIGINT that an earlier test left ignored or blocked in the pytest worker, which a child
    inherits (not found; a failure prints both processes' masks)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int) -> str:
    """The job's signal masks from /proc (hexadecimal; bit n-1 is signal n), or why they cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        return f"no /proc/{pid}/status: {exc}"
    return ", ".join(
        line.replace("\t", " ") for line in lines if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
    )


@pytest.mark.parametrize(
    ("tool", "said", "after"),
    [
        (
            ["trainer/main.py", "logging.output_dir={out}"],
            "interrupted before training started: nothing to continue",
            1.0,
        ),
        (
            [
                "-m",
                "trainer.precompute",
                "--config",
                "configs/embedded_digits.yaml",
                "--out",
                "{out}/store",
                "logging.output_dir={out}",
            ],
            "interrupted: what is in the store's index is kept, and the same command goes on from it",
            1.0,
        ),
    ],
)
def test_ctrl_c_while_a_tool_loads_is_one_line_not_a_traceback(tmp_path, tool, said, after):
    """Ctrl-C ``after`` s, while the tool imports its modules and reads its config (seconds: diffusers): it was a
    KeyboardInterrupt traceback from the imports (every tool), from the config's model registry, or an error that
    library code made of it (test_ctrl_c.py)."""
    args = [part.format(out=tmp_path) for part in tool]
    run = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    time.sleep(after)
    out, err = _interrupt(run)
    assert run.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert said in out + err


CTRL_C_AT_IMPORT = """
import os, runpy, signal, sys

LIBRARY = sys.argv[1]

class CtrlCAtImport:  # a Ctrl-C just as the tool starts to import LIBRARY
    def find_spec(self, name, path=None, target=None):
        if name == LIBRARY:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCAtImport())
sys.argv = sys.argv[2:]
if sys.argv[0].startswith("script:"):  # a console script, run as its generated file runs it
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name=sys.argv[0].removeprefix("script:"))
    sys.exit(script.load()())
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    ("module", "args", "imports", "said"),
    [
        (
            "trainer.generate",
            ["--weights", "{out}/final", "--out", "{out}/grid.png"],
            "torch",
            "interrupted: no image written",
        ),
        (
            "trainer.export",
            ["--checkpoint", "{out}/step", "--out", "{out}/exported"],
            "torch",
            "interrupted: nothing exported (an earlier export at --out is as it was)",
        ),
        (
            "reward_server",
            ["--scorers", "brightness", "--port", "0"],
            "uvicorn",
            "interrupted: the server did not start",
        ),
        (
            "script:rewardflow-reward-server",
            ["--scorers", "brightness", "--port", "0"],
            "uvicorn",
            "interrupted: the server did not start",
        ),
    ],
)
def test_ctrl_c_while_a_module_imports_its_libraries_is_one_line(tmp_path, module, args, imports, said):
    """``python -m`` runs a tool's file as __main__: a Ctrl-C in its module-level imports (torch, uvicorn) came before
    any handler of ours, a traceback (the trainer's own reward replicas run the console script). Here the Ctrl-C
    comes as that import starts, not after a time: those tools
    load in well under a second, and a timed Ctrl-C (0.3 s) came after export had ended once in three CI runs."""
    run = subprocess.run(
        [sys.executable, "-c", CTRL_C_AT_IMPORT, imports, module, *(part.format(out=tmp_path) for part in args)],
        cwd=REPO,
        env=ENV,
        text=True,
        capture_output=True,
        timeout=120,
        preexec_fn=_as_a_shell_starts_it,
    )
    assert (run.returncode, run.stderr) == (130, f"\n{said}\n"), run.stderr[-3000:]


@pytest.mark.slow  # two short runs as subprocesses (~30 s); resume_command and signalled_at have unit tests
def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path, tiny_model_dir):
    """A warm-up too long to finish first, whatever the machine's load: Ctrl-C lands in it, and the run ends that
    warm-up step with a checkpoint of it (it stopped where it was, continuing from the last periodic checkpoint,
    until a first Ctrl-C became a stop request). The printed command, run as printed with a shorter warm-up appended
    (so that the test ends), continues from the checkpoint."""
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=100000",
        "train.warmup_checkpoint_every=2",
        "warmup.batch_size=4",
        "train.epochs=1",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=2",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
    ]
    run = subprocess.Popen(
        [sys.executable, "trainer/main.py", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("*/checkpoints/step-*/progress.json")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    out, err = _interrupt(run)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    said = re.search(
        r"\nCtrl-C: finishing warm-up step (\d+) of 100000 and saving a checkpoint; Ctrl-C again to stop "
        r"now\n",
        err,
    )
    assert said, err[-3000:]
    saved = int(said[1])
    assert (
        f"interrupted: stopped after warm-up step {saved} of 100000; its checkpoint: "
        f"{run_dir}/checkpoints/step-{saved:06d}-000000\n"
    ) in out, out[-3000:]
    command = out.split("continue with: ", 1)[1].splitlines()[0]
    assert command == shlex.join(
        ["python", "trainer/main.py", "--resume", "auto", *args, f"logging.run_name={run_dir.name}"]
    )

    resumed = subprocess.run(
        [sys.executable, *shlex.split(command)[1:], f"train.warmup_steps={saved + 2}"],
        cwd=REPO,
        env=ENV,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir}/checkpoints/step-" in resumed.stdout
    assert (run_dir / "final" / "diffusion_pytorch_model.safetensors").is_file()


@pytest.mark.slow  # one short run as a subprocess (~20 s)
def test_ctrl_c_in_rl_leaves_the_reward_replicas_to_the_trainer(tmp_path, tiny_model_dir):
    """Ctrl-C twice while RL epochs sample and wait on rewards (an impatient user): the replicas (a session of their
    own) are not interrupted under the rollout that waits on them, and the second Ctrl-C, in the same epoch (of 64
    images: seconds), stops the run at once, saying where, with no reward error or traceback."""
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=2",
        "train.epochs=500",
        "train.checkpoint_every=1",
        "data.prompts_per_epoch=16",
        "algorithm.group_size=4",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
    ]
    run = subprocess.Popen(
        [sys.executable, "trainer/main.py", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    deadline = time.monotonic() + 300
    while not any('"phase": "rl"' in p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    out, err = _interrupt(run, again_after=0.3)
    assert run.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "RewardUnavailable" not in out + err, err[-3000:]
    # the second Ctrl-C, as the first one's stop unwinds, said "before training started: nothing to continue"
    assert "interrupted: stopped in RL epoch " in out and "continue with: " in out, out[-2000:]
    assert "before training started" not in out + err, out[-2000:]
    assert re.search(
        r"\nCtrl-C: finishing RL epoch \d+ of 500 and saving a checkpoint; Ctrl-C again to stop now\n", err
    ), err[-3000:]


@pytest.mark.slow  # one short run as a subprocess (~20 s)
def test_a_first_ctrl_c_in_rl_finishes_the_epoch_and_writes_a_checkpoint(tmp_path, tiny_model_dir):
    """Ctrl-C in RL epoch 2 of a run at the default train.checkpoint_every=5 lost all RL so far ("continuing starts
    the run over"), while SIGTERM finished the epoch and wrote a checkpoint. Now the first Ctrl-C says at once what
    the run finishes, and it finishes that epoch, writes its checkpoint and prints the command that continues it."""
    args = [
        f"model.path={tiny_model_dir}",
        f"logging.output_dir={tmp_path}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=2",
        "train.epochs=500",
        "data.prompts_per_epoch=4",
        "algorithm.group_size=2",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
    ]
    run = subprocess.Popen(
        [sys.executable, "trainer/main.py", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_it,
    )
    deadline = time.monotonic() + 300
    while not any('"phase": "rl"' in p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    out, err = _interrupt(run)
    assert run.returncode == 130 and "Traceback" not in err, err[-3000:]
    said = re.search(
        r"\nCtrl-C: finishing RL epoch (\d+) of 500 and saving a checkpoint; Ctrl-C again to stop now\n", err
    )
    assert said, err[-3000:]
    epochs = int(said[1])  # 2 or later (1 where the Ctrl-C came as the first epoch's line was printed)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert checkpoint.name == f"step-000002-{epochs:06d}"
    assert (
        f"interrupted: stopped after RL epoch {epochs} of 500; its checkpoint: {checkpoint}\ncontinue with: "
        f"python trainer/main.py --resume auto " in out
    ), out[-3000:]
    rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert len(rl) == epochs and all(r["failed_share"] == 0 for r in rl)


def _processes(match) -> list[int]:
    """Pids of live processes whose (argument list, environment) ``match`` accepts."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and match(args, env):
            found.append(int(proc.name))
    return found


def _job(model_dir: str, out_dir: Path) -> list[str]:
    """A long job on the tiny model (one or two ranks) that the tests stop early: in set-up or after its first RL
    epochs."""
    return [
        f"model.path={model_dir}",
        f"logging.output_dir={out_dir}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "train.warmup_steps=2",
        "train.epochs=500",
        "train.checkpoint_every=0",
        "data.prompts_per_epoch=4",
        "algorithm.group_size=2",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=2",
        "reward.replicas=1",
        "reward.weights={brightness: 1}",
    ]


@pytest.mark.slow  # one torchrun job of two ranks (~25 s)
def test_slurms_stop_signal_to_one_rank_and_the_replicas_stops_every_rank_after_the_epoch_with_a_checkpoint(
    tmp_path, tiny_model_dir
):
    """SLURM's SIGUSR1 before the time limit (deploy/slurm.sbatch), here reaching torchrun, rank 1 and the reward
    replicas but not rank 0, under deploy/launch_multinode.sh: torchrun lives on; the ranks agree, end the same RL
    epoch (its rewards still come: the replicas wait for the trainer to stop them), write one checkpoint and exit
    138 (torchrun's SIGTERM to rank 0 once rank 1 has exited does not cut that short); rank 0 says where the run
    stopped and how to continue it."""
    args = _job(tiny_model_dir, tmp_path)
    env = {
        **ENV,
        "NPROC_PER_NODE": "2",
        "MASTER_PORT": str(free_port()),
        "RDZV_ID": f"stop-{os.getpid()}",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    run = subprocess.Popen(
        ["bash", "deploy/launch_multinode.sh", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not any('"phase": "rl"' in p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    mine = f"logging.output_dir={tmp_path}".encode()
    rank = lambda r: _processes(lambda args, env: mine in args and f"RANK={r}".encode() in env)  # noqa: E731
    (rank0,), (rank1,) = rank(0), rank(1)
    replicas = replicas_of(rank0)
    assert replicas
    for pid in (run.pid, rank1, *replicas):  # run.pid: torchrun (the script execs it)
        os.kill(pid, signal.SIGUSR1)
    try:
        out, err = run.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(run.pid, signal.SIGABRT)  # the ranks too: each prints its threads' stacks
        out, err = run.communicate(timeout=60)
        pytest.fail(f"still running 120 s after SIGUSR1; stdout:\n{out[-2000:]}\nstderr:\n{err[-8000:]}")
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    match = re.search(r"SIGUSR1 received: stopped after RL epoch (\d+) of 500; its checkpoint: (\S+)\n", out)
    assert match, out[-3000:] + err[-3000:]
    epochs = int(match[1])
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert match[2] == f"{checkpoint}" and checkpoint.name == f"step-000002-{epochs:06d}"
    assert json.loads((checkpoint / "progress.json").read_text())["epochs_done"] == epochs
    rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert len(rl) == epochs and all(r["failed_share"] == 0 for r in rl)  # every reward of the last epoch came
    assert "continue with: torchrun --nproc_per_node=2 trainer/main.py --resume auto" in out
    assert err.count("exitcode  : 138") == 2, err[-3000:]  # torchrun's report: both ranks stopped so (128 + 10)
    assert not replicas_of(rank0)


@pytest.mark.slow  # one torchrun job of two ranks (~25 s)
def test_ranks_whose_torchrun_was_killed_stop_after_the_epoch_with_a_checkpoint(tmp_path, tiny_model_dir):
    """kill -9 of torchrun alone (each rank has a session of its own, so they live on): instead of training on
    unsupervised, beside any run started again on their directory, the ranks end their RL epoch, write a checkpoint
    and exit 129, rank 0 saying why."""
    args = _job(tiny_model_dir, tmp_path)
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "trainer/main.py", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not any('"phase": "rl"' in p.read_text() for p in tmp_path.glob("*/metrics.jsonl")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    mine = f"logging.output_dir={tmp_path}".encode()
    ranks = _processes(lambda args, env: mine in args and b"TORCHELASTIC_RUN_ID" in b" ".join(env))
    assert len(ranks) == 2
    os.kill(run.pid, signal.SIGKILL)
    try:
        out, err = run.communicate(timeout=120)  # the ranks hold torchrun's pipes until they exit
    except subprocess.TimeoutExpired:
        for pid in ranks:
            os.kill(pid, signal.SIGABRT)
        out, err = run.communicate(timeout=60)
        pytest.fail(
            f"ranks still running 120 s after torchrun was killed; stdout:\n{out[-2000:]}\nstderr:\n{err[-8000:]}"
        )
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    match = re.search(
        r"torchrun, which started the ranks, is gone: stopped after RL epoch (\d+) of 500; its "
        r"checkpoint: (\S+)\n",
        out,
    )
    assert match, out[-3000:] + err[-3000:]
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert match[2] == f"{checkpoint}" and checkpoint.name == f"step-000002-{int(match[1]):06d}"
    deadline = time.monotonic() + 30  # exiting after their pipes closed, then reaped by init
    while [pid for pid in ranks if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)]


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie that init has not reaped yet has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # one run stopped as it starts (~15 s)
def test_a_stop_signal_before_training_stops_the_replicas_and_removes_the_new_run_directory(tmp_path, tiny_model_dir):
    """SIGTERM while the run is still being set up (its reward replicas just started, the model loading): the
    replicas are stopped, the run directory it made is removed, and it says so in one line with no traceback,
    exiting 143 (before, the signal ended it at once, saying nothing, leaving the directory behind and the
    replicas orphaned)."""
    args = [*_job(tiny_model_dir, tmp_path), "logging.run_name=preempted"]
    run = subprocess.Popen(
        [sys.executable, "trainer/main.py", *args],
        cwd=REPO,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (replicas := replicas_of(run.pid)):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.02)
    assert not (tmp_path / "preempted" / "metrics.jsonl").exists()  # set-up, not training
    os.kill(run.pid, signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert out.endswith("\nSIGTERM received before training started: nothing to continue\n"), out[-2000:]
    assert not [pid for pid in replicas if _alive(pid)]  # stopped and reaped by the trainer, not orphaned
    assert not (tmp_path / "preempted").exists()
