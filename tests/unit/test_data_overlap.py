"""A run whose data.path shares items with its eval.path (a prompt; with image inputs, a prompt on the same files)
is refused as its tasks are built, naming how many and the first three, unless eval.allow_overlap says otherwise
(the command-line run: tests/integration/test_eval_overlap.py)."""

from __future__ import annotations

import json
import re

import pytest
from tiny_data import write_inpaint_jsonl

from trainer.config import load_config
from trainer.data import build_tasks, shared_items, training_items


def _tasks(tmp_path, train: list[str], test: list[str], *overrides: str):
    (tmp_path / "train.txt").write_text("".join(p + "\n" for p in train))
    (tmp_path / "test.txt").write_text("".join(p + "\n" for p in test))
    config = load_config(
        overrides=[
            "data.name=prompt_file",
            f"data.path={tmp_path / 'train.txt'}",
            f"eval.path={tmp_path / 'test.txt'}",
            *overrides,
        ]
    )
    return build_tasks(config.data, config.eval)


def test_a_training_file_sharing_prompts_with_the_evaluation_file_is_refused(tmp_path):
    """Four of the test file's prompts in the training file (one twice): refused, naming how many and the first
    three in RL's order; with eval.allow_overlap the tasks are built and shared_items names them."""
    train = ["train 0", "test 7", "train 1", "test 2", "test 7", "test 9", "test 0"]
    test = [f"test {i}" for i in range(12)]
    with pytest.raises(
        ValueError,
        match=r"^data.path='.*train.txt' and eval.path='.*test.txt' share 4 prompts \(first "
        r"three: 'test 7', 'test 2', 'test 9'\): an evaluation on examples RL trains "
        r"on measures memorisation; .* set eval.allow_overlap=true to run anyway$",
    ):
        _tasks(tmp_path, train, test)
    task, evaluated = _tasks(tmp_path, train, test, "eval.allow_overlap=true")
    assert training_items(task) == list(range(7)) and evaluated.eval_prompts == test
    assert shared_items(task, evaluated) == ["test 7", "test 2", "test 9", "test 0"]
    # the whole evaluation file counts, not only its first eval.prompts items
    with pytest.raises(ValueError, match=r"share 4 prompts"):
        _tasks(tmp_path, train, test, "eval.prompts=1")


def test_an_image_dataset_shares_an_item_only_with_its_prompt_and_files(tmp_path):
    """Inpainting rows: the test file's rows on other images share nothing, though their prompts are the training
    file's; two rows on the training file's own image and mask are refused as shared items."""
    train = write_inpaint_jsonl(tmp_path / "train", count=4)
    other = write_inpaint_jsonl(tmp_path / "test", count=4)  # the same four prompts on other files
    rows = [json.loads(line) for line in other.read_text().splitlines()]
    config = load_config(overrides=["data.name=inpaint_jsonl", f"data.path={train}", f"eval.path={other}"])
    task, evaluated = build_tasks(config.data, config.eval)
    assert task.prompts == evaluated.prompts and shared_items(task, evaluated) == []
    for i in (2, 1):  # rows 2 and 1 of the training file, on its own image and mask
        rows.append(
            {
                **rows[i],
                "image_path": str(train.parent / "images" / f"{i}.png"),
                "mask_path": str(train.parent / "masks" / f"{i}.png"),
            }
        )
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shared = f"share 2 items (prompt and image files) (first three: {task.prompts[1]!r}, {task.prompts[2]!r}):"
    with pytest.raises(ValueError, match=re.escape(shared)):  # in the training file's order
        build_tasks(config.data, config.eval)


def test_disjoint_files_and_held_out_prompts_share_nothing(tmp_path):
    task, evaluated = _tasks(tmp_path, [f"train {i}" for i in range(5)], [f"test {i}" for i in range(5)])
    assert shared_items(task, evaluated) == []
    config = load_config(overrides=["data.name=prompt_file", f"data.path={tmp_path / 'train.txt'}"])
    task, evaluated = build_tasks(config.data, config.eval)  # no eval.path: held out of data.path itself
    assert evaluated is task and shared_items(task, evaluated) == []
