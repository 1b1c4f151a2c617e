"""Run control, the one layer around the training loop: a ``Run`` holds the backend, the run folder and its lock, the
trackers, the job's own reward replicas, the stop signals, resume and export. Whatever ends it early leaves it as a
``RunEnded`` (trainer/ending.py), which says where the run stopped and how it continues."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

from shared.interrupt import as_interrupt, stop_if_interrupted
from trainer.build import build_trainer, check_tasks, load_model, start_backend
from trainer.checkpoint import Checkpoints, Progress, damaged
from trainer.config import Config, reward_token, saved_dict
from trainer.disk import NO_ROOM, tree_mib
from trainer.ending import RunStopped, ended
from trainer.export import export_denoiser
from trainer.health import RewardFailure
from trainer.launch import (
    UnstartedRunCleanup,
    check_rewards,
    finished,
    fresh_start,
    hold_run_dir,
    newest_resumable,
    other_run,
    resume_command,
    signalled_at,
    stopped_at,
)
from trainer.logging import RunLogger
from trainer.memory import memory_advice, out_of_memory
from trainer.preflight import preflight
from trainer.rewards.launcher import LocalRewardPool, RewardPoolError
from trainer.stopping import StopsBeforeTraining, StopSignalled, ignore_stop_signals
from trainer.trainer import Trainer


class Run:
    """One job of ``config``, from its backend to its exported weights; ``configs`` and ``overrides`` (its command
    line) make the command that continues it."""

    def __init__(self, config: Config, configs: Sequence[str] = (), overrides: Sequence[str] = ()):
        self.config, self.configs, self.overrides = config, list(configs), list(overrides)
        self.pool: LocalRewardPool | None = None

    def fit(self) -> dict[str, float]:
        """Set the run up, train, export; returns the final evaluation's metrics. Ends early as a RunEnded."""
        try:
            with contextlib.ExitStack() as self.stack:
                return self._fit()
        except BaseException as exc:
            end = ended(exc, self.config)
            if end is None or end is exc:
                raise
            raise end from exc

    def _fit(self) -> dict[str, float]:
        config = self.config
        self.backend = start_backend(config)
        self.is_main = self.backend.world.rank == 0
        self.stack.callback(self.backend.close)
        self.setup = self.stack.enter_context(StopsBeforeTraining())  # a SIGTERM now: what started stops, none kept
        task, eval_task = preflight(config, self.backend)  # before anything is built: every piece the run needs
        self._hold_run_dir()
        check_tasks(config, task, eval_task, self.is_main)
        self._start_trackers()
        self._launch_replicas()  # they load their scorers while the model loads here
        adapter = load_model(config, self.backend, task, self.run_dir)
        urls = self._reward_urls()
        trainer = build_trainer(config, adapter, task, eval_task, urls, self.backend, self.stack, self._logger)
        self._resume(trainer)
        if self.is_main:
            print(f"run directory: {self.run_dir}  (reward replicas: {', '.join(urls)})", flush=True)
        return self._train(trainer)

    def _hold_run_dir(self) -> None:
        """Rank 0 chooses the run folder (never another run's), makes it and locks it for the whole run; every rank
        learns its name, or why there is none. A folder the run made goes when it fails before training."""
        output = Path(self.config.logging.output_dir)
        run_name, refusal, made = self._make_run_dir(output) if self.is_main else (None, None, None)
        run_name, refusal = self.backend.broadcast((run_name, refusal))
        if refusal:
            raise ValueError(refusal)
        self.run_dir = output / run_name
        self.made = self.stack.enter_context(UnstartedRunCleanup(made))
        if self.is_main:
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(saved_dict(self.config), sort_keys=False))

    def _make_run_dir(self, output: Path) -> tuple[str, str | None, Path | None]:
        """(the run's name, why it cannot run there or None, the folder it made or None), on rank 0."""
        config = self.config
        run_name, refusal = choose_run_dir(config, output)
        if refusal is None and config.train.resume:  # another model or algorithm: before any loads
            resume = config.train.resume
            continued = (
                Path(resume) if resume != "auto" else Checkpoints(output / run_name / "checkpoints", 0, False).latest()
            )
            if continued is not None and damaged(continued, only=("config.json",)) is None:
                refusal = other_run(config, continued)
        if refusal is not None:
            return run_name, refusal, None
        run_dir = output / run_name
        made = next((d for d in (output, run_dir) if not d.exists()), None)  # removed on failure
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return (
                run_name,
                (
                    f"logging.output_dir={str(output)!r}: cannot make {run_dir} there ({exc.strerror}): "
                    "choose a folder this user can write"
                ),
                made,
            )
        lock, refusal = hold_run_dir(run_dir)  # for the whole run: one process trains in it
        if lock is not None:
            self.stack.callback(lock.close)
        return run_name, refusal, made

    def _start_trackers(self) -> None:
        """Rank 0's trackers, started before any model loads (a W&B login that fails says so at once); each ends as
        the run does, failed or not."""
        trackers, refusal = start_trackers(self.config, self.run_dir) if self.is_main else ([], None)
        refusal = self.backend.broadcast(refusal)
        if refusal:
            raise ValueError(refusal)
        self.trackers = [self.stack.enter_context(tracker) for tracker in trackers]

    def _logger(self) -> RunLogger:
        """The run's metrics, images and trackers (rank 0 writes them), closed when the run ends."""
        config = self.config
        logger = RunLogger(
            self.run_dir, enabled=self.is_main, tensorboard=config.logging.tensorboard, trackers=self.trackers
        )
        self.stack.callback(logger.close)
        return logger

    def _launch_replicas(self) -> None:
        """Without ``reward.urls``, each machine's first process starts reward replicas on its loopback for its
        machine's processes."""
        world = self.backend.world
        if not self.config.reward.urls and world.local_rank == 0:
            logs = self.run_dir / "reward_replicas" / (f"node-{world.node}" if world.spans_machines else "")
            self.pool = _launch_local_pool(self.config, logs, self.stack)

    def _reward_urls(self) -> list[str]:
        """``reward.urls``, or this machine's replicas once they are up (supervised: one that dies starts again),
        checked against the run's requests."""
        urls = list(self.config.reward.urls)
        if urls:
            return urls
        mine = None
        if self.pool is not None:
            _wait_for_local_pool(self.pool)
            self.pool.supervise()  # a replica that dies is started again (the client waits: reward.outage_s)
            mine = list(self.pool.urls)
        world = self.backend.world
        urls = {node: served for node, served in self.backend.all_gather_object((world.node, mine)) if served}
        check_rewards(self.config, self.backend, own_urls=urls[world.node])  # their limits against the run's requests
        return urls[world.node]

    def _resume(self, trainer: Trainer) -> None:
        """Continue ``train.resume``'s checkpoint (auto: the newest loadable one), or start from ``train.init_from``."""
        train = self.config.train
        if train.resume:
            auto = train.resume == "auto"
            checkpoint = trainer.checkpoints.newest_loadable(self.backend) if auto else Path(train.resume)
            if checkpoint is not None:
                trainer.resume(checkpoint)
            elif self.is_main:
                print(fresh_start(self.run_dir.parent, self.run_dir.name), flush=True)
        if train.init_from and trainer.progress == Progress():
            trainer.init_from(Path(train.init_from))

    def _train(self, trainer: Trainer) -> dict[str, float]:
        """Train under the stop signals, then export the weights the final evaluation sampled with; a stop, an
        outage, a full disk or out of memory ends it as a RunStopped."""
        for client in (trainer.reward_client, trainer.evaluation.reward_client):
            client.give_up_waiting = lambda: bool(trainer.stops.received)  # a stop does not wait out an outage
        stop_if_interrupted()  # a Ctrl-C that library code swallowed while the run was set up
        self.made.started = True
        self.setup.release()
        ema = trainer.ema if self.config.eval.use_ema else None  # what the final evaluation sampled with
        try:
            with as_interrupt(), trainer.stops:  # SIGTERM, SIGUSR1: checkpoint at the next step, then stop
                metrics = trainer.fit()
            with ema.swapped() if ema is not None else contextlib.nullcontext():
                final = self.backend.main_copy(trainer.adapter.denoiser)  # on rank 0's CPU, a parameter at a time
            if self.is_main:
                export_denoiser(final, self.run_dir / "final")
        except BaseException as exc:
            stopped = self._stopped(exc, trainer)
            if stopped is None:
                raise
            raise stopped from None
        if self.is_main:
            print(f"done: {self.run_dir} ({_kept(trainer, ema is not None)})", flush=True)
        self.backend.barrier()
        return metrics

    def _stopped(self, exc: BaseException, trainer: Trainer) -> RunStopped | None:
        """What ``exc``, leaving training, ends the run as: where it stopped and how it continues (None: not a stop)."""
        if isinstance(exc, StopSignalled):
            ignore_stop_signals()
            return self._stop(str(exc), signalled_at, trainer, 128 + exc.signum)
        if isinstance(exc, KeyboardInterrupt):
            return self._stop("interrupted", stopped_at, trainer, 130)
        if isinstance(exc, RewardFailure):  # its checkpoint is written (Trainer.fit): fix the rewards, then continue
            return self._stop(str(exc), signalled_at, trainer, 1)
        if out_of_memory(exc):  # out of GPU (or CPU) memory: where, and the settings that lower it; then on
            return self._stop(memory_advice(exc, self.config), stopped_at, trainer, 1)
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:  # a full disk, a quota, a read-only remount
            latest = trainer.checkpoints.latest()
            room = f" (a checkpoint of this run takes {tree_mib(latest):.1f} MiB)" if latest is not None else ""
            how = f"cannot write {exc.filename or self.run_dir}: {exc.strerror}; make room{room}, then continue"
            return self._stop(how, stopped_at, trainer, 1)
        return None

    def _stop(self, how: str, where, trainer: Trainer, status: int) -> RunStopped:
        at = where(trainer.progress, self.config, trainer.checkpoints.latest())
        command = resume_command(self.configs, self.overrides, self.run_dir.name)
        return RunStopped(how, at, command, status)


