"""The IP-Adapter triplet folder: ``self_bench.txt`` lists samples, one per line as ``<id><TAB><prompt>``
(or ``<id> <prompt>``: without a tab the id ends at the first whitespace), and the folder holds
``<id>_source.png`` (the image to inpaint), ``<id>_mask.png`` (white = repaint, the source's size) and
``<id>_ref.png`` (the reference whose style should fill the mask).

Image inputs: ``image`` = source, ``mask``, ``reference`` = the whole reference, and ``style`` = the
centred crop of the reference covering ``data.style_crop`` of each side (default 0.5: the middle quarter
of its area), resized to ``data.image_size``. The crop keeps the reference's texture and colours but not
its layout, so a policy cannot score by pasting the reference into the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainer.data.images import ImageItem, ImageTask, check_mask, image_size_of
from trainer.data.prompt_file import text_lines

LIST_FILE = "self_bench.txt"
STYLE_CROP = 0.5
"""Default side fraction of the style crop (``data.style_crop``)."""


def parse_line(line: str) -> tuple[str, str]:
    """(sample id, prompt) of a list line: split at the first tab if there is one, else at the first
    whitespace; either part may be empty (the caller reports it)."""
    text = line.strip()
    sample_id, _, prompt = text.partition("\t") if "\t" in text else text.partition(" ")
    return sample_id.strip(), prompt.strip()


def read_triplet_folder(
    path: str, image_size: int, style_crop: float = STYLE_CROP, image_inputs: Sequence[str] = ()
) -> ImageTask:
    """Every sample checked (its three files exist and decode, mask size = source size, mask not empty at
    ``image_size``); the first bad line raises a ValueError naming the list file and line."""
    folder = Path(path)
    bench = folder / LIST_FILE
    if not bench.is_file():
        raise ValueError(f"data.path={path!r}: no {LIST_FILE} there (a triplet folder lists its samples in it)")
    if not 0 < style_crop <= 1:
        raise ValueError(
            f"data.style_crop={style_crop} must be in (0, 1]: the side fraction of the reference "
            "kept as the style image"
        )
    items, seen = [], {}
    for number, line in enumerate(text_lines(bench), start=1):
        if not line.strip():
            continue
        where = f"{bench}:{number}"
        sample_id, prompt = parse_line(line)
        if not prompt:
            raise ValueError(f"{where}: expected '<sample id><TAB><prompt>', found no prompt in {line.strip()!r}")
        if sample_id in seen:
            raise ValueError(f"{where}: sample id {sample_id!r} already listed on line {seen[sample_id]}")
        seen[sample_id] = number
        files = {}
        for part in ("source", "mask", "ref"):
            files[part] = folder / f"{sample_id}_{part}.png"
            if not files[part].is_file():
                raise ValueError(f"{where}: {part} image {files[part]} does not exist")
        check_mask(files["mask"], image_size_of(files["source"], where), image_size, where)
        image_size_of(files["ref"], where)
        items.append(
            ImageItem(
                prompt,
                where,
                image=files["source"],
                mask=files["mask"],
                reference=files["ref"],
                metadata={"sample_id": sample_id},
            )
        )
    return ImageTask(items, image_size, str(bench), style_crop=style_crop, image_inputs=image_inputs)
