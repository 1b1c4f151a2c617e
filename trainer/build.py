"""Build a run from its config: device, backend, model, algorithm, task, reward client, logger."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from shared.interrupt import as_interrupt, stop_if_interrupted
from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT, supervised_latents
from trainer.checkpoint import Checkpoints, Progress, damaged
from trainer.config import Config, reward_token, saved_dict
from trainer.data import describe_shared, shared_items
from trainer.data.sampler import GroupSampler
from trainer.disk import NO_ROOM, tree_mib
from trainer.distributed import detect_world, init_backend
from trainer.export import export_denoiser
from trainer.health import RewardFailure
from trainer.launch import (
    RunDirGuard,
    RunInterrupted,
    check_rewards,
    finished,
    fresh_start,
    hold_run_dir,
    newest_resumable,
    other_run,
    signalled_at,
    stopped_at,
)
from trainer.logging import RunLogger
from trainer.memory import memory_advice, out_of_memory
from trainer.models import build_adapter
from trainer.preflight import preflight
from trainer.stopping import StopsBeforeTraining, StopSignalled, ignore_stop_signals
from trainer.trainer import Trainer

if TYPE_CHECKING:
    from trainer.rewards.launcher import LocalRewardPool


def resolve_device(name: str, local_rank: int) -> torch.device:
    """``train.device`` for the process of ``local_rank``: "auto" is this rank's GPU where there is one, else
    the CPU; "cuda" without an index is this rank's GPU (an explicit "cuda:N" is taken as it is)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"train.device={name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        device = torch.device("cuda", local_rank) if device.index is None else device
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= count:
            raise ValueError(
                f"train.device={name!r} needs GPU {device.index}, but this process sees {count} "
                f"GPU(s){' (CUDA_VISIBLE_DEVICES or the driver)' if count else ''}: use train.device=auto "
                "or cpu, or start at most as many processes per machine as it has GPUs"
            )
    return device


