"""The embedded text task's job (configs/embedded_text.yaml at toy size) with the real ``ocr`` scorer in process:
it warms up on the renders, samples and scores with PP-OCR, and its evaluations log the OCR accuracy that picks
best/."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from reward_server.inprocess import InProcessRewardClient
from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT
from trainer.config import load_config
from trainer.data import build_task
from trainer.distributed import SingleProcess
from trainer.logging import RunLogger
from trainer.models import build_adapter
from trainer.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "embedded_text.yaml"
TOY = [
    "train.warmup_steps=2",
    "train.epochs=1",
    "algorithm.group_size=2",
    "data.prompts_per_epoch=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "eval.num_steps=2",
    "eval.samples_per_prompt=1",
    "eval.every=1",
    "logging.progress=false",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_text_job_logs_ocr_accuracy_and_keeps_best_by_it(tmp_path, tiny_model_dir):
    config = load_config([str(CONFIG)], [f"model.path={tiny_model_dir}", *TOY])
    assert config.data.name == "words" and dict(config.reward.weights) == {"ocr": 1.0}
    client = InProcessRewardClient.from_names(dict(config.reward.weights))
    trainer = Trainer(
        config,
        build_adapter(config.model, torch.device("cpu")),
        build_algorithm(config.algorithm),
        SFT(config.warmup),
        build_task(config.data),
        client,
        SingleProcess(torch.device("cpu")),
        RunLogger(tmp_path, True, False),
    )
    try:
        trainer.fit()
    finally:
        client.close()
    records = _records(tmp_path)
    evals = [r for r in records if r["phase"] == "eval"]
    (rl,) = [r for r in records if r["phase"] == "rl"]
    assert len(evals) == 2 and all(0 <= r["ocr_accuracy"] <= 1 and 0 <= r["ocr_score"] <= 1 for r in evals)
    assert all(math.isclose(r["ocr_score"], r["reward_mean"]) for r in evals)  # the reward is the ocr score
    assert 0 <= rl["rollout_ocr_accuracy"] <= 1 and math.isfinite(rl["reward_mean"])
    assert json.loads((tmp_path / "best" / "meta.json").read_text())["select_by"] == "ocr_accuracy"
    assert (tmp_path / "samples_before.png").is_file() and (tmp_path / "samples_after.png").is_file()
