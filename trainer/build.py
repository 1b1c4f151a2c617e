"""Build a run's parts from its config: the backend on its device, the model, the algorithm, the reward clients,
the logger and the Trainer that holds them. Run control around them (folder, signals, replicas): trainer/run.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT, supervised_latents
from trainer.config import Config, reward_token
from trainer.data import Task, describe_shared, shared_items
from trainer.data.sampler import GroupSampler
from trainer.distributed import ParallelBackend, detect_world, init_backend
from trainer.logging import RunLogger
from trainer.models import build_adapter
from trainer.models.base import ModelAdapter
from trainer.trainer import Trainer


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


def start_backend(config: Config) -> ParallelBackend:
    """This process's device and threads, and the parallel backend over every rank (its process group formed)."""
    world = detect_world()
    device = resolve_device(config.train.device, world.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = config.train.num_threads or max(1, (os.cpu_count() or 1) // world.local_world_size)
    torch.set_num_threads(threads)
    # How an epoch's samples split over the ranks: refused before the process group forms (a rank that leaves
    # while the others connect fails them with Gloo's error instead of this one).
    replicas = max(1, world.world_size // config.parallel.sequence_parallel)  # a sequence-parallel group is one
    GroupSampler(1, config.data.prompts_per_epoch, config.algorithm.group_size, replicas, 0, 0)
    return init_backend(config.parallel, device, max_grad_norm=config.train.max_grad_norm)


def warms_up(config: Config) -> bool:
    """Whether the run has a supervised warm-up (not after ``train.init_from``, unless ``train.warmup_after_init``)."""
    return config.train.warmup_steps > 0 and (not config.train.init_from or config.train.warmup_after_init)


def check_tasks(config: Config, task: Task, eval_task: Task, main: bool) -> None:
    """Refuse a task the run cannot train on (no target images for its warm-up, metrics of a scorer it does not
    call); note an evaluation that is not on held-out items."""
    if main and (shared := shared_items(task, eval_task)):  # eval.allow_overlap let them through
        print(
            f"note: eval.allow_overlap=true: data.path and eval.path share {describe_shared(shared)}: the "
            "evaluation is not on held-out examples",
            flush=True,
        )
    if warms_up(config) and not task.supervises:
        raise ValueError(
            f"data.name={config.data.name} has prompts but no target images for the supervised "
            "warm-up: set train.warmup_steps=0 (or start from trained weights: train.init_from)"
        )
    unscored = [s for s in task.metric_scorers if s not in {*config.reward.weights, *config.eval.alarm_scorers}]
    if unscored:
        raise ValueError(
            f"the {config.data.name} task's metrics read the {', '.join(unscored)} scorer: add it to "
            "reward.weights or eval.alarm_scorers"
        )


def load_model(config: Config, backend: ParallelBackend, task: Task, run_dir: Path) -> ModelAdapter:
    """The model on every rank, rank 0's first (it may build a tiny one, or cache files the others then read),
    tried on the task's first item and supervised images: inputs it does not take fail now, not after the warm-up."""
    torch.manual_seed(config.train.seed)
    main = backend.world.rank == 0
    if main:
        adapter = build_adapter(config.model, backend.device)
    backend.barrier()
    require_shared_run_dir(run_dir, backend.world.rank)
    if not main:
        adapter = build_adapter(config.model, backend.device)
    if (inputs := task.inputs([0])) is not None:
        adapter.encode_prompts(task.prompts[:1], inputs)
    if warms_up(config) and task.supervises:
        supervised_latents(adapter, task.supervised_batch(1, torch.Generator().manual_seed(0)).images)
    return adapter


def build_trainer(
    config: Config,
    adapter: ModelAdapter,
    task: Task,
    eval_task: Task,
    urls: list[str],
    backend: ParallelBackend,
    closing: contextlib.ExitStack,
    logger: Callable[[], RunLogger],
) -> Trainer:
    """The Trainer of the run: its algorithm and warm-up, the reward client of ``urls`` (and one for the alarm
    scorers, when the reward does not call them all), and the ``logger()``; the clients close with ``closing``."""
    from trainer.rewards.client import HttpRewardClient

    def reward_client(weights: dict[str, float]) -> HttpRewardClient:
        reward = config.reward
        made = HttpRewardClient(
            urls,
            weights,
            token=reward_token(reward),
            timeout_s=reward.timeout_s,
            max_concurrency=reward.max_concurrency,
            batch_size=reward.batch_size,
            wire_format=reward.wire_format,
            combine_mode=reward.combine_mode,
            outage_s=reward.outage_s,
        )
        closing.callback(made.close)
        return made

    client = reward_client(config.reward.weights)
    unweighted = {name: 0.0 for name in config.eval.alarm_scorers if name not in config.reward.weights}
    eval_client = reward_client({**config.reward.weights, **unweighted}) if unweighted else None
    run_logger = logger()
    algorithm, warmup = build_algorithm(config.algorithm), SFT(config.warmup)
    return Trainer(config, adapter, algorithm, warmup, task, client, backend, run_logger, eval_client, eval_task)


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
