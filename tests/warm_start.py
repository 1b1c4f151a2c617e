"""The tiny model warmed up on digits (the default 600-step warm-up), made once per test run for the slow runs
that need a model that already draws digits: a warm-up takes about 110 s on this machine, and pytest-xdist's workers
share one (tests/once_per_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from once_per_run import once_per_run

from reward_server.inprocess import InProcessRewardClient
from shared.rewards import RewardClient
from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT
from trainer.config import load_config
from trainer.data import DigitsTask, build_tasks
from trainer.distributed import SingleProcess
from trainer.logging import RunLogger
from trainer.models.sd3 import SD3Adapter
from trainer.models.tiny import TinyConfig
from trainer.trainer import Trainer


def tiny_trainer(
    run_dir: Path,
    model_dir: str,
    *overrides: str,
    reward: str = "digit",
    task: DigitsTask | None = None,
    log: bool = True,
    rewards: RewardClient | None = None,
) -> Trainer:
    """The default job's Trainer on the tiny model, built in-process (rewards scored in-process too, or by
    ``rewards``) on the task and evaluation its config names (default: digits), or on ``task``; ``log=False``: no
    metrics.jsonl or images."""
    config = load_config(overrides=[f"model.path={model_dir}", *overrides])
    unweighted = {name: 0.0 for name in config.eval.alarm_scorers}
    task, evaluated = (task, task) if task is not None else build_tasks(config.data, config.eval)
    return Trainer(
        config,
        SD3Adapter(TinyConfig(path=model_dir)),
        build_algorithm(config.algorithm),
        SFT(config.warmup),
        task,
        rewards or InProcessRewardClient.from_names({reward: 1.0}),
        SingleProcess(torch.device("cpu")),
        RunLogger(run_dir, log, False),
        InProcessRewardClient.from_names({reward: 1.0, **unweighted}) if unweighted else None,
        evaluated,
    )


def warmed_checkpoint(factory: pytest.TempPathFactory, model_dir: str) -> Path:
    """The checkpoint after the default warm-up of the tiny model in ``model_dir`` (built with seed 0, so every
    worker's copy has the same weights), for ``train.init_from``; the first worker to ask makes it."""

    def make(folder: Path) -> str:
        trainer = tiny_trainer(
            folder,
            model_dir,
            "train.epochs=0",
            "logging.progress=false",
            "eval.samples_per_prompt=1",
            "eval.num_steps=2",
        )
        trainer.fit()
        trainer.logger.close()
        return str(trainer.checkpoints.latest())

    return Path(once_per_run(factory, "warm-tiny", make))