def _kept(trainer: Trainer, ema: bool) -> str:
    """What a finished run leaves: its final weights, and its best ones where an evaluation beat the start."""
    best = (
        f"best/: the best evaluation's, epoch {trainer.scoreboard.best_epoch}"
        if trainer.best_dir.is_dir()
        else f"no best/: no evaluation of this run beat epoch {trainer.scoreboard.best_epoch}, whose weights it "
        "continued without"
    )
    return f"final/: the last {'EMA' if ema else 'trained'} weights, as evaluated; {best}"


def start_trackers(config: Config, run_dir: Path) -> tuple[list, str | None]:
    """Rank 0's trackers besides TensorBoard (W&B when ``logging.wandb`` asks), or why one cannot start."""
    if config.logging.wandb == "none":
        return [], None
    from trainer.trackers import WandbTracker

    try:
        logging = config.logging
        return [
            WandbTracker(run_dir, logging.wandb, logging.wandb_project, logging.wandb_entity, saved_dict(config))
        ], None
    except ValueError as exc:
        return [], str(exc)


def choose_run_dir(config: Config, output_dir: Path) -> tuple[str, str | None]:
    """(the run's name in ``output_dir``, why it may not run there or None), on rank 0. ``train.resume=auto``
    without ``logging.run_name`` continues the newest unfinished run that has a checkpoint."""
    name, resume = config.logging.run_name, config.train.resume
    if resume != "auto" or name:
        name = name or new_run_name(output_dir)
        return name, None if resume else reused_run_dir(output_dir / name)
    found = newest_resumable(output_dir)
    if found is None:
        return "", (
            f"--resume auto: no unfinished run in {output_dir} has a checkpoint to continue: start a run "
            "without --resume, or name the run to continue with logging.run_name"
        )
    print(
        f"--resume auto: continuing {found}, the unfinished run in {output_dir} with the newest checkpoint", flush=True
    )
    return found.name, None


