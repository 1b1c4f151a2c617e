"""The embedded text task: prompts and targets, supervised renders PP-OCR reads, metrics off the scores."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reward_server.scorers import SCORERS
from trainer.data import build_task, training_items, words
from trainer.data.words import VOCABULARY, WordsTask, render_word


@pytest.fixture(scope="module")
def task() -> WordsTask:
    return WordsTask(16)


def test_one_prompt_per_word_evaluated_and_trained_and_its_word_is_the_ocr_target(task):
    assert task.eval_prompts == task.prompts == [words.TEMPLATE.format(word=w) for w in VOCABULARY]
    assert training_items(task) == list(range(len(VOCABULARY)))  # as digits: the held-out part is the noise
    batch = task.supervised_batch(64, torch.Generator().manual_seed(0))
    assert set(batch.prompts) <= set(task.prompts) and len(set(batch.prompts)) > 10
    assert [m["text"] for m in task.item_metadata(task.eval_indices)] == list(VOCABULARY)


def test_supervised_images_are_the_prompts_words_dark_on_white(task):
    batch = task.supervised_batch(8, torch.Generator().manual_seed(1))
    assert batch.images.shape == (8, 1, 16, 16) and batch.images.min() >= 0 and batch.images.max() <= 1
    for image, prompt in zip(batch.images, batch.prompts, strict=True):
        word = prompt.rsplit(" ", 1)[1]
        assert any(
            torch.equal(image[0], torch.from_numpy(render_word(word, 16, face, shift)))
            for face in words.FONTS
            for shift in words.SHIFTS
        )
        assert image.mean() > 0.7 and image.min() < 0.2  # mostly paper, some ink


def test_pp_ocr_reads_the_supervised_renders():
    """The real ``ocr`` scorer reads the centred renders of every word in every face (what the warm-up teaches)."""
    ocr = SCORERS["ocr"]()
    ocr.load()
    targets = [w for w in VOCABULARY for _ in words.FONTS]
    images = [(render_word(w, 16, face) * 255).astype(np.uint8)[:, :, None] for w in VOCABULARY for face in words.FONTS]
    scores = [o.score for o in ocr.score(images, targets, [{"text": w} for w in targets])]
    assert np.mean(np.asarray(scores) == 1.0) >= 0.9, scores


def test_metrics_are_the_exact_match_share_and_mean_of_the_ocr_scores(task):
    images = torch.zeros(4, 1, 16, 16)
    metrics = task.metrics(images, task.eval_prompts[:4], {"ocr": np.array([1.0, 0.5, np.nan, 1.0])})
    assert metrics == {"ocr_accuracy": 0.5, "ocr_score": pytest.approx(2.5 / 3)}
    assert set(task.metrics(images, task.eval_prompts[:4], {"brightness": np.ones(4)})) == set(task.metric_names)
    assert all(math.isnan(v) for v in task.metrics(images, [], {"brightness": np.ones(4)}).values())


def test_the_registry_builds_it_and_refuses_a_path():
    from trainer.config import load_config

    config = load_config(overrides=["data.name=words"]).data
    assert isinstance(build_task(config), WordsTask)
    with pytest.raises(ValueError, match="remove data.path"):
        build_task(load_config(overrides=["data.name=words", "data.path=x.txt"]).data)
