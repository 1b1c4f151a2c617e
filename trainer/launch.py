"""What a run does around its loop, for the person at the terminal: the reward servers checked before anything
is built, the newest unfinished run found for ``--resume auto``, one process at a time in a run directory, no
run directory left behind by a run that never started training, and what Ctrl-C prints (where the run stopped,
the command that continues it).
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import shlex
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from trainer.checkpoint import Checkpoints, Progress
from trainer.config import Config, reward_token
from trainer.rewards.launcher import RewardPoolError
from trainer.rewards.preflight import PreflightError, Requests, check_reward_urls


def reward_problem(config: Config, own_urls: Sequence[str] | None = None) -> str | None:
    """Why this rank cannot get the run's rewards, or None: a reward server it cannot reach, one that lacks a
    weighted or alarm scorer, or whose limits refuse the run's requests. ``own_urls``: the job's own replicas,
    once they are up (their limits; before, only the scorer names)."""
    named_by = {
        **{name: "eval.alarm_scorers" for name in config.eval.alarm_scorers},
        **{name: "reward.weights" for name in config.reward.weights},
    }
    requests = Requests(
        config.reward.batch_size,
        getattr(config.model, "resolution", 0),
        config.reward.wire_format,
        own=own_urls is not None,
        frames=getattr(config.model, "frames", None) or 1,  # a video model's frames per clip
    )
    urls = config.reward.urls if own_urls is None else own_urls
    return check_reward_urls(urls, dict(sorted(named_by.items())), reward_token(config.reward), requests)


def check_rewards(config: Config, backend, own_urls: Sequence[str] | None = None) -> None:
    """Refuse the run now, on every rank alike, when a rank has a ``reward_problem`` (each rank checks: machines
    may see different servers)."""
    problem = reward_problem(config, own_urls)
    found = [(rank, p) for rank, p in enumerate(backend.all_gather_object(problem)) if p]
    if found:
        rank, problem = found[0]
        raise PreflightError(problem if rank == 0 else f"on rank {rank}: {problem}")


def finished(run: Path) -> bool:
    """Whether run directory ``run`` holds a run that ended (its ``final/`` weights): never one to continue."""
    return (run / "final").exists()


def newest_resumable(output_dir: Path) -> Path | None:
    """The run directory in ``output_dir`` whose newest complete checkpoint was written last, among the runs
    that did not finish (``finished``)."""
    found = []
    for run in sorted(output_dir.iterdir()) if output_dir.is_dir() else ():
        if run.is_dir() and not finished(run):
            latest = Checkpoints(run / "checkpoints", 0, False).latest()
            if latest is not None:
                found.append((latest.stat().st_mtime, run))
    return max(found)[1] if found else None


def fresh_start(output_dir: Path, run_name: str) -> str:
    """What ``--resume auto`` prints where run ``run_name`` has no checkpoint yet: it starts the run (as a SLURM
    job's first allocation wants), naming the unfinished runs with checkpoints that the name may be a slip for."""
    runs = sorted(
        run.name for run in output_dir.iterdir() if run.name != run_name and run.is_dir() and not finished(run)
    )
    close = [
        name
        for name in difflib.get_close_matches(run_name, runs, n=10, cutoff=0.6)  # then their checkpoints
        if Checkpoints(output_dir / name / "checkpoints", 0, False).latest() is not None
    ][:3]
    return f"train.resume=auto: run {run_name} has no complete checkpoint in {output_dir}; starting it fresh" + (
        f" (unfinished runs of a close name with checkpoints: {', '.join(close)}; to continue one, stop this "
        "and pass its logging.run_name)"
        if close
        else ""
    )


def other_run(config: Config, checkpoint: Path) -> str | None:
    """Why ``config`` cannot continue ``checkpoint``: it names another model or algorithm (their weights and
    optimizer states differ: the resume would fail once the model has loaded), or None."""
    saved = json.loads((checkpoint / "config.json").read_text())
    for section, now in ("model", config.model.name), ("algorithm", config.algorithm.name):
        then = saved.get(section, {}).get("name")
        if then is not None and then != now:
            return (
                f"train.resume: {checkpoint} was written by a run of {section}.name={then}, and this one has "
                f"{section}.name={now}: resume with {section}.name={then}, or start a new run from its weights "
                f"with train.init_from={checkpoint}"
            )
    return None


def resumed_run_config(config: Config) -> Path | None:
    """The ``config.yaml`` of the run that ``train.resume`` continues (the run ``logging.run_name`` names, the
    newest unfinished one for ``auto``, or the one holding the named checkpoint), or None where there is none:
    a resume given no config file takes that run's settings, not the defaults."""
    resume, name, output = config.train.resume, config.logging.run_name, Path(config.logging.output_dir)
    if not resume:
        return None
    if resume != "auto":
        run = Path(resume).parent.parent  # <run>/checkpoints/step-*
    else:
        run = output / name if name else newest_resumable(output)
    saved = run / "config.yaml" if run is not None else None
    return saved if saved is not None and saved.is_file() else None


def hold_run_dir(run_dir: Path) -> tuple[IO[str] | None, str | None]:
    """(``run_dir/.lock``, open and locked until it is closed or the process ends, or None; why not: another
    process holds it). Two processes in one run (a resume while the run goes on) would interleave their
    checkpoints, and the resume's truncation of metrics.jsonl would drop the other's rows."""
    lock = (run_dir / ".lock").open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        return None, (
            f"{run_dir} is in use by {holder}: wait for that run to end, or stop it (a stop signal "
            "checkpoints it) and continue with --resume auto"
        )
    lock.truncate(0)
    with contextlib.suppress(OSError):  # who holds it, for a refusal (unbuffered: a full disk leaves nothing to flush)
        os.write(lock.fileno(), f"process {os.getpid()} on {socket.gethostname()}\n".encode())
    return lock, None


class UnstartedRunCleanup:
    """Removes the directory this run made (its run directory, or ``logging.output_dir`` when it made that
    too) when the run fails before training starts (a bad path, a model that does not load, Ctrl-C while
    loading): it holds nothing but the config then. Kept when a local reward replica failed: the error names
    its log there."""

    def __init__(self, made: Path | None):
        self.run_dir = made
        self.started = False

    def __enter__(self) -> UnstartedRunCleanup:
        return self

    def __exit__(self, kind, exc, traceback) -> None:
        if kind is not None and not self.started and self.run_dir is not None and not isinstance(exc, RewardPoolError):
            shutil.rmtree(self.run_dir, ignore_errors=True)


def stopped_at(progress: Progress, config: Config, latest: Path | None) -> str:
    """Where an interrupted run stood, and the checkpoint a continuation starts from."""
    train = config.train
    if progress.warmup_steps_done < train.warmup_steps:
        where = f"in the warm-up, {progress.warmup_steps_done} of {train.warmup_steps} steps done"
    elif not progress.rl_started:
        where = "in the evaluation before RL (warm-up done)"
    elif progress.epochs_done < train.epochs:
        where = f"in RL epoch {progress.epochs_done + 1} of {train.epochs}"
    else:
        where = "in the final evaluation, every epoch done"
    if latest is None:
        return f"stopped {where}; no checkpoint was written yet, so continuing starts the run over"
    saved = Progress.load(latest)
    return (
        f"stopped {where}; continuing starts from the newest checkpoint, {latest} (warm-up steps "
        f"{saved.warmup_steps_done}, RL epochs {saved.epochs_done})"
    )


def finishing(progress: Progress, config: Config, display) -> str:
    """What a run asked to stop (a first Ctrl-C) finishes first, as its trainer's ``display`` (trainer/display.py)
    stands: the evaluation it is in, else the warm-up step or RL epoch its loop is in ("RL epoch 3 of 100": the loop
    stops at that unit's end), then a checkpoint; or the final evaluation, then the end."""
    under_way = display.under_way()
    if progress.rl_started and progress.epochs_done >= config.train.epochs and (display.in_evaluation or not under_way):
        return "finishing the final evaluation, which ends the run"
    if display.in_evaluation and progress.rl_started:
        doing = f"the evaluation after RL epoch {progress.epochs_done}"
    elif display.in_evaluation or under_way is None:  # between the warm-up and RL: it stops as RL would start
        doing = "the evaluation before RL"
    else:
        doing = under_way
    return f"finishing {doing} and saving a checkpoint"


def signalled_at(progress: Progress, config: Config, latest: Path) -> str:
    """Where a run stopped by a signal (trainer/stopping.py) stood: after a warm-up step or an RL epoch, whose
    checkpoint ``latest`` is."""
    train = config.train
    if not progress.rl_started:
        where = f"warm-up step {progress.warmup_steps_done} of {train.warmup_steps}"
    elif progress.epochs_done == 0:
        where = "the evaluation before RL"
    else:
        where = f"RL epoch {progress.epochs_done} of {train.epochs}" + (
            " (its evaluation runs first when the run continues)" if progress.eval_due else ""
        )
    return f"stopped after {where}; its checkpoint: {latest}"


def resume_command(configs: Sequence[str], overrides: Sequence[str], run_name: str) -> str:
    """The command line that continues run ``run_name``: this one's config files and overrides with
    ``--resume auto logging.run_name=...`` (under torchrun: as many processes per machine)."""
    kept = [o for o in overrides if o.partition("=")[0].strip() not in ("train.resume", "logging.run_name")]
    args = [
        *(part for path in configs for part in ("--config", path)),
        "--resume",
        "auto",
        *kept,
        f"logging.run_name={run_name}",
    ]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return shlex.join(["python", "trainer/main.py", *args])
    per_machine = os.environ.get("LOCAL_WORLD_SIZE", str(world))
    command = shlex.join(["torchrun", f"--nproc_per_node={per_machine}", "trainer/main.py", *args])
    return command + ("  (on every machine, with its torchrun rendezvous options)" if per_machine != str(world) else "")
