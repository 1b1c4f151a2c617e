"""The inpainting jsonl: one row per example,
``{"image_path": ..., "mask_path": ..., "prompt": ...[, "t5_embedding_path": ...][, other fields]}``.

Paths are relative to the jsonl's folder, or absolute. The mask (white = repaint) must have the image's
size. The image is the source: its part outside the mask conditions the model, and the whole image is the
supervised target (the reference image inside the mask). ``t5_embedding_path`` (precomputed T5 prompt
embeddings of other trainers) is accepted and not read: the adapters encode prompts with their own frozen
T5. Other fields travel to the reward servers as metadata, next to ``text`` (the prompt's quoted span)
and ``mask``.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.data.images import ImageItem, ImageTask, check_mask, image_size_of, resolve
from trainer.data.prompt_file import data_file, read_jsonl

NOT_METADATA = ("prompt", "image_path", "mask_path", "t5_embedding_path")
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
        check_mask(mask, image_size_of(image, where), image_size, where)
        extra = {k: v for k, v in record.items() if k not in NOT_METADATA}
        items.append(ImageItem(record["prompt"], where, image=image, mask=mask, metadata=extra))
    return ImageTask(items, image_size, str(file), image_inputs=image_inputs)