def run(config: Config) -> dict[str, float]:
    """Run the whole job described by ``config``; returns the final evaluation metrics."""
    world = detect_world()
    device = resolve_device(config.train.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = config.train.num_threads or max(1, (os.cpu_count() or 1) // world.local_world_size)
    torch.set_num_threads(threads)
    # How an epoch's samples split over the ranks: refused before the process group forms (a rank that leaves
    # while the others connect fails them with Gloo's error instead of this one).
    GroupSampler(1, config.data.prompts_per_epoch, config.algorithm.group_size, world.world_size, 0, 0)
    backend = init_backend(config.parallel, device, max_grad_norm=config.train.max_grad_norm)
    main = backend.world.rank == 0

    with contextlib.ExitStack() as stack:
        stack.callback(backend.close)
        setup = stack.enter_context(StopsBeforeTraining())  # a SIGTERM now: what was started stops, nothing is kept
        # Before anything is built: every piece the run needs.
        task, eval_task = preflight(config, backend)
        output = Path(config.logging.output_dir)
        run_name, refusal = choose_run_dir(config, output) if main else (None, None)
        if main and refusal is None and config.train.resume:  # another model or algorithm: before any loads
            continued = (
                Path(config.train.resume)
                if config.train.resume != "auto"
                else Checkpoints(output / run_name / "checkpoints", 0, False).latest()
            )
            if continued is not None and damaged(continued, only=("config.json",)) is None:
                refusal = other_run(config, continued)
        made = None
        if main and refusal is None:
            run_dir = output / run_name
            made = next((d for d in (output, run_dir) if not d.exists()), None)  # removed on failure
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                refusal = (
                    f"logging.output_dir={str(output)!r}: cannot make {run_dir} there ({exc.strerror}): "
                    "choose a folder this user can write"
                )
            else:
                lock, refusal = hold_run_dir(run_dir)  # for the whole run: one process trains in it
                if lock is not None:
                    stack.callback(lock.close)
        run_name, refusal = backend.broadcast((run_name, refusal))
        if refusal:
            raise ValueError(refusal)
        run_dir = output / run_name
        guard = stack.enter_context(RunDirGuard(made))
        if main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(saved_dict(config), sort_keys=False))

        if main and (shared := shared_items(task, eval_task)):  # eval.allow_overlap let them through
            print(
                f"note: eval.allow_overlap=true: data.path and eval.path share {describe_shared(shared)}: the "
                "evaluation is not on held-out examples",
                flush=True,
            )
        warms_up = config.train.warmup_steps > 0 and (not config.train.init_from or config.train.warmup_after_init)
        if warms_up and not task.supervises:
            raise ValueError(
                f"data.name={config.data.name} has prompts but no target images for the supervised "
                "warm-up: set train.warmup_steps=0 (or start from trained weights: train.init_from)"
            )
        unscored = [s for s in task.metric_scorers if s not in {*config.reward.weights, *config.eval.guard_scorers}]
        if unscored:
            raise ValueError(
                f"the {config.data.name} task's metrics read the {', '.join(unscored)} scorer: add it to "
                "reward.weights or eval.guard_scorers"
            )
        trackers, refusal = start_trackers(config, run_dir) if main else ([], None)
        refusal = backend.broadcast(refusal)  # before any model loads: a W&B login that fails says so at once
        if refusal:
            raise ValueError(refusal)
        trackers = [stack.enter_context(tracker) for tracker in trackers]  # each ends as the run does, failed or not
        # Each machine's first process starts replicas on its loopback for its machine's processes (no
        # reward.urls); they load their scorers while the model loads here.
        world = backend.world
        pool = (
            _launch_local_pool(
                config, run_dir / "reward_replicas" / (f"node-{world.node}" if world.spans_machines else ""), stack
            )
            if not config.reward.urls and world.local_rank == 0
            else None
        )
        torch.manual_seed(config.train.seed)
        if main:  # rank 0 first: it may build (tiny) or cache files the others then read
            adapter = build_adapter(config.model, device)
        backend.barrier()
        require_shared_run_dir(run_dir, backend.world.rank)
        if not main:
            adapter = build_adapter(config.model, device)
        # The first item's image inputs as the model reads them, and the supervised images' shape against the
        # model's: inputs it does not take fail now, not after the reward replicas and the warm-up (as a shape).
        if (inputs := task.inputs([0])) is not None:
            adapter.encode_prompts(task.prompts[:1], inputs)
        if warms_up and task.supervises:
            supervised_latents(adapter, task.supervised_batch(1, torch.Generator().manual_seed(0)).images)

        urls = list(config.reward.urls)
        if not urls:
            mine = None
            if pool is not None:
                _wait_for_local_pool(pool)
                pool.supervise()  # a replica that dies is started again (the client waits: reward.outage_s)
                mine = list(pool.urls)
            urls = {node: served for node, served in backend.all_gather_object((world.node, mine)) if served}[
                world.node
            ]
            check_rewards(config, backend, own_urls=urls)  # their limits against the run's requests
        from trainer.rewards.client import HttpRewardClient

        def reward_client(weights: dict[str, float]) -> HttpRewardClient:
            made = HttpRewardClient(
                urls,
                weights,
                token=reward_token(config.reward),
                timeout_s=config.reward.timeout_s,
                max_concurrency=config.reward.max_concurrency,
                batch_size=config.reward.batch_size,
                wire_format=config.reward.wire_format,
                combine_mode=config.reward.combine_mode,
                outage_s=config.reward.outage_s,
            )
            stack.callback(made.close)
            return made

        client = reward_client(config.reward.weights)
        guards = {name: 0.0 for name in config.eval.guard_scorers if name not in config.reward.weights}
        guard_client = reward_client({**config.reward.weights, **guards}) if guards else None
        logger = RunLogger(run_dir, enabled=main, tensorboard=config.logging.tensorboard, trackers=trackers)
        stack.callback(logger.close)

        trainer = Trainer(
            config,
            adapter,
            build_algorithm(config.algorithm),
            SFT(config.warmup),
            task,
            client,
            backend,
            logger,
            guard_client,
            eval_task,
        )
        if config.train.resume:
            checkpoint = (
                trainer.checkpoints.newest_loadable(backend)
                if config.train.resume == "auto"
                else Path(config.train.resume)
            )
            if checkpoint is not None:
                trainer.resume(checkpoint)
            elif main:
                print(fresh_start(output, run_name), flush=True)
        if config.train.init_from and trainer.progress == Progress():
            trainer.init_from(Path(config.train.init_from))
        if main:
            print(f"run directory: {run_dir}  (reward replicas: {', '.join(urls)})", flush=True)
        for made in filter(None, (client, guard_client)):
            made.give_up_waiting = lambda: bool(trainer.stops.received)  # a stop does not wait out an outage
        stop_if_interrupted()  # a Ctrl-C that library code swallowed while the run was set up
        guard.started = True
        setup.release()
        try:
            with as_interrupt(), trainer.stops:  # SIGTERM, SIGUSR1: checkpoint at the next step, then stop
                metrics = trainer.fit()
            ema = trainer.ema if config.eval.use_ema else None  # what the final evaluation sampled with
            with ema.swapped() if ema is not None else contextlib.nullcontext():
                final = backend.main_copy(adapter.denoiser)  # on rank 0's CPU, gathered a parameter at a time
            if main:
                export_denoiser(final, run_dir / "final")
        except StopSignalled as stop:
            ignore_stop_signals()
            raise RunInterrupted(
                signalled_at(trainer.progress, config, trainer.checkpoints.latest()),
                run_dir,
                str(stop),
                128 + stop.signum,
            ) from None
        except KeyboardInterrupt:
            raise RunInterrupted(stopped_at(trainer.progress, config, trainer.checkpoints.latest()), run_dir) from None
        except RewardFailure as failure:  # its checkpoint is written (Trainer.fit): fix the rewards, then continue
            raise RunInterrupted(
                signalled_at(trainer.progress, config, trainer.checkpoints.latest()), run_dir, str(failure), 1
            ) from None
        except RuntimeError as exc:  # out of GPU (or CPU) memory: where, and the settings that lower it; then on
            if not out_of_memory(exc):
                raise
            raise RunInterrupted(
                stopped_at(trainer.progress, config, trainer.checkpoints.latest()),
                run_dir,
                memory_advice(exc, config),
                1,
            ) from None
        except OSError as full:  # a full disk, a quota, a read-only remount: what is written stays; room, then on
            if full.errno not in NO_ROOM:
                raise
            latest = trainer.checkpoints.latest()
            room = f" (a checkpoint of this run takes {tree_mib(latest):.1f} MiB)" if latest is not None else ""
            raise RunInterrupted(
                stopped_at(trainer.progress, config, latest),
                run_dir,
                f"cannot write {full.filename or run_dir}: {full.strerror}; make room{room}, then continue",
                1,
            ) from None
        if main:
            best = (
                f"best/: the best evaluation's, epoch {trainer.guard.best_epoch}"
                if trainer.best_dir.is_dir()
                else f"no best/: no evaluation of this run beat epoch {trainer.guard.best_epoch}, whose weights it "
                "continued without"
            )
            print(
                f"done: {run_dir} (final/: the last {'EMA' if ema is not None else 'trained'} weights, as evaluated; "
                f"{best})",
                flush=True,
            )
        backend.barrier()
        return metrics


def start_trackers(config: Config, run_dir: Path) -> tuple[list, str | None]:
    """Rank 0's trackers besides TensorBoard (W&B when ``logging.wandb`` asks), or why one cannot start."""
    if config.logging.wandb == "none":
        return [], None
    from trainer.trackers import WandbTracker

    try:
        return [
            WandbTracker(
                run_dir,
                config.logging.wandb,
                config.logging.wandb_project,
                config.logging.wandb_entity,
                saved_dict(config),
            )
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


def require_shared_run_dir(run_dir: Path, rank: int) -> None:
    """Every rank writes its part of each checkpoint into the run directory rank 0 made, and rank 0 renames the
    whole: a rank that does not see that directory (a node-local ``logging.output_dir``) fails now, not at
    the first checkpoint."""
    if not run_dir.is_dir():
        raise ValueError(
            f"rank {rank} does not see the run directory {run_dir} that rank 0 made: set "
            "logging.output_dir to a filesystem every node shares (checkpoints are written there by "
            "every rank)"
        )


def _wait_for_local_pool(pool: LocalRewardPool) -> None:
    """``pool.wait_ready()``; a replica whose scorer needs model files (its exit status says so) ends the job
    saying where the job's own replicas take them from."""
    from shared.protocol import EXIT_MODEL_FILES_MISSING
    from trainer.rewards.launcher import RewardPoolError

    try:
        pool.wait_ready()
    except RewardPoolError as exc:
        if exc.exit_status != EXIT_MODEL_FILES_MISSING:
            raise
        raise RewardPoolError(
            "a scorer of reward.weights or eval.guard_scorers needs model files: set "
            "reward.model_dir to the folder that holds them (the replicas' --model-dir). "
            f"{exc}"
        ) from None


def _launch_local_pool(config: Config, log_dir: Path, stack: contextlib.ExitStack) -> LocalRewardPool:
    """Launch reward-server replicas on loopback for the configured scorers, logging to ``log_dir`` (the caller
    waits for them with ``wait_ready``); stopped when the run ends."""
    from trainer.rewards.launcher import LocalRewardPool

    env = {k: v for k, v in os.environ.items() if k != "REWARD_SERVER_TOKEN"}
    if (token := reward_token(config.reward)) is not None:  # the one the client sends, whatever the shell exports
        env["REWARD_SERVER_TOKEN"] = token
    scorers = sorted({*config.reward.weights, *config.eval.guard_scorers})
    model_dir = ["--model-dir", str(Path(config.reward.model_dir).absolute())] if config.reward.model_dir else []
    pool = LocalRewardPool(scorers, replicas=config.reward.replicas, log_dir=log_dir, env=env, extra_args=model_dir)
    stack.callback(pool.stop)
    pool.launch()
    return pool
