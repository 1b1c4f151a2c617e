"""The evaluation in a real (tiny) run: an evaluation file (a test split) is what it samples and scores, RL samples
every item of the training file, and the grids show the first 16 prompts; GenEval-style records' tags break the
scores down."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from warm_start import tiny_trainer

from trainer.evaluation import GRID_PROMPTS


def test_a_prompt_file_too_small_to_hold_out_its_evaluation_says_that_rl_samples_it_too(
    tmp_path, tiny_model_dir, capsys
):
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text("".join(f"prompt {i}\n" for i in range(12)))  # 8 evaluated, 4 left: fewer than 8
    large.write_text("".join(f"prompt {i}\n" for i in range(16)))
    for path, pool in ((small, 12), (large, 8)):
        trainer = tiny_trainer(
            tmp_path / path.stem,
            tiny_model_dir,
            "data.name=prompt_file",
            f"data.path={path}",
            "train.warmup_steps=0",
            log=False,
        )
        assert len(trainer.pool) == pool
    out = capsys.readouterr().out
    assert (
        out.count("note: prompt_file has 12 items, too few to hold out the evaluation's 8 prompts: RL samples them too")
        == 1
        and "16 items" not in out
    )


def test_an_evaluation_file_is_sampled_and_rl_trains_on_every_training_prompt(tmp_path, tiny_model_dir):
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("".join(f"train {i}\n" for i in range(6)))
    test.write_text("".join(f"test {i}\n" for i in range(20)))
    trainer = tiny_trainer(
        tmp_path / "run",
        tiny_model_dir,
        "data.name=prompt_file",
        f"data.path={train}",
        f"eval.path={test}",
        "eval.prompts=18",
        "train.warmup_steps=0",
        "train.epochs=1",
        "data.prompts_per_epoch=6",
        "algorithm.group_size=2",
        "algorithm.sampler.num_steps=4",
        "algorithm.sampler.window_range=[0,2]",
        "eval.samples_per_prompt=1",
        "eval.num_steps=1",
        "eval.every=1",
        "eval.alarm_scorers=[colorfulness]",
        "logging.progress=false",
        reward="brightness",
    )  # the alarm scorer: the evaluation has a client of its own
    scored, trained, grids = [], [], []
    score, submit, grid = (
        trainer.evaluation.reward_client.score,
        trainer.reward_client.submit,
        trainer.logger.image_grid,
    )
    trainer.evaluation.reward_client.score = lambda images, prompts, *a, **k: (
        scored.append(prompts) or score(images, prompts, *a, **k)
    )
    trainer.reward_client.submit = lambda images, prompts, *a, **k: (
        trained.extend(prompts) or submit(images, prompts, *a, **k)
    )
    trainer.logger.image_grid = lambda name, images, rows, step, prompts, inputs: (
        grids.append((name, rows, len(images), list(prompts), inputs))
        or grid(name, images, rows, step, prompts, inputs)
    )
    trainer.fit()
    trainer.logger.close()
    assert scored == [[f"test {i}" for i in range(18)]] * 2  # before and after the one epoch
    assert sorted(set(trained)) == [f"train {i}" for i in range(6)] and len(trained) == 12
    shown = [f"test {i}" for i in range(GRID_PROMPTS)]  # each grid row's prompt, for the trackers' captions
    assert grids == [(name, GRID_PROMPTS, GRID_PROMPTS, shown, None) for name in ("samples_before", "samples_after")]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["phase"] == "eval"] == [0, 1]


def test_prompts_batched_per_forward_keep_their_own_noise(tmp_path, tiny_model_dir, monkeypatch):
    """eval.batch_size=4 samples the 10 digit prompts in 3 forwards instead of 10, and each prompt's images are
    those it gets alone up to float round-off (its noise is drawn from its own seed either way)."""
    import torch

    from trainer import evaluation

    calls, grids = [], {}
    rollout = evaluation.rollout
    monkeypatch.setattr(evaluation, "rollout", lambda *a, **k: calls.append(len(a[2])) or rollout(*a, **k))
    for batch in (1, 4):
        trainer = tiny_trainer(
            tmp_path / f"batch{batch}",
            tiny_model_dir,
            f"eval.batch_size={batch}",
            "eval.samples_per_prompt=2",
            "eval.num_steps=2",
            "train.warmup_steps=0",
            log=False,
        )
        trainer.logger.image_grid = lambda name, images, *shown, batch=batch: grids.__setitem__(batch, images)
        calls.clear()
        trainer.evaluate(0, "samples_before")
        assert calls == ([2] * 10 if batch == 1 else [8, 8, 4]), calls
    assert grids[1].shape == grids[4].shape == (20, 1, 16, 16)  # grey digits
    torch.testing.assert_close(grids[4], grids[1], rtol=0, atol=1e-6)  # batched kernels: float round-off


def test_scores_are_broken_down_by_the_records_tags_and_printed_as_their_mean(tmp_path, tiny_model_dir, capsys):
    """A GenEval-style evaluation file: each scorer's mean per tag and their unweighted mean (GenEval's overall
    score) are logged with the evaluation, from the very scores the evaluation got; the printed line shows the
    mean, not every tag; train.select_by may name the mean, and a tag the file lacks is refused as the trainer is
    built."""
    test = tmp_path / "test.jsonl"
    tags = ["counting", "colors", "counting", "position", "colors", "counting"]
    test.write_text(
        "".join(json.dumps({"tag": tag, "prompt": f"a photo of thing {i}"}) + "\n" for i, tag in enumerate(tags))
    )
    job = [
        "data.name=prompt_file",
        f"data.path={test}",
        f"eval.path={test}",
        "eval.allow_overlap=true",  # one file
        "train.warmup_steps=0",
        "train.epochs=0",
        "eval.samples_per_prompt=2",
        "eval.num_steps=1",
        "logging.progress=false",
        "reward.weights={brightness: 1}",
    ]
    with pytest.raises(
        ValueError,
        match=r"train.select_by='by_tag/brightness/size' is not a metric .* "
        r"by_tag/brightness/colors, .* by_tag/brightness/mean",
    ):
        tiny_trainer(
            tmp_path / "no", tiny_model_dir, *job, "train.select_by=by_tag/brightness/size", reward="brightness"
        )
    trainer = tiny_trainer(
        tmp_path / "run", tiny_model_dir, *job, "train.select_by=by_tag/brightness/mean", reward="brightness"
    )
    scored = []
    score = trainer.evaluation.reward_client.score
    trainer.evaluation.reward_client.score = lambda *a, **k: scored.append(score(*a, **k)) or scored[-1]
    trainer.fit()
    trainer.logger.close()
    brightness = scored[0].components["brightness"]  # 2 samples of each prompt, in order
    per_tag = {
        tag: float(np.mean([brightness[2 * i + j] for i, t in enumerate(tags) if t == tag for j in (0, 1)]))
        for tag in set(tags)
    }
    (record, _) = [
        r
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if r["phase"] == "eval"
    ]
    for tag, mean in per_tag.items():
        assert math.isclose(record[f"by_tag/brightness/{tag}"], mean, rel_tol=1e-12), tag
    assert math.isclose(record["by_tag/brightness/mean"], np.mean(list(per_tag.values())), rel_tol=1e-12)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval] before RL"))
    assert "by_tag/brightness/mean" in line and "by_tag/brightness/counting" not in line
    assert json.loads((tmp_path / "run" / "best" / "meta.json").read_text())["select_by"] == "by_tag/brightness/mean"


def test_rollout_scores_are_broken_down_by_the_pool_items_tags(tmp_path, tiny_model_dir):
    """The RL pool's tags (a GenEval-style training file): every epoch's record holds each scorer's mean over the
    rollouts of each tag drawn, from the very scores the rollouts got, and their unweighted mean."""
    pool = tmp_path / "train.jsonl"
    tags = ["counting", "colors", "counting", "position", "colors", "counting"]
    pool.write_text(
        "".join(json.dumps({"tag": tag, "prompt": f"a photo of thing {i}"}) + "\n" for i, tag in enumerate(tags))
    )
    trainer = tiny_trainer(
        tmp_path / "run",
        tiny_model_dir,
        "data.name=prompt_file",
        f"data.path={pool}",
        f"eval.path={pool}",
        "eval.allow_overlap=true",
        "train.warmup_steps=0",
        "train.epochs=2",
        "data.prompts_per_epoch=3",
        "algorithm.group_size=2",
        "eval.samples_per_prompt=1",
        "eval.num_steps=1",
        "logging.progress=false",
        "reward.weights={brightness: 1}",
        reward="brightness",
    )
    seen = []
    sample_and_score = trainer.sample_and_score

    def recorded(prompts, *args):
        ro, result, wait = sample_and_score(prompts, *args)
        seen.append((prompts, result.components["brightness"]))
        return ro, result, wait

    trainer.sample_and_score = recorded
    trainer.fit()
    trainer.logger.close()
    records = [
        r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"
    ]
    assert len(records) == len(seen) == 2
    for record, (prompts, scores) in zip(records, seen, strict=True):
        drawn = [tags[int(prompt.rsplit(" ", 1)[1])] for prompt in prompts]
        per_tag = {
            tag: float(np.mean([s for t, s in zip(drawn, scores, strict=True) if t == tag])) for tag in set(drawn)
        }
        logged = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("rollout_by_tag/brightness/")}
        assert logged.pop("mean") == pytest.approx(np.mean(list(per_tag.values())), rel=1e-12)
        assert logged == pytest.approx(per_tag, rel=1e-12)
