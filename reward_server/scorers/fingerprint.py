"""Model fingerprints for ``/info``: the trainer checks that every replica serves the same weights."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path


def sha256_files(paths: Sequence[Path]) -> str:
    """SHA-256 over the names and contents of ``paths``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


def weight_files(directory: Path) -> list[Path]:
    """The weight files directly in ``directory``, sorted (what a fingerprint covers)."""
    return sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES)
