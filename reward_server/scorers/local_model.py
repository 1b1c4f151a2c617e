"""What the scorers that load a transformers model from ``--model-dir`` share (aesthetic, clip_score, hps,
imagereward): where the weights are, the device, required files, strict loading (never run with random weights),
the weights' fingerprint for ``/info``, and prompt tokenisation that reports truncation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from reward_server.scorers.fingerprint import sha256_files, weight_files
from scoring.weights import load_strict

__all__ = ["fingerprint", "load_strict", "pick_device", "require_files", "tokenize", "weights_dir"]


def weights_dir(model_dir: Path | None, folder: str) -> Path | None:
    """``<model_dir>/<folder>``, or None when the server has no ``--model-dir``."""
    return None if model_dir is None else Path(model_dir) / folder


def pick_device(device: str | None) -> torch.device:
    """``device``, by default CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def require_files(directory: Path, names: Sequence[str], fix: str) -> None:
    """FileNotFoundError ``no <name> in <directory>: <fix>`` for the first of ``names`` missing there."""
    for name in names:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"no {name} in {directory}: {fix}")


def fingerprint(directory: Path, extra: Sequence[Path] = ()) -> str:
    """12 hex characters of the SHA-256 of the weight files in ``directory`` (and ``extra`` files)."""
    return sha256_files(weight_files(directory) + list(extra))[:12]


def tokenize(tokenizer: Any, prompts: list[str], max_tokens: int, device: torch.device) -> tuple[Any, list[bool]]:
    """Padded token ids cut to ``max_tokens`` on ``device``, and for each prompt whether it was cut."""
    tokens = tokenizer(prompts, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt").to(device)
    truncated = [len(ids) > max_tokens for ids in tokenizer(prompts)["input_ids"]]
    return tokens, truncated
