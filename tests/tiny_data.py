"""Tiny datasets in every registered format, written with PIL (tests and benchmarks).

``tiny_dataset(name, root, size)`` writes a small dataset of format ``name`` under ``root`` and returns the
``data.path`` to give it ("" for the built-in digits and words), as ``tiny_models.tiny_config`` does for models
(whose ``TinySpec.data`` names the format each adapter takes). Images are flat colours with a different colour per
row; masks keep the right half (white = repaint); references are a red centre on a blue border, so a centred style
crop is recognisably red.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

PROMPTS = ('a sign that says "OPEN"', "a red cat", 'a shop window with "SALE 50%"', "a blue dog")
COLOURS = ((200, 40, 40), (40, 200, 40), (40, 40, 200), (220, 220, 40))


def solid(path: Path, size: tuple[int, int], colour: tuple[int, int, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def half_mask(path: Path, size: tuple[int, int]) -> Path:
    """White (repaint) on the right half, black on the left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mask = Image.new("L", size, 0)
    mask.paste(255, (size[0] // 2, 0, size[0], size[1]))
    mask.save(path)
    return path


def framed(path: Path, size: tuple[int, int]) -> Path:
    """Blue with a red centre covering the middle half of each side."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", size, (0, 0, 255))
    w, h = size
    image.paste((255, 0, 0), (w // 4, h // 4, w - w // 4, h - h // 4))
    image.save(path)
    return path


def write_prompt_file(root: Path, suffix: str = ".txt", count: int = 4) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    if suffix == ".jsonl":
        path = root / "prompts.jsonl"
        path.write_text("".join(json.dumps({"prompt": p, "tag": "single_object"}) + "\n" for p in prompts))
    else:
        path = root / "prompts.txt"
        path.write_text("".join(p + "\n" for p in prompts))
    return path


def write_inpaint_jsonl(root: Path, size: int = 16, count: int = 4) -> Path:
    rows = []
    for i in range(count):
        solid(root / "images" / f"{i}.png", (size, size), COLOURS[i % len(COLOURS)])
        half_mask(root / "masks" / f"{i}.png", (size, size))
        rows.append(
            {"image_path": f"images/{i}.png", "mask_path": f"masks/{i}.png", "prompt": PROMPTS[i % len(PROMPTS)]}
        )
    path = root / "inpaint.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_edit_jsonl(root: Path, size: int = 16, count: int = 4, references: int = 1) -> Path:
    """Rows of one flat-coloured image to edit (``references`` > 1: a list of that many, in rotated colours)."""
    rows = []
    for i in range(count):
        paths = []
        for j in range(references):
            solid(root / "images" / f"{i}_{j}.png", (size, size), COLOURS[(i + j) % len(COLOURS)])
            paths.append(f"images/{i}_{j}.png")
        solid(root / "targets" / f"{i}.png", (size, size), COLOURS[(i + 1) % len(COLOURS)])
        rows.append(
            {
                "image_path": paths if references > 1 else paths[0],
                "target_path": f"targets/{i}.png",
                "prompt": f"make it {('green', 'blue', 'yellow', 'red')[i % 4]}",
            }
        )
    path = root / "edit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_triplet_folder(root: Path, size: int = 16, count: int = 4) -> Path:
    lines = []
    for i in range(count):
        sample = f"s{i:03d}"
        solid(root / f"{sample}_source.png", (size, size), COLOURS[i % len(COLOURS)])
        half_mask(root / f"{sample}_mask.png", (size, size))
        framed(root / f"{sample}_ref.png", (2 * size, 2 * size))
        lines.append(f"{sample}\t{PROMPTS[i % len(PROMPTS)]}")
    (root / "self_bench.txt").write_text("\n".join(lines) + "\n")
    return root


def tiny_dataset(name: str, root: str | Path, size: int = 16, suffix: str = ".txt", references: int = 1) -> str:
    """Write a tiny dataset of format ``name`` (a ``DATASETS`` key) under ``root``; returns its
    ``data.path`` ("" for the built-in tasks, which need no files). ``suffix`` picks .txt or .jsonl prompt files;
    ``references``, the images per editing row."""
    root = Path(root) / name
    writers = {
        "digits": lambda: "",
        "words": lambda: "",
        "moving_digits": lambda: "",
        "prompt_file": lambda: write_prompt_file(root, suffix),
        "inpaint_jsonl": lambda: write_inpaint_jsonl(root, size),
        "edit_jsonl": lambda: write_edit_jsonl(root, size, references=references),
        "triplet_folder": lambda: write_triplet_folder(root, size),
    }
    if name not in writers:
        raise ValueError(f"no tiny dataset writer for data.name={name!r}; add one to tests/tiny_data.py")
    return str(writers[name]())
