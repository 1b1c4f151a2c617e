"""Tasks and datasets, registered by name: where prompts, supervised examples and task metrics come from.

Formats (``data.name``): ``digits`` (the embedded task), ``words`` (the embedded text task), ``moving_digits`` (the
embedded video task), ``prompt_file`` (.txt
prompts or GenEval-style
.jsonl), ``inpaint_jsonl`` (image, mask, prompt rows), ``edit_jsonl`` (image to edit, instruction rows),
``triplet_folder`` (IP-Adapter source / mask / reference triplets). A bad row fails when the task is built,
before training, naming its file and line.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shared.registry import Entry, Registry
from trainer.data.digits import DigitAccuracy, DigitImages, digit_prompt
from trainer.data.edit_jsonl import read_edit_jsonl
from trainer.data.inpaint_jsonl import read_inpaint_jsonl
from trainer.data.moving_digits import MovingDigitsTask
from trainer.data.prompt_file import PromptFileTask
from trainer.data.task import SupervisedBatch, Task, training_items
from trainer.data.triplet_folder import read_triplet_folder
from trainer.data.words import WordsTask
from trainer.models.base import ImageInputs


class DigitsTask:
    """Generate the handwritten digit named in the prompt (scikit-learn's digits)."""

    metric_names = ("digit_accuracy",)
    metric_scorers = ()
    holds_out = False
    supervises = True

    def __init__(self, image_size: int):
        self.prompts = [digit_prompt(d) for d in range(10)]
        self.eval_indices = list(range(10))
        self.eval_prompts = list(self.prompts)
        self._images = DigitImages(image_size)
        self._accuracy: DigitAccuracy | None = None

    def metadata(self, prompt: str) -> dict:
        return {"digit": int(prompt.strip()[-1])}

    def item_key(self, index: int) -> str:
        return self.prompts[index]

    def item_metadata(self, indices: list[int]) -> list[dict]:
        return [self.metadata(self.prompts[i]) for i in indices]

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0) -> SupervisedBatch:
        images, prompts = self._images.batch(batch_size, generator)
        return SupervisedBatch(images, prompts)

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict) -> dict[str, float]:
        if self._accuracy is None:
            self._accuracy = DigitAccuracy()
        return {"digit_accuracy": self._accuracy(images, prompts)}


def _digits_task(config) -> DigitsTask:
    if config.path:
        raise ValueError(
            f"data.path={config.path!r} is not read by data.name='digits' (the embedded task); "
            "set data.name to the file's format (prompt_file, inpaint_jsonl, edit_jsonl, "
            "triplet_folder) or remove data.path"
        )
    _refuse_image_inputs(config)
    return DigitsTask(config.image_size)


def _words_task(config) -> WordsTask:
    if config.path:
        raise ValueError(
            f"data.path={config.path!r} is not read by data.name='words' (the embedded text task, "
            "whose vocabulary is built in); remove data.path"
        )
    _refuse_image_inputs(config)
    return WordsTask(config.image_size)


def _moving_digits_task(config) -> MovingDigitsTask:
    if config.path:
        raise ValueError(
            f"data.path={config.path!r} is not read by data.name='moving_digits' (the embedded video task); "
            "remove data.path"
        )
    _refuse_image_inputs(config)
    return MovingDigitsTask(config.image_size, misnamed_share=config.misnamed_share, misnamed_from=config.misnamed_from)


def _prompt_file_task(config) -> PromptFileTask:
    _refuse_image_inputs(config)
    return PromptFileTask(config.path)


def _refuse_image_inputs(config) -> None:
    if config.image_inputs:
        raise ValueError(
            f"data.image_inputs={list(config.image_inputs)} but data.name={config.name!r} gives no "
            "image inputs; remove data.image_inputs or pick a format with images (inpaint_jsonl, "
            "edit_jsonl, triplet_folder)"
        )


DATASETS = Registry(
    {
        "digits": Entry(_digits_task),
        "words": Entry(_words_task),
        "moving_digits": Entry(_moving_digits_task),
        "prompt_file": Entry(_prompt_file_task),
        "inpaint_jsonl": Entry(
            lambda config: read_inpaint_jsonl(config.path, config.image_size, list(config.image_inputs))
        ),
        "edit_jsonl": Entry(lambda config: read_edit_jsonl(config.path, config.image_size, list(config.image_inputs))),
        "triplet_folder": Entry(
            lambda config: read_triplet_folder(
                config.path, config.image_size, config.style_crop, list(config.image_inputs)
            )
        ),
    },
    key="data.name",
)
"""Format name (``data.name``) -> the task it builds from a DataConfig."""