def new_run_name(output_dir: Path) -> str:
    """A run name of the time, made unique in ``output_dir`` (jobs of a sweep may start in the same second)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = stamp, 1
    while (output_dir / name).exists():
        n += 1
        name = f"{stamp}-{n}"
    return name


def reused_run_dir(run_dir: Path) -> str | None:
    """Why a fresh run may not write into ``run_dir``: the checkpoints or metrics of another run are there,
    which its checkpoints would be mixed with (or replaced by); None when it is free."""
    held = [name for name in ("checkpoints", "metrics.jsonl", "final", "best") if (run_dir / name).exists()]
    if not held:
        return None
    if finished(run_dir):  # nothing to continue there
        return (
            f"{run_dir} already holds a finished run ({', '.join(held)}): start this one under another logging.run_name"
        )
    return (
        f"{run_dir} already holds a run ({', '.join(held)}): continue it with train.resume=auto, or start "
        f"this one under another logging.run_name"
    )


def _wait_for_local_pool(pool: LocalRewardPool) -> None:
    """``pool.wait_ready()``; a replica whose scorer needs model files (its exit status says so) ends the job
    saying where the job's own replicas take them from."""
    from shared.protocol import EXIT_MODEL_FILES_MISSING

    try:
        pool.wait_ready()
    except RewardPoolError as exc:
        if exc.exit_status != EXIT_MODEL_FILES_MISSING:
            raise
        raise RewardPoolError(
            "a scorer of reward.weights or eval.alarm_scorers needs model files: set "
            "reward.model_dir to the folder that holds them (the replicas' --model-dir). "
            f"{exc}"
        ) from None


def _launch_local_pool(config: Config, log_dir: Path, stack: contextlib.ExitStack) -> LocalRewardPool:
    """Launch reward-server replicas on loopback for the configured scorers, logging to ``log_dir`` (the caller
    waits for them with ``wait_ready``); stopped when the run ends."""
    env = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_TOKEN"}
    if (token := reward_token(config.reward)) is not None:  # the one the client sends, whatever the shell exports
        env["REWARD_SERVER_TOKEN"] = token
    scorers = sorted({*config.reward.weights, *config.eval.alarm_scorers})
    model_dir = ["--model-dir", str(Path(config.reward.model_dir).absolute())] if config.reward.model_dir else []
    pool = LocalRewardPool(scorers, replicas=config.reward.replicas, log_dir=log_dir, env=env, extra_args=model_dir)
    stack.callback(pool.stop)
    pool.launch()
    return pool
