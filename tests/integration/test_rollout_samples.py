"""Rollout samples in a real (tiny) run: every ``logging.rollout_samples_every``-th epoch and the last, rank 0's
first ``logging.rollout_samples`` rollouts with the prompts they were sampled for and the rewards they got."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image
from warm_start import tiny_trainer


def test_the_logged_samples_are_the_epochs_first_rollouts_with_their_rewards(tmp_path, tiny_model_dir):
    trainer = tiny_trainer(tmp_path / "run", tiny_model_dir, "train.warmup_steps=0", "train.epochs=3",
                           "data.prompts_per_epoch=2", "algorithm.group_size=4", "algorithm.sampler.num_steps=4",
                           "algorithm.sampler.window_range=[0,2]", "eval.every=0", "eval.samples_per_prompt=1",
                           "eval.num_steps=1", "logging.rollout_samples=3", "logging.rollout_samples_every=2",
                           "logging.progress=false")
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
    assert sorted(p.name for p in folder.iterdir()) == ["epoch0002.jpg", "epoch0002.jsonl", "epoch0003.jpg",
                                                         "epoch0003.jsonl"]  # every 2nd epoch, and the last
    for epoch in (2, 3):
        prompts, images, result = sampled[epoch]
        rows = [json.loads(line) for line in (folder / f"epoch{epoch:04d}.jsonl").read_text().splitlines()]
        assert rows == [{"prompt": prompts[i], "reward": float(result.combined[i]),
                         "digit": float(result.components["digit"][i])} for i in range(3)]
        grid = np.asarray(Image.open(folder / f"epoch{epoch:04d}.jpg"), dtype=np.float64) / 255
        assert grid.shape == ((17 + 1) * 4, (3 * 17 + 1) * 4)  # one row of 3 grey 16-px images, enlarged 4x
        for i in range(3):  # each image where it belongs (JPEG: up to its loss)
            shown = grid[4:68:4, 4 + 68 * i:68 * (i + 1):4]
            assert np.abs(shown - images[i, 0].numpy()).mean() < 0.03, i
