"""Every preset's header, data paths and test split: the header's reward-server and training commands agree with
reward.urls and with each other, and start every weighted reward scorer; repository-relative data paths exist and
load; no preset evaluates on a prompt it trains on."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trainer.algorithms import build_algorithm
from trainer.config import load_config
from trainer.data import build_task, build_tasks, training_items
from trainer.data.sampler import GroupSampler

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "configs" / "presets").glob("*.yaml"))


def _id(path: Path) -> str:
    return str(path.relative_to(REPO / "configs"))


def _relative_data(path: Path) -> bool:
    data = load_config(str(path)).data.path
    return bool(data) and not Path(data).is_absolute()


IN_REPOSITORY = [p for p in PRESETS if _relative_data(p)]
"""Presets whose data is in the repository (data/); the others name a placeholder for the user's own."""


def test_presets_train_and_evaluate_on_data_in_the_repository():
    assert len(IN_REPOSITORY) >= 10  # the PickScore, OCR and GenEval presets train and evaluate on data/


def _header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


@pytest.mark.parametrize("path", PRESETS, ids=_id)
def test_preset_header_starts_the_replicas_reward_urls_names_beside_the_training_gpus(path):
    """The header's commands fit each other and the file: run_server.sh starts as many replicas as reward.urls
    names (one per GPU it is given, ports 8000 up), training runs on GPUs no replica holds, and the epoch's
    samples divide over its --nproc_per_node. run_server.sh's default, one replica per visible GPU, used to
    put a model on each of the 8 training GPUs, of which reward.urls named one."""
    header = _header(path)
    serve = re.search(r"^#   CUDA_VISIBLE_DEVICES=(\S*) \./run_server\.sh start --replicas (\d+) ", header, re.M)
    train = re.search(
        r"^#   CUDA_VISIBLE_DEVICES=(\S+) torchrun --nproc_per_node=(\d+) trainer/main\.py ", header, re.M
    )
    assert serve and train, header
    reward_gpus, train_gpus = [gpu for gpu in serve[1].split(",") if gpu], train[1].split(",")
    replicas, nproc = int(serve[2]), int(train[2])
    assert not set(reward_gpus) & set(train_gpus) and nproc == len(train_gpus), header
    assert not reward_gpus or replicas == len(reward_gpus), header
    config = load_config(str(path))
    assert config.reward.urls == [f"http://127.0.0.1:{8000 + i}" for i in range(replicas)]
    algorithm = build_algorithm(config.algorithm)
    sampler = GroupSampler(1, config.data.prompts_per_epoch, algorithm.group_size, nproc, 0, 0, algorithm.local_groups)
    assert sampler.per_rank % getattr(config.algorithm, "steps_per_epoch", 1) == 0


@pytest.mark.parametrize("path", PRESETS, ids=_id)
def test_preset_header_says_what_to_set_and_which_servers_to_start(path):
    """The leading comment names what it trains, the paths to set and a start command serving every
    weighted scorer; data paths relative to the repository root (where the job is started) exist."""
    header = _header(path)
    assert (
        "Set:" in header
        and "Reward servers:" in header
        and f"trainer/main.py --config configs/presets/{path.name}" in header
    ), header
    config = load_config(str(path))
    served = {name for names in re.findall(r"--scorers ([a-z0-9_,]+)", header) for name in names.split(",")}
    weighted = {name for name, weight in config.reward.weights.items() if weight != 0}
    assert weighted <= served, (
        f"{path.name}: reward.weights resolve to {config.reward.weights}, but the header starts {sorted(served)}"
    )


def _in_repository(config):
    """``config`` with its relative data.path and eval.path read from the repository root, where jobs start."""
    data, evaluation = config.data, config.eval
    for setting, value in (("data.path", data.path), ("eval.path", evaluation.path)):
        if value and not Path(value).is_absolute():
            file = (REPO / value).resolve()
            assert file.is_relative_to(REPO.resolve()) and file.is_file(), (
                f"{setting}={value} is not a file in the checkout"
            )
    return (
        dataclasses.replace(data, path=str(REPO / data.path)),
        dataclasses.replace(evaluation, path=str(REPO / evaluation.path)) if evaluation.path else evaluation,
    )


@pytest.mark.parametrize("path", IN_REPOSITORY, ids=_id)
def test_preset_data_path_relative_to_the_repository_loads(path):
    """A relative data.path or eval.path (absolute ones are placeholders for the user's data) is read from the
    repository root, where the job starts: it must be a file inside the checkout (a clone has nothing beside it,
    where ../shared/data used to be read) and load in data.name's format."""
    data, evaluation = _in_repository(load_config(str(path)))
    build_task(data)
    if evaluation.path:
        build_task(dataclasses.replace(data, path=evaluation.path))


@pytest.mark.parametrize("path", PRESETS, ids=_id)
def test_preset_never_evaluates_on_prompts_it_trains_on(path):
    """Through the job's own builders (build_tasks): the prompts RL samples and every prompt of the evaluation's
    file share none, and the evaluation reads a test split of its own (eval.path). A preset on the user's data (an
    absolute placeholder) names no eval.path (its evaluation is data.path's first items, which RL leaves out) or a
    placeholder of its own for the user's test split."""
    config = load_config(str(path))
    assert not config.eval.allow_overlap
    if path not in IN_REPOSITORY:
        # the user's own files: no test split, or a placeholder for the user's own test split beside the train one
        assert Path(config.data.path).is_absolute(), path.name
        assert not config.eval.path or (Path(config.eval.path).is_absolute() and config.eval.path != config.data.path)
        return
    task, evaluated = build_tasks(*_in_repository(config))
    trained = {task.prompts[i] for i in training_items(task)}
    assert evaluated is not task and len(trained) > 100 and len(evaluated.prompts) > 1000
    assert not trained & set(evaluated.prompts), sorted(trained & set(evaluated.prompts))[:3]
