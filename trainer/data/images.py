"""Image datasets (inpainting, editing, IP-Adapter triplets) as one task over items read by format readers.

A format reader (``inpaint_jsonl``, ``edit_jsonl``, ``triplet_folder``) turns its files into
:class:`ImageItem` records and checks every file while doing so, so a bad row stops the run before
training with the file and line named. :class:`ImageTask` then serves the items to the trainer: pixels
(decoded on use, each distinct item once per call), per-item reward metadata, supervised batches.

Conventions: images are RGB in [0, 1], masks 1 channel with 1 = repaint (binarised at 0.5 after
resizing), all resized to ``data.image_size`` square (the aspect ratio is not kept: prepare square images
to avoid distortion). The model generates at ``model.resolution``; the two must be equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from trainer.data.prompt_file import EVAL_COUNT, quoted_text
from trainer.data.task import SupervisedBatch
from trainer.models.base import ImageInputs


def resolve(base: Path, value: object, key: str, where: str) -> Path:
    """``value`` (a path relative to ``base``, or absolute) as an existing file, else a ValueError."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f'{where}: "{key}" must be a path (relative to {base} or absolute)')
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise ValueError(f"{where}: {key} {path} does not exist")
    return path


def image_size_of(path: Path, where: str) -> tuple[int, int]:
    """(width, height) of an image file that decodes completely, else a ValueError.

    The whole image is decoded, once per file: PIL's ``verify`` reads little more than the header for
    most formats (JPEG), so a truncated file would pass it and fail mid-training."""
    try:
        with Image.open(path) as image:
            size = image.size
            image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{where}: {path} is not a readable image (unknown format)") from None
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"{where}: {path} is not a readable image ({exc})") from None
    return size


def _open(path: Path, mode: str, where: str) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.convert(mode)
    except UnidentifiedImageError:
        raise ValueError(f"{where}: {path} is not a readable image (unknown format)") from None
    except OSError as exc:
        raise ValueError(f"{where}: {path} is not a readable image ({exc})") from None


def _to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array.reshape(image.height, image.width, -1)).permute(2, 0, 1).contiguous()


def load_rgb(path: Path, size: int, where: str, crop: float = 1.0) -> torch.Tensor:
    """[3, size, size] in [0, 1]: the image (or its centred crop of ``crop`` times each side), resized."""
    image = _open(path, "RGB", where)
    if crop < 1.0:
        w, h = image.size
        cw, ch = max(1, round(w * crop)), max(1, round(h * crop))
        left, top = (w - cw) // 2, (h - ch) // 2
        image = image.crop((left, top, left + cw, top + ch))
    return _to_tensor(image.resize((size, size), Image.Resampling.BICUBIC)).clamp(0, 1)


def load_references(paths: Path | tuple[Path, ...], size: int, where: str) -> torch.Tensor:
    """[3, size, size] for one reference image, [N, 3, size, size] for a tuple of N."""
    if isinstance(paths, tuple):
        return torch.stack([load_rgb(path, size, where) for path in paths])
    return load_rgb(paths, size, where)


def load_mask(path: Path, size: int, where: str) -> torch.Tensor:
    """[1, size, size] of 0/1: the mask's luminance resized and binarised at 0.5 (1 = repaint)."""
    image = _open(path, "L", where).resize((size, size), Image.Resampling.BILINEAR)
    return (_to_tensor(image) >= 0.5).float()


def check_mask(mask: Path, image_size: tuple[int, int], size: int, where: str) -> None:
    """The mask file matches its image's size and keeps at least one repaint pixel at ``size``."""
    mask_size = image_size_of(mask, where)
    if mask_size != image_size:
        raise ValueError(
            f"{where}: mask {mask} is {mask_size[0]}x{mask_size[1]} but its image is "
            f"{image_size[0]}x{image_size[1]}; they must be the same size"
        )
    if not load_mask(mask, size, where).any():
        raise ValueError(f"{where}: mask {mask} has no pixel to repaint at data.image_size={size} (white = repaint)")


