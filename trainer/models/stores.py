"""Files shared by the precomputed stores (text embeddings, VAE latents): their fingerprints' file hashing
and their ``index.json``, read, extended and written atomically."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path


def hash_files(digest, root: Path, subfolders: Iterable[str]) -> None:
    """Add each file of ``root / sub`` to ``digest``: its name, size and the sha256 of its last MiB."""
    for sub in sorted(subfolders):
        for file in sorted(p for p in (root / sub).rglob("*") if p.is_file()):
            size = file.stat().st_size
            with open(file, "rb") as f:
                f.seek(max(0, size - 2**20))
                tail = hashlib.sha256(f.read()).hexdigest()
            digest.update(f"{file.relative_to(root)}:{size}:{tail}".encode())


def missing_store(setting: str, index_file: Path, command: str) -> str | None:
    """Why there is no precomputed store at ``index_file``'s folder (no folder, no index), naming ``setting`` and
    the ``command`` that writes it, or None (the run's pre-flight asks before the model loads)."""
    if not index_file.parent.is_dir():
        return f"{setting}: no such folder; write the store there with {command}"
    if not index_file.is_file():
        return f"{setting} holds no {index_file.name}; write it with {command}"
    return None


def read_index(setting: str, index_file: Path, fingerprint: str, other: str, covers: str, command: str) -> dict:
    """A precomputed store's index, or a ValueError naming ``setting`` and the ``command`` that writes it when
    the index is missing or was made for ``other`` (a fingerprint over ``covers``) than this model."""
    if (missing := missing_store(setting, index_file, command)) is not None:
        raise ValueError(missing)
    index = json.loads(index_file.read_text())
    if index["fingerprint"] != fingerprint:
        raise ValueError(
            f"{setting} was computed for {other} or settings (its fingerprint {index['fingerprint'][:12]}, "
            f"this model's {fingerprint[:12]}: {covers}); recompute it for this model.path with {command}"
        )
    return index


INDEX_SAVE_EVERY = 256
"""Entries a precomputing store adds between two writes of its index: what a killed ``trainer.precompute``
recomputes at most (an exception saves the index as it unwinds)."""


def index_to_extend(directory: str, name: str, fingerprint: str, refusal: str) -> dict | None:
    """The index ``name`` of a store being written in ``directory`` (created when missing), None for a new
    store; a ValueError with ``refusal`` when it was written for another ``fingerprint``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / name).is_file():
        return None
    index = json.loads((out / name).read_text())
    if index["fingerprint"] != fingerprint:
        raise ValueError(refusal)
    return index


def write_index(file: Path, index: dict) -> None:
    """Write a store's index atomically: a reader sees the old index or the new one, never a part."""
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(index, indent=0, ensure_ascii=False))
    os.replace(tmp, file)


def require_stored_prompts(adapter, prompts: list[str], guidance_scales, store: str, data) -> None:
    """Refuse a ``model.text_embeddings`` store that lacks one of ``prompts``, naming the command that adds them."""
    missing = adapter.missing_prompts(prompts, guidance_scales)
    if missing:
        raise ValueError(
            f"model.text_embeddings={store!r} lacks {len(missing)} of the prompts this run encodes "
            f"(e.g. {', '.join(repr(p) for p in missing[:3])}): add them with python -m "
            f"trainer.precompute --config RUN.yaml --out {store}, RUN.yaml holding this run's data "
            f"settings (data.name={data.name}, data.path={data.path!r}): it encodes just the prompts the "
            "store lacks"
        )
