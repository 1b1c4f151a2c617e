"""Prompt files in the formats users already have: one prompt per line (.txt), or GenEval-style
metadata (.jsonl with a ``prompt`` key and any other fields). RL-only: no supervised images, and the task
metric is left to the reward servers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from trainer.models.base import ImageInputs

_QUOTED = re.compile(r'"([^"]+)"')


class PromptFileTask:
    """Prompts from ``path``; metadata carries the record's fields and, for text-rendering prompts, the
    quoted span as ``text`` (the OCR target)."""

    def __init__(self, path: str, eval_count: int = 8):
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"data.path={path!r}: no such file (a .txt with one prompt per line or a .jsonl)")
        self.records = self._read(file)
        if not self.records:
            raise ValueError(f"data.path={path!r} holds no prompts")
        self.prompts = [r["prompt"] for r in self.records]
        self.eval_prompts = self.prompts[:eval_count]
        self._meta = {r["prompt"]: r for r in self.records}

    @staticmethod
    def _read(file: Path) -> list[dict]:
        records = []
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            if file.suffix == ".jsonl":
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{file}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or not str(record.get("prompt", "")).strip():
                    raise ValueError(f"{file}:{number}: a record needs a non-empty \"prompt\"")
            else:
                record = {"prompt": line.strip()}
            quoted = _QUOTED.search(record["prompt"])
            if quoted and "text" not in record:
                record["text"] = quoted.group(1)
            records.append(record)
        return records

    def metadata(self, prompt: str) -> dict:
        return {k: v for k, v in self._meta[prompt].items() if k != "prompt"}

    def inputs(self, indices: list[int]) -> ImageInputs | None:
        return None

    def supervised_batch(self, batch_size: int, generator: torch.Generator):
        raise ValueError("a prompt file has no images for supervised warm-up; set train.warmup_steps=0")

    def metrics(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        return {}
