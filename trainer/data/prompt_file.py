"""Prompt files in the formats users already have: one prompt per line (.txt), or GenEval-style
metadata (.jsonl with a ``prompt`` key and any other fields). RL-only: no supervised images, and the task
metric is left to the reward servers.

The jsonl record reader and the quoted-span rule live here and are shared by the image datasets, whose
rows are such records with image paths added."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from trainer.models.base import ImageInputs

_QUOTED = re.compile(r'"([^"]+)"')

EVAL_COUNT = 8
"""Items evaluated before and after training: the first ones of the file."""


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of ``prompt`` (the text a text-rendering prompt asks for), or None."""
    match = _QUOTED.search(prompt)
    return match.group(1) if match else None


def data_file(path: str, what: str) -> Path:
    """``data.path`` as a file, or a ValueError saying it is missing or a folder (``what``: the file expected)."""
    if not path:
        raise ValueError(f"data.path is not set: name the {what}")
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"data.path={path!r} is a folder: name the file in it ({what})")
    if not file.is_file():  # a relative path is read from the folder the run started in: say which file that is
        looked = "" if file.is_absolute() else f", looked for at {file.absolute()}"
        raise ValueError(f"data.path={path!r}: no such file ({what}{looked}): set data.path to it")
    return file


def text_lines(file: Path) -> list[str]:
    """The lines of a UTF-8 text file; a ValueError names the file, line and byte that are not UTF-8."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(
            f"{file}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): save it as UTF-8"
        ) from None


def read_jsonl(file: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line; a record must be a JSON object with a non-empty
    ``prompt``, else a ValueError names the file and line."""
    for number, line in enumerate(text_lines(file), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f'{file}:{number}: a record needs a non-empty "prompt"')
        yield number, record


class PromptFileTask:
    """Prompts from ``path``; metadata carries the record's fields (GenEval: ``tag``, ``include``,
    ``exclude``, ...) and, for text-rendering prompts, the quoted span as ``text`` (the OCR target)."""

    metric_names: tuple[str, ...] = ()
    metric_scorers: tuple[str, ...] = ()
    holds_out = True
    supervises = False  # prompts alone: no target images

    def __init__(self, path: str, eval_count: int = EVAL_COUNT):
        file = data_file(path, "a .txt with one prompt per line or a .jsonl")
        self.records = self._read(file)
        if not self.records:
            raise ValueError(f"data.path={path!r} holds no prompts")
        self.prompts = [r["prompt"] for r in self.records]
        self.eval_indices = list(range(min(eval_count, len(self.prompts))))
        self.eval_prompts = [self.prompts[i] for i in self.eval_indices]

    @staticmethod
    def _read(file: Path) -> list[dict]:
        suffix = file.suffix.lower()
        if suffix == ".jsonl":
            records = [record for _, record in read_jsonl(file)]
        elif suffix == ".txt":
            lines = text_lines(file)
            records = [{"prompt": line.strip()} for line in lines if line.strip()]
        else:
            raise ValueError(
                f"data.path={str(file)!r}: prompt_file reads .txt (one prompt per line) or .jsonl (one "
                f'JSON object with a "prompt" per line), not {file.suffix or "a file without a suffix"}; '
                "rename the file to the suffix of its format"
            )
        for record in records:
            text = quoted_text(record["prompt"])
            if text and "text" not in record:
                record["text"] = text
        return records

    def item_key(self, index: int) -> str:
        return self.prompts[index]

    def item_metadata(self, indices: list[int]) -> list[dict]:
        """Each item's own record (a prompt may repeat with other fields), without its prompt."""
        return [{k: v for k, v in self.records[i].items() if k != "prompt"} for i in indices]

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator, step: int = 0):
        raise ValueError("a prompt file has no images for supervised warm-up; set train.warmup_steps=0")

    def metrics(self, images: torch.Tensor, prompts: list[str], scores: dict) -> dict[str, float]:
        return {}
