"""Atomic checkpoints and exact resume.

A checkpoint is one directory ``<run>/checkpoints/step-<warmup>-<epoch>``, written under a temporary name
and renamed when complete, so a crash or ``kill -9`` never leaves a half-written checkpoint that looks
whole. It holds the trainable weights (safetensors; LoRA in peft format), the optimizer state, named
tensor states of the loop's other parts (the frozen reference when it is a copy, the EMA, an algorithm's
own networks such as a critic) as ``<name>.safetensors``, the progress counters and the config.

No RNG state is stored because none is needed: every random stream of the loop (prompt choice, noise,
SDE window, minibatch order) is drawn from a generator seeded by (seed, rank, phase, step), so a resumed
run draws exactly the numbers the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^step-(\d+)-(\d+)$")


@dataclass
class Progress:
    """Where the schedule stands: the whole loop state besides weights and optimizer."""

    warmup_steps_done: int = 0
    epochs_done: int = 0
    rl_started: bool = False


class Checkpoints:
    """Saves to and finds checkpoints in ``directory``; only the main process writes."""

    def __init__(self, directory: Path, keep: int, is_main: bool):
        self.directory = directory
        self.keep = keep
        self.is_main = is_main

    def save(self, progress: Progress, adapter, backend, states: dict[str, dict[str, torch.Tensor]],
             config: dict) -> Path | None:
        """Write a complete checkpoint atomically (main process), then drop all but the newest ``keep``."""
        final = self.directory / f"step-{progress.warmup_steps_done:06d}-{progress.epochs_done:06d}"
        optimizer_state = backend.optimizer_state()  # collective on sharded backends: every rank calls it
        if self.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".incomplete-", dir=self.directory))
            adapter.save_trainable(str(tmp / "trainable"))
            torch.save(optimizer_state, tmp / "optimizer.pt")
            for name, tensors in states.items():
                save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / f"{name}.safetensors")
            (tmp / "progress.json").write_text(json.dumps(asdict(progress)))
            (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
            _fsync_tree(tmp)
            if final.exists():  # the same progress was saved before a resume: that copy is complete
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
            self._prune()
        backend.barrier()
        return final if self.is_main else None

    def latest(self) -> Path | None:
        """The newest complete checkpoint (temporary directories of interrupted writes are ignored)."""
        if not self.directory.is_dir():
            return None
        done = [p for p in self.directory.iterdir() if _NAME.match(p.name) and (p / "progress.json").is_file()]
        return max(done, key=lambda p: tuple(int(x) for x in _NAME.match(p.name).groups()), default=None)

    def load(self, path: Path, adapter, backend) -> tuple[Progress, dict[str, dict[str, torch.Tensor]]]:
        """Restore weights and optimizer from ``path``; returns the progress and the named states."""
        adapter.load_trainable(str(path / "trainable"))
        backend.load_optimizer_state(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        progress = Progress(**json.loads((path / "progress.json").read_text()))
        return progress, {f.name.removesuffix(".safetensors"): load_file(f) for f in path.glob("*.safetensors")}

    def _prune(self) -> None:
        for stale in self.directory.glob(".incomplete-*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if self.keep > 0:
            complete = sorted((p for p in self.directory.iterdir() if _NAME.match(p.name)),
                              key=lambda p: tuple(int(x) for x in _NAME.match(p.name).groups()))
            for old in complete[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def is_copy(reference: torch.nn.Module, adapter) -> bool:
    """True when the reference holds its own weights (a frozen copy), False when it wraps the policy."""
    policy = {p.data_ptr() for p in adapter.denoiser.parameters()}
    return not any(p.data_ptr() in policy for p in reference.parameters())


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
