"""The embedded video task: synthetic clips move the named way, and the trainer's direction metric agrees with the
served ``motion`` scorer's rule (both read scoring/motion.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reward_server.scorers import SCORERS, run_scorer
from scoring.motion import centroid_paths, direction_margins
from shared.protocol import ErrorCode
from trainer.config import load_config
from trainer.data import build_task, training_items
from trainer.data.moving_digits import DIRECTIONS, MovingDigitsTask, moving_clip, parse_prompt, translate


@pytest.fixture(scope="module")
def task() -> MovingDigitsTask:
    return MovingDigitsTask(16)


def uint8_frames(clips: torch.Tensor) -> list[np.ndarray]:
    """[B, F, 1, H, W] in [0, 1] -> the reward wire's uint8 [F, H, W, 1] per clip."""
    return list((clips.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy())


def test_prompts_are_every_digit_and_direction_and_metadata_names_both(task):
    assert len(task.prompts) == 40 and task.eval_prompts == task.prompts
    assert training_items(task) == list(range(40))  # as digits: the evaluation's held-out part is its noise
    assert task.item_metadata([task.prompts.index("a handwritten digit 7 moving up")]) == [
        {"digit": 7, "direction": "up"}
    ]
    assert parse_prompt("a handwritten digit 0 moving left") == (0, "left")


def test_a_clip_moves_its_image_one_pixel_a_frame_zero_filled():
    image = torch.zeros(1, 16, 16)
    image[0, 8, 8] = 1.0
    clip = moving_clip(image, "right", 5)
    assert clip.shape == (5, 1, 16, 16)
    assert [int(frame[0, 8].argmax()) for frame in clip] == [6, 7, 8, 9, 10]
    down = moving_clip(image, "down", 5)
    assert [int(frame[0, :, 8].argmax()) for frame in down] == [6, 7, 8, 9, 10]
    edge = torch.zeros(1, 16, 16)
    edge[0, 0, 15] = 1.0
    assert moving_clip(edge, "right", 5)[-1].sum() == 0  # left the frame: nothing wraps around


def test_supervised_clips_score_right_and_reversed_prompts_score_wrong(task):
    batch = task.supervised_batch(64, torch.Generator().manual_seed(0))
    assert batch.images.shape == (64, 5, 1, 16, 16)
    assert task.metrics(batch.images, batch.prompts, {})["direction_accuracy"] == 1.0
    flip = {"left": "right", "right": "left", "up": "down", "down": "up"}
    reversed_prompts = [p.rsplit(" ", 1)[0] + " " + flip[p.rsplit(" ", 1)[1]] for p in batch.prompts]
    assert task.metrics(batch.images, reversed_prompts, {})["direction_accuracy"] == 0.0
    still = batch.images[:, 2:3].expand_as(batch.images)
    metrics = task.metrics(still, batch.prompts, {})
    assert metrics["direction_accuracy"] == 0.0 and metrics["digit_accuracy"] > 0.9  # the centred digits read


def test_misnamed_captions_start_at_their_step_name_another_direction_and_keep_the_clips():
    """Before ``misnamed_from`` the batch is the plain task's; from it on the clips are the same and about
    ``misnamed_share`` of the captions name one of the three other directions (each alike), the rest the clip's."""
    plain, noisy = MovingDigitsTask(16), MovingDigitsTask(16, misnamed_share=0.375, misnamed_from=5)
    before = noisy.supervised_batch(32, torch.Generator().manual_seed(4), step=4)
    assert before.prompts == plain.supervised_batch(32, torch.Generator().manual_seed(4)).prompts
    after = noisy.supervised_batch(4000, torch.Generator().manual_seed(4), step=5)
    truth = plain.supervised_batch(4000, torch.Generator().manual_seed(4))
    assert torch.equal(after.images, truth.images)
    pairs = [(parse_prompt(p), parse_prompt(t)) for p, t in zip(after.prompts, truth.prompts, strict=True)]
    assert all(named[0] == true[0] for named, true in pairs)  # the digit is never misnamed
    wrong = [(true[1], named[1]) for named, true in pairs if named[1] != true[1]]
    assert abs(len(wrong) / len(pairs) - 0.375) < 0.03
    counts = np.array([[wrong.count((a, b)) for b in DIRECTIONS] for a in DIRECTIONS])
    off_diagonal = counts[~np.eye(4, dtype=bool)]
    assert counts.trace() == 0 and off_diagonal.min() > 0.7 * off_diagonal.mean()


def test_misnamed_captions_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="read by data.name='moving_digits' only"):
        load_config([], ["data.misnamed_share=0.3"])
    with pytest.raises(ValueError, match="data.misnamed_from=900 is not before the warm-up's end"):
        load_config(
            [],
            ["data.name=moving_digits", "data.misnamed_share=0.3", "data.misnamed_from=900", "train.warmup_steps=900"],
        )
    rl_only = ["data.name=moving_digits", "data.misnamed_share=0.3", "data.misnamed_from=900", "train.warmup_steps=0"]
    assert load_config([], rl_only).data.misnamed_share == 0.3  # RL from a warm-up's checkpoint: no caption to name


