"""Rollout samples in a real (tiny) run: every ``logging.rollout_samples_every``-th epoch and the last, rank 0's
first ``logging.rollout_samples`` rollouts with the prompts they were sampled for and the rewards they got."""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image
from warm_start import tiny_trainer


def test_the_logged_samples_are_the_epochs_first_rollouts_with_their_rewards(tmp_path, tiny_model_dir):
    trainer = tiny_trainer(
        tmp_path / "run",
        tiny_model_dir,
        "train.warmup_steps=0",
        "train.epochs=3",
        "data.prompts_per_epoch=2",
        "algorithm.group_size=4",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "eval.num_steps=1",
        "logging.rollout_samples=3",
        "logging.rollout_samples_every=2",
        "logging.progress=false",
    )
    sampled = {}
    sample_and_score = trainer.sample_and_score

    def recorded(prompts, *args):
        ro, result, wait = sample_and_score(prompts, *args)
        sampled[trainer.progress.epochs_done + 1] = (prompts, ro.images, result)
        return ro, result, wait

    trainer.sample_and_score = recorded
    trainer.fit()
    trainer.logger.close()
    folder = tmp_path / "run" / "rollouts"
    assert sorted(p.name for p in folder.iterdir()) == [
        "epoch0002.jpg",
        "epoch0002.jsonl",
        "epoch0003.jpg",
        "epoch0003.jsonl",
    ]  # every 2nd epoch, and the last
    for epoch in (2, 3):
        prompts, images, result = sampled[epoch]
        rows = [json.loads(line) for line in (folder / f"epoch{epoch:04d}.jsonl").read_text().splitlines()]
        assert rows == [
            {"prompt": prompts[i], "reward": float(result.combined[i]), "digit": float(result.components["digit"][i])}
            for i in range(3)
        ]
        grid = np.asarray(Image.open(folder / f"epoch{epoch:04d}.jpg"), dtype=np.float64) / 255
        assert grid.shape == ((17 + 1) * 4, (3 * 17 + 1) * 4)  # one row of 3 grey 16-px images, enlarged 4x
        for i in range(3):  # each image where it belongs (JPEG: up to its loss)
            shown = grid[4:68:4, 4 + 68 * i : 68 * (i + 1) : 4]
            assert np.abs(shown - images[i, 0].numpy()).mean() < 0.03, i


def test_an_inpainting_runs_grids_show_the_source_and_its_mask_beside_each_image(tmp_path):
    """A tiny FLUX.1 Fill job on inpainting rows: the rollout grid's second row is each rollout's source image with
    its repaint region tinted (the task's own inputs for those items); each evaluation grid row starts with it."""
    from tiny_data import tiny_dataset
    from tiny_models import tiny_config

    from reward_server.inprocess import InProcessRewardClient
    from trainer.algorithms import build_algorithm
    from trainer.algorithms.sft import SFT
    from trainer.config import load_config
    from trainer.data import build_task
    from trainer.distributed import SingleProcess
    from trainer.logging import RunLogger, input_rows
    from trainer.models import build_adapter
    from trainer.trainer import Trainer

    adapter = build_adapter(tiny_config("flux_fill", tmp_path / "model", dtype="float32"), "cpu")
    side = adapter.resolution
    data = tiny_dataset("inpaint_jsonl", tmp_path, side)
    config = load_config(
        overrides=[
            "data.name=inpaint_jsonl",
            f"data.path={data}",
            f"data.image_size={side}",
            "data.prompts_per_epoch=1",
            "algorithm.group_size=2",
            "train.epochs=1",
            "algorithm.sampler.num_steps=3",
            "algorithm.sampler.sde_window=1",
            "algorithm.sampler.window_range=[0,1]",
            "logging.rollout_samples=2",
            "eval.prompts=2",
            "eval.samples_per_prompt=1",
            "eval.num_steps=2",
        ]
    )
    client = InProcessRewardClient.from_names({"brightness": 1.0})
    trainer = Trainer(
        config,
        adapter,
        build_algorithm(config.algorithm),
        SFT(config.warmup),
        build_task(config.data),
        client,
        SingleProcess(torch.device("cpu")),
        RunLogger(tmp_path / "run", True, False),
    )
    sampled = {}
    sample_and_score = trainer.sample_and_score

    def recorded(prompts, indices, *args):
        ro, result, wait = sample_and_score(prompts, indices, *args)
        sampled.update(indices=indices.tolist(), images=ro.images)
        return ro, result, wait

    trainer.sample_and_score = recorded
    try:
        trainer.rl_epoch(0)
        trainer.evaluate(1, "samples_after")
    finally:
        client.close()
    trainer.logger.close()
    grid = np.asarray(Image.open(tmp_path / "run" / "rollouts" / "epoch0001.jpg"), dtype=np.float64) / 255
    scale = max(1, min(4, 128 // side))
    assert grid.shape == ((2 * (side + 1) + 1) * scale, (2 * (side + 1) + 1) * scale, 3)  # rollouts, then sources
    (source,) = input_rows(trainer.task.inputs(sampled["indices"][:2]), sampled["images"][:2])
    for i in range(2):  # each rollout in the first row, its tinted source below it (JPEG: up to its loss, larger
        left = (1 + i * (side + 1)) * scale  # on the random model's noisy images than on the smooth sources)
        for top, expected, within in ((scale, sampled["images"][i], 0.1), ((side + 2) * scale, source[i], 0.05)):
            shown = grid[top : top + side * scale : scale, left : left + side * scale : scale]
            assert np.abs(shown - expected.permute(1, 2, 0).numpy()).mean() < within, (i, top)
    # the evaluation grid: a row per evaluation item, its tinted source first, then its sample
    evaluated = trainer.evaluation.task
    rows = len(evaluated.eval_prompts)
    grid = np.asarray(Image.open(tmp_path / "run" / "samples_after.png"), dtype=np.float64) / 255
    assert grid.shape == ((rows * (side + 1) + 1) * scale, (2 * (side + 1) + 1) * scale, 3)
    (sources,) = input_rows(evaluated.inputs(evaluated.eval_indices[:rows]), torch.zeros(rows, 3, side, side))
    for r in range(rows):
        top = (1 + r * (side + 1)) * scale
        shown = grid[top : top + side * scale : scale, scale : scale + side * scale : scale]
        assert np.abs(shown - sources[r].permute(1, 2, 0).numpy()).max() <= 0.5 / 255 + 1e-6, r  # PNG: lossless