def to_uint8_hwc(image: torch.Tensor) -> np.ndarray:
    """[C, H, W] in [0, 1] -> uint8 [H, W, C], the reward servers' image layout."""
    return (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


@dataclass
class ImageItem:
    """One dataset row: a prompt, the files of its image inputs and the metadata it carries."""

    prompt: str
    where: str
    """``file:line`` of the row, named in errors about it."""
    image: Path | None = None
    """Inpainting source (the image inside the mask is repainted; it is also the supervised target)."""
    mask: Path | None = None
    reference: Path | tuple[Path, ...] | None = None
    """Editing: the image to edit (a tuple: several references, the first edited). IP-Adapter: the reference
    the style image is cropped from."""
    target: Path | None = None
    """Supervised target when it is not ``image`` (editing: the edited image)."""
    last_image: Path | None = None
    """Image-to-video: the frame the video ends on (``image`` is its first frame)."""
    metadata: dict = field(default_factory=dict)
    """Row fields for the reward servers (e.g. ``text``, the OCR target)."""


class ImageTask:
    """A Task over image items. ``style_crop`` > 0 adds ``ImageInputs.style``: the centred crop of the
    reference of that fraction of each side (IP-Adapter), resized to ``image_size``. ``image_inputs``
    names the inputs handed to the model (empty: every one the format has), because adapters reject
    inputs they do not use: e.g. only ``style`` for a text-to-image model with an IP-Adapter.

    Reward metadata per item: the row's fields (and ``text``, the prompt's quoted span, when the row has
    none); with a mask, ``mask``: uint8 [H, W, 1] (0 / 255, at ``image_size``), the key the OCR scorer
    reads to score only the repainted region; with ``edit``, ``judge_task: "edit"`` and
    ``reference_image``: the reference, uint8 [H, W, 3], which the qwenvl judge compares against (arrays in
    metadata travel as images: the server's size and pixel limits apply to them)."""

    metric_names: tuple[str, ...] = ()
    metric_scorers: tuple[str, ...] = ()
    holds_out = True
    supervises = True

    def __init__(
        self,
        items: list[ImageItem],
        image_size: int,
        source: str,
        *,
        style_crop: float = 0.0,
        edit: bool = False,
        image_inputs: Sequence[str] = (),
    ):
        if not items:
            raise ValueError(f"{source} holds no rows")
        if image_size < 1:
            raise ValueError(f"data.image_size={image_size} must be the model's resolution in pixels")
        self.items = items
        self.image_size = image_size
        self.style_crop = style_crop
        self.edit = edit
        first = items[0]
        provided = [
            name
            for name, path in (
                ("image", first.image),
                ("mask", first.mask),
                ("reference", first.reference),
                ("style", first.reference),
                ("last_image", first.last_image),
            )
            if path is not None and (name != "style" or style_crop > 0)
        ]
        unknown = [name for name in image_inputs if name not in provided]
        if unknown:
            raise ValueError(
                f"data.image_inputs={list(image_inputs)} names {', '.join(unknown)}; {source} provides "
                f"{', '.join(provided)}"
            )
        self.image_inputs = tuple(image_inputs) or tuple(provided)
        self.prompts = [item.prompt for item in items]
        self.eval_indices = list(range(min(EVAL_COUNT, len(items))))
        self.eval_prompts = [self.prompts[i] for i in self.eval_indices]
        for item in items:
            if "text" not in item.metadata and (text := quoted_text(item.prompt)):
                item.metadata["text"] = text

    def _pixels(self, index: int) -> dict[str, torch.Tensor]:
        item, size = self.items[index], self.image_size
        load = {
            "image": lambda: load_rgb(item.image, size, item.where),
            "mask": lambda: load_mask(item.mask, size, item.where),
            "reference": lambda: load_references(item.reference, size, item.where),
            "style": lambda: load_rgb(item.reference, size, item.where, self.style_crop),
            "last_image": lambda: load_rgb(item.last_image, size, item.where),
        }
        return {name: load[name]() for name in self.image_inputs}

    def _stack(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """Each distinct item decoded once (a group repeats its item ``group_size`` times)."""
        decoded = {i: self._pixels(i) for i in dict.fromkeys(indices)}
        names = decoded[indices[0]].keys()
        return {name: torch.stack([decoded[i][name] for i in indices]) for name in names}

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return ImageInputs(**self._stack(indices)) if indices else None

    def item_key(self, index: int) -> tuple:
        """The prompt and the resolved files of the item's image inputs: the same instruction on another image
        is another example."""
        item = self.items[index]
        references = item.reference if isinstance(item.reference, tuple) else (item.reference,)
        files = (item.image, item.mask, *references, item.last_image)
        return item.prompt, *(None if p is None else p.resolve() for p in files)

    def item_metadata(self, indices: list[int]) -> list[dict]:
        distinct = {i: self._reward_metadata(i) for i in dict.fromkeys(indices)}
        return [dict(distinct[i]) for i in indices]

    def _reward_metadata(self, index: int) -> dict:
        item = self.items[index]
        meta = dict(item.metadata)
        if item.mask is not None:
            meta["mask"] = to_uint8_hwc(load_mask(item.mask, self.image_size, item.where))
        if self.edit:
            meta["judge_task"] = "edit"
            first = item.reference[0] if isinstance(item.reference, tuple) else item.reference
            meta["reference_image"] = to_uint8_hwc(load_rgb(first, self.image_size, item.where))
        return meta

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0) -> SupervisedBatch:
        """Random items; the target is ``target`` where rows have one (editing), else the source image
        (inpainting: the reference image inside the mask)."""
        usable = [i for i, item in enumerate(self.items) if (item.target or item.image) is not None]
        if not usable:
            raise ValueError(
                "these rows have no target images for supervised training (editing rows need "
                '"target_path"); set train.warmup_steps=0'
            )
        picks = torch.randint(len(usable), (batch_size,), generator=generator).tolist()
        indices = [usable[p] for p in picks]
        targets = torch.stack(
            [
                load_rgb(self.items[i].target or self.items[i].image, self.image_size, self.items[i].where)
                for i in indices
            ]
        )
        return SupervisedBatch(targets, [self.prompts[i] for i in indices], self.inputs(indices))

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict) -> dict[str, float]:
        return {}