def build_task(config) -> Task:
    """The task ``config.name`` (a DataConfig) names."""
    return DATASETS[config.name](config)


class DataProblems(ValueError):
    """Every problem of the files ``data.path`` and ``eval.path`` name (one line each), found together."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def build_tasks(data, ev) -> tuple[Task, Task]:
    """(the task RL samples, the task the evaluation samples) of a DataConfig and an EvalConfig: the second is
    ``eval.path`` read in ``data.name``'s format (RL then keeps every item of ``data.path``), or else the first
    itself with its held-out items; its evaluation is cut to the first ``eval.prompts`` items. A bad
    ``data.path`` does not hide a bad ``eval.path``: ``DataProblems`` names both."""
    try:
        task = build_task(data)
    except ValueError as exc:
        problems = [str(exc)]
        if ev.path and data.name in DATASETS:
            try:
                _eval_file_task(data, ev.path)
            except ValueError as also:
                problems.append(str(also))
        raise DataProblems(problems) from None
    if not ev.path:
        source = f"data.path={data.path!r}" if task.holds_out else f"data.name={data.name!r}"
        _evaluate_first(task, ev.prompts, source)
        return task, task
    if not task.holds_out:  # an embedded task's prompts are its classes
        raise ValueError(
            f"eval.path={ev.path!r} is not read by data.name={data.name!r}, an embedded task that "
            "evaluates its own prompts; remove eval.path"
        )
    evaluated = _eval_file_task(data, ev.path)
    _evaluate_first(evaluated, ev.prompts or len(evaluated.prompts), f"eval.path={ev.path!r}")
    task.eval_indices, task.eval_prompts = [], []
    shared = shared_items(task, evaluated)
    if shared and not ev.allow_overlap:
        raise ValueError(
            f"data.path={data.path!r} and eval.path={ev.path!r} share {describe_shared(shared)}: an "
            "evaluation on examples RL trains on measures memorisation; remove them from one of the "
            "files, or set eval.allow_overlap=true to run anyway"
        )
    return task, evaluated


def shared_items(task: Task, evaluated: Task) -> list[str | tuple]:
    """The distinct ``item_key``s (prompt, and image files where there are some) of the items RL samples from
    ``task`` that ``evaluated`` (an eval.path task) also holds anywhere in its file, in RL's order; none where the
    evaluation is ``task``'s own held-out items."""
    if evaluated is task:
        return []
    held = {evaluated.item_key(i) for i in range(len(evaluated.prompts))}
    return list(dict.fromkeys(key for key in map(task.item_key, training_items(task)) if key in held))


def describe_shared(keys: list[str | tuple]) -> str:
    """ "N prompts (first three: ...)" of ``shared_items``' keys, for messages."""
    prompts = [key if isinstance(key, str) else key[0] for key in keys]
    what = "prompts" if all(isinstance(key, str) for key in keys) else "items (prompt and image files)"
    return f"{len(keys)} {what} (first three: {', '.join(repr(p) for p in prompts[:3])})"


def _eval_file_task(data, path: str) -> Task:
    """``eval.path`` read in ``data.name``'s format; its reader's errors, which name the file as data.path, name
    it as eval.path."""
    try:
        return build_task(replace(data, path=path))
    except ValueError as exc:
        raise ValueError(
            str(exc).replace(f"data.path={path!r}", f"eval.path={path!r}").replace("set data.path", "set eval.path")
        ) from None


def _evaluate_first(task: Task, count: int, source: str) -> None:
    """Evaluate ``task``'s first ``count`` items (0: keep its own choice); ``source`` names where they come from."""
    if count > len(task.prompts):
        raise ValueError(
            f"eval.prompts={count} but {source} has {len(task.prompts)} items: set eval.prompts to at "
            "most that (0: the default choice)"
        )
    if count:
        task.eval_indices = list(range(count))
        task.eval_prompts = [task.prompts[i] for i in task.eval_indices]


__all__ = [
    "DATASETS",
    "DataProblems",
    "DigitsTask",
    "MovingDigitsTask",
    "PromptFileTask",
    "SupervisedBatch",
    "Task",
    "WordsTask",
    "build_task",
    "build_tasks",
    "describe_shared",
    "shared_items",
    "training_items",
]
