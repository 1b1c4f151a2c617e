"""The editing jsonl: one row per example, ``{"image_path": ..., "prompt": ...[, "target_path": ...]
[, other fields]}``; the prompt is the edit instruction and the image the one to edit. ``image_path`` may
be a list of paths: several reference images per row (Qwen-Image-Edit-Plus's "Picture 1", "Picture 2", ...),
as many in every row; the first is the one edited.

Paths are relative to the jsonl's folder, or absolute. ``target_path`` (the edited image, the same size)
is needed only for supervised training. The reward servers get ``judge_task: "edit"`` and the original as
``reference_image`` (the qwenvl judge rates instruction following against it) plus the row's other fields.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.data.images import ImageItem, ImageTask, image_size_of, resolve
from trainer.data.prompt_file import data_file, read_jsonl

NOT_METADATA = ("prompt", "image_path", "target_path")
"""Row keys that describe the files rather than the reward target."""


def read_edit_jsonl(path: str, image_size: int, image_inputs: Sequence[str] = ()) -> ImageTask:
    """Every row checked (files exist and decode, target size = image size); the first bad row raises a
    ValueError naming the file and line."""
    file = data_file(path, "an editing .jsonl with image_path and prompt per row")
    items, count = [], 0
    for number, record in read_jsonl(file):
        where = f"{file}:{number}"
        paths = record.get("image_path")
        several = isinstance(paths, list) and bool(paths)
        images = tuple(resolve(file.parent, p, "image_path", where) for p in (paths if several else [paths]))
        count = count or len(images)
        if len(images) != count:
            raise ValueError(
                f"{where}: {len(images)} image_path entries, but the first row has {count}; every row "
                "needs as many reference images"
            )
        image = images if several else images[0]
        size = image_size_of(images[0], where)
        target = None
        if record.get("target_path") is not None:
            target = resolve(file.parent, record["target_path"], "target_path", where)
            if image_size_of(target, where) != size:
                raise ValueError(
                    f"{where}: target {target} is {image_size_of(target, where)} pixels but the image "
                    f"to edit is {size}; they must be the same size"
                )
        extra = {k: v for k, v in record.items() if k not in NOT_METADATA}
        items.append(ImageItem(record["prompt"], where, reference=image, target=target, metadata=extra))
    return ImageTask(items, image_size, str(file), edit=True, image_inputs=image_inputs)
