"""The inpainting jsonl: one row per example,
``{"image_path": ..., "mask_path": ..., "prompt": ...[, "last_image_path": ...][, "t5_embedding_path": ...]
[, other fields]}``.

Paths are relative to the jsonl's folder, or absolute. The mask (white = repaint) must have the image's
size. The image is the source: its part outside the mask conditions the model, and the whole image is the
supervised target (the reference image inside the mask). Image-to-video reads ``image_path`` as the first frame
(``data.image_inputs: [image]``, the mask unused) and ``last_image_path``, in every row or none, as the last
(``data.image_inputs: [image, last_image]``). ``t5_embedding_path`` (precomputed T5 prompt
embeddings of other trainers) is accepted and not read: the adapters encode prompts with their own frozen
T5. Other fields travel to the reward servers as metadata, next to ``text`` (the prompt's quoted span)
and ``mask``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainer.data.images import ImageItem, ImageTask, check_mask, image_size_of, resolve
from trainer.data.prompt_file import data_file, read_jsonl

NOT_METADATA = ("prompt", "image_path", "mask_path", "last_image_path", "t5_embedding_path")
"""Row keys that describe the files rather than the reward target."""


def read_inpaint_jsonl(path: str, image_size: int, image_inputs: Sequence[str] = ()) -> ImageTask:
    """Every row checked (files exist and decode, mask size = image size, mask not empty at
    ``image_size``); the first bad row raises a ValueError naming the file and line."""
    file = data_file(path, "an inpainting .jsonl with image_path, mask_path and prompt per row")
    items = []
    for number, record in read_jsonl(file):
        where = f"{file}:{number}"
        image = resolve(file.parent, record.get("image_path"), "image_path", where)
        mask = resolve(file.parent, record.get("mask_path"), "mask_path", where)
        size = image_size_of(image, where)
        check_mask(mask, size, image_size, where)
        last = last_frame(file, record, (image, size), where, first=items[0] if items else None)
        extra = {k: v for k, v in record.items() if k not in NOT_METADATA}
        items.append(ImageItem(record["prompt"], where, image=image, mask=mask, last_image=last, metadata=extra))
    return ImageTask(items, image_size, str(file), image_inputs=image_inputs)


def last_frame(
    file: Path, record: dict, image: tuple[Path, tuple[int, int]], where: str, first: ImageItem | None
) -> Path | None:
    """The row's ``last_image_path`` (None without one), checked: present in every row or none (as in the first
    row), at the size of its ``image`` (path, size)."""
    value = record.get("last_image_path")
    last = None if value is None else resolve(file.parent, value, "last_image_path", where)
    if first is not None and (first.last_image is None) != (last is None):
        has = "has" if first.last_image is not None else "has no"
        raise ValueError(f'{where}: the first row {has} "last_image_path"; give it in every row or in none')
    if last is not None and (size := image_size_of(last, where)) != image[1]:
        (w, h), (iw, ih) = size, image[1]
        raise ValueError(
            f"{where}: last image {last} is {w}x{h} but its first frame {image[0]} is {iw}x{ih}; they must be the "
            "same size"
        )
    return last