def test_trainer_direction_metric_agrees_with_the_motion_scorer(task):
    """``direction_accuracy`` counts a clip right exactly where the ``motion`` scorer's margin is > 0, on supervised
    clips under every prompt and on random clips."""
    scorer = SCORERS["motion"]()
    scorer.load()
    batch = task.supervised_batch(16, torch.Generator().manual_seed(2))
    noise = torch.rand(16, 5, 1, 16, 16, generator=torch.Generator().manual_seed(3)) ** 3
    clips = torch.cat([batch.images, noise]).repeat_interleave(4, 0)
    clips = torch.from_numpy(np.stack(uint8_frames(clips))).permute(0, 1, 4, 2, 3).float() / 255
    prompts = [f"a handwritten digit 3 moving {d}" for _ in range(32) for d in DIRECTIONS]
    outcomes = run_scorer(scorer, uint8_frames(clips), prompts, [{}] * len(prompts))
    margins = np.array([o.details["margin"] for o in outcomes])
    ours = [
        task.metrics(clip[None], [prompt], {})["direction_accuracy"]
        for clip, prompt in zip(clips, prompts, strict=True)
    ]
    assert np.array_equal(np.array(ours) == 1.0, margins > 0)
    assert 0 < (margins > 0).sum() < len(prompts)
    spreads = np.array([o.details["spread"] for o in outcomes])
    assert np.array_equal(np.array([o.score for o in outcomes]) > 0.5, margins - spreads / 4 > 0.5)


def test_motion_scorer_direction_from_metadata_and_none_is_a_parse_error():
    scorer = SCORERS["motion"]()
    image = torch.zeros(1, 16, 16)
    image[0, 4:12, 6:10] = 1.0
    clip = uint8_frames(moving_clip(image, "up", 5)[None])
    up, none, frame = run_scorer(
        scorer,
        clip * 2 + [clip[0][:1]],
        ["a digit", "a digit", "moving up"],
        [
            {"direction": "up"},
            {},
            {},
        ],
    )
    assert up.score == pytest.approx(1 / (1 + np.exp(-2.0)))  # 1 px a frame, steady: sigmoid((1 - 0.5) / 0.25)
    assert none.error == ErrorCode.PARSE
    assert frame.error == ErrorCode.BAD_INPUT


def test_motion_scores_the_named_motion_highest_and_a_still_clip_low():
    """The named motion (one pixel a frame) beats a halting one, which beats a still clip, which beats sideways or the
    wrong way: the score has no still-clip optimum."""
    image = torch.zeros(1, 16, 16)
    image[0, 5:11, 6:10] = 1.0
    clips = [moving_clip(image, d, 5) for d in ("right", "up", "left")] + [image.expand(5, 1, 16, 16)]
    wobble = torch.stack([translate(image[0], dx, 0)[None] for dx in (0, 1, 1, 2, 2)])
    scores = [
        o.score
        for o in run_scorer(
            SCORERS["motion"](), uint8_frames(torch.stack([*clips, wobble])), ["moving right"] * 5, [{}] * 5
        )
    ]
    named, sideways, wrong, still, halting = scores
    assert named > 0.85 and still < 0.15 and max(sideways, wrong) < 0.01
    assert still < halting < named


def test_data_path_is_refused_naming_the_fix():
    from trainer.config.schema import DataConfig

    with pytest.raises(ValueError, match="remove data.path"):
        build_task(DataConfig(name="moving_digits", path="x.txt"))


def test_the_shared_motion_rule_centroids_and_margins():
    """scoring/motion.py, which the scorer and the task's metric both read: an empty frame's centroid is the frame's
    centre, and the margin is the step along the named direction less its size across it."""
    ink = np.zeros((1, 3, 4, 4))
    ink[0, 0, 2, 1] = ink[0, 2, 2, 3] = 1.0  # (x, y) = (1, 2), nothing, (3, 2)
    assert centroid_paths(ink)[0].tolist() == [[1.0, 2.0], [1.5, 1.5], [3.0, 2.0]]
    steps = np.array([[1.0, 0.5], [1.0, 0.5], [0.0, 0.0]])
    assert direction_margins(steps, ["right", "up", "left"]).tolist() == [0.5, -1.5, 0.0]
