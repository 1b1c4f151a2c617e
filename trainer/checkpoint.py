"""Atomic checkpoints and exact resume, under every parallel backend.

A checkpoint is one directory ``<run>/checkpoints/step-<warmup>-<epoch>``, written under a temporary name
and renamed when complete (after every rank has written its part), so a crash or ``kill -9`` never leaves a
half-written checkpoint that looks whole. It holds:

- ``trainable.safetensors``: the full trainable weights by parameter name (LoRA weights only, with LoRA),
  gathered from every rank's shards under FSDP2 / ZeRO-3, so they do not depend on the backend or the world
  size; ``python -m trainer.export`` turns them into a diffusers model;
- the optimizer state: ``optimizer.pt`` (the full state, from rank 0), or one ``rank-<r>/optimizer.pt`` per
  rank under DeepSpeed (its ZeRO partition; resume then needs the same world size);
- the components' named tensor states (``trainer.state.State``: the EMA, the reference, an algorithm's
  networks) as ``<name>.safetensors``, or ``rank-<r>/<name>.safetensors`` for those each rank keeps itself;
- ``rank-<r>/rng.pt``: every rank's global RNG states (torch, CUDA, numpy, python). The loop draws its own
  streams from generators seeded per step, but dropout or library code may use the global ones;
- the progress counters, the config and ``backend.json`` (which backend wrote it, on how many ranks).

The run directory must be on a filesystem every rank sees (rank 0 renames what all ranks wrote).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from trainer.disk import diagnosed_writes
from trainer.state import State

_NAME = re.compile(r"^step-(\d+)-(\d+)$")


@dataclass
class Progress:
    """Where the schedule stands: the whole loop state besides weights and optimizer."""

    warmup_steps_done: int = 0
    epochs_done: int = 0
    rl_started: bool = False
    rl_steps: int = 0
    skipped_in_a_row: int = 0  # optimizer steps with non-finite gradients since the last finite one
    eval_due: bool = False  # stopped by a signal before the evaluation after epoch ``epochs_done``

    def save(self, directory: Path) -> None:
        (directory / "progress.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, directory: Path) -> Progress:
        return cls(**json.loads((directory / "progress.json").read_text()))


class Checkpoints:
    """Saves to and finds checkpoints in ``directory``; rank 0 writes the shared files, every rank its own."""

    def __init__(self, directory: Path, keep: int, is_main: bool, train=None):
        """``train``: the config's train section, whose schedule ``due`` follows (without it: none)."""
        self.directory = directory
        self.keep = keep
        self.is_main = is_main
        self.train = train

    def due(self, progress: Progress) -> bool:
        """Whether the schedule checkpoints ``progress``: ``train.warmup_checkpoint_every`` warm-up steps, then
        ``train.checkpoint_every`` RL epochs (the last of each is left to what follows it)."""
        if self.train is None:
            return False
        if progress.rl_started:
            every, done, end = self.train.checkpoint_every, progress.epochs_done, self.train.epochs
        else:
            every, done, end = self.train.warmup_checkpoint_every, progress.warmup_steps_done, self.train.warmup_steps
        return bool(every) and done % every == 0 and done < end

    def save(self, progress: Progress, adapter, backend, states: dict[str, State], config: dict) -> Path | None:
        """Write a complete checkpoint atomically, then drop all but the newest ``keep``. Every rank calls
        it (gathering sharded weights is collective). ``states``: the components' named tensor states (rank
        0 writes the shared ones, every rank its own); returns the directory on rank 0."""
        final = self.directory / f"step-{progress.warmup_steps_done:06d}-{progress.epochs_done:06d}"
        written = write_atomically(final, progress, adapter, backend, states, config)
        if self.is_main:
            self._prune()
        backend.barrier()
        return written

    def latest(self) -> Path | None:
        """The newest complete checkpoint (temporary directories of interrupted writes are ignored)."""
        done = self.complete()
        return done[-1] if done else None

    def newest_loadable(self, backend) -> Path | None:
        """The newest complete checkpoint whose files can be read (``damaged``: a disk fault, a copy cut short),
        checked by rank 0 for every rank. A newer damaged one is renamed ``damaged-<name>-<time>``, out of the way
        of the checkpoint that will take its name, and said; none loadable among several is an error naming why."""
        found, refusal = self._newest_loadable() if self.is_main else (None, None)
        found, refusal = backend.broadcast((found, refusal))
        if refusal:
            raise ValueError(refusal)
        return found

    def _newest_loadable(self) -> tuple[Path | None, str | None]:
        skipped = []
        for path in reversed(self.complete()):
            if (why := damaged(path)) is None:
                for newer, reason in skipped:
                    aside = newer.with_name(f"damaged-{newer.name}-{time.strftime('%Y%m%d-%H%M%S')}")
                    os.rename(newer, aside)
                    print(
                        f"warning: checkpoint {newer} cannot be loaded ({reason}); kept as {aside.name}, and the run "
                        f"continues from {path.name}",
                        flush=True,
                    )
                return path, None
            skipped.append((path, why))
        if not skipped:
            return None, None
        return None, (
            f"train.resume=auto: no checkpoint in {self.directory} can be loaded (the newest: "
            f"{skipped[0][1]}): restore them from a copy, or start the run anew under another "
            "logging.run_name"
        )

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        done = [p for p in self.directory.iterdir() if _NAME.match(p.name) and (p / "progress.json").is_file()]
        return sorted(done, key=lambda p: tuple(int(x) for x in _NAME.match(p.name).groups()))

    def load(self, path: Path, adapter, backend) -> tuple[Progress, dict[str, dict[str, torch.Tensor]]]:
        """Restore weights, optimizer and this rank's RNG states from ``path`` (every rank calls it);
        returns the progress and the named states (the shared ones and this rank's own)."""
        saved = json.loads((path / "backend.json").read_text())
        here = _backend_meta(backend)
        if saved["optimizer"] != here["optimizer"] or (
            backend.sharded_optimizer_state and saved["world_size"] != here["world_size"]
        ):
            raise ValueError(
                f"{path} was written by {saved['backend']} on {saved['world_size']} ranks; its optimizer "
                f"state cannot be loaded by {here['backend']} on {here['world_size']} ranks: resume "
                "with the parallel.backend (and, for DeepSpeed, the number of ranks) it was written with"
            )
        load_weights(path, adapter.denoiser, backend)
        mine = path / _rank_dir(backend.world.rank)
        if backend.sharded_optimizer_state:
            # Our own file; DeepSpeed's optimizer state holds Python objects (its loss scaler).
            backend.load_optimizer_state(torch.load(mine / "optimizer.pt", map_location="cpu", weights_only=False))
        else:
            backend.load_optimizer_state(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
        progress = Progress.load(path)
        states = load_states(path, backend.world.rank)
        if (mine / "rng.pt").is_file():  # absent for ranks a run on fewer ranks did not have
            _set_rng_state(torch.load(mine / "rng.pt", weights_only=True))
        return progress, states

    def _prune(self) -> None:
        for stale in self.directory.glob(".incomplete-*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if self.keep > 0:
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def write_atomically(
    final: Path,
    progress: Progress,
    adapter,
    backend,
    states: dict[str, State],
    config: dict,
    optimizer: bool = True,
    meta: dict | None = None,
    replace: bool = False,
) -> Path | None:
    """Write a checkpoint to ``final`` under a temporary name in its parent, renamed when every rank's part is
    there (every rank calls it). ``optimizer`` False leaves the optimizer state out (weights only); ``meta``
    is written as ``meta.json``; ``replace``: a previous ``final`` is swapped out (else kept, as a copy of the
    same progress). Returns ``final`` on rank 0."""
    trainable = backend.trainable_state(adapter.denoiser)
    optimizer_state = backend.optimizer_state() if optimizer else None
    is_main = backend.world.rank == 0
    tmp = None
    try:
        with diagnosed_writes(final.parent):
            if is_main:
                final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(
                backend.broadcast(tempfile.mkdtemp(prefix=".incomplete-", dir=final.parent) if is_main else None)
            )
            _write_parts(tmp, progress, backend, trainable, optimizer_state, states, config, meta)
    except BaseException:
        if is_main and tmp is not None:  # what it took of a full disk is free again
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    backend.barrier()  # every rank's files are in ``tmp`` before it is renamed
    if is_main:
        if final.exists() and not replace:  # the same progress was saved before a resume: that copy is complete
            shutil.rmtree(tmp)
        else:
            swap_in(tmp, final)
    backend.barrier()
    return final if is_main else None


def _write_parts(
    tmp: Path,
    progress: Progress,
    backend,
    trainable: dict,
    optimizer_state,
    states: dict[str, State],
    config: dict,
    meta: dict | None,
) -> None:
    """Write this rank's part of a checkpoint into ``tmp`` (rank 0: the shared files too)."""
    is_main = backend.world.rank == 0
    if is_main:
        usual_mode(tmp)
    mine = tmp / _rank_dir(backend.world.rank)
    mine.mkdir()
    torch.save(_rng_state(), mine / "rng.pt")
    if optimizer_state is not None and backend.sharded_optimizer_state:
        torch.save(optimizer_state, mine / "optimizer.pt")
    _save_states({name: state.tensors for name, state in states.items() if state.per_rank}, mine)
    _fsync_tree(mine)
    if is_main:
        save_file(trainable, tmp / "trainable.safetensors")
        if optimizer_state is not None and not backend.sharded_optimizer_state:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        _save_states({name: state.tensors for name, state in states.items() if not state.per_rank}, tmp)
        (tmp / "backend.json").write_text(json.dumps(_backend_meta(backend)))
        if meta is not None:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        progress.save(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1, default=str))
        _fsync_tree(tmp)


def usual_mode(folder: Path) -> None:
    """Give a folder from ``tempfile.mkdtemp`` (private: 0700) the mode any folder of this user gets."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, replacing what is there: two renames, and a kill between
    them leaves the old one as ``.replaced-<name>``, which ``recover`` renames back."""
    swapped = final.with_name(f".replaced-{final.name}")
    if final.exists():
        shutil.rmtree(swapped, ignore_errors=True)
        os.rename(final, swapped)
    os.rename(tmp, final)
    shutil.rmtree(swapped, ignore_errors=True)


def recover(final: Path) -> None:
    """Undo a replacement by ``swap_in`` that a kill cut between its two renames."""
    swapped = final.with_name(f".replaced-{final.name}")
    if swapped.is_dir() and not final.exists():
        os.rename(swapped, final)


def damaged(path: Path, only: Sequence[str] = ()) -> str | None:
    """Why checkpoint ``path`` cannot be loaded (its first file that is missing or unreadable: a disk fault, a
    copy cut short), or None; ``only``: just these files (e.g. the weights, for an export). Headers are read
    (safetensors' index, a ``.pt``'s zip directory), not every byte, so this is quick at any size."""
    names = list(only)
    if not only:
        names = ["progress.json", "backend.json", "config.json", "trainable.safetensors"]
        if not any(path.glob("rank-*/optimizer.pt")):  # every backend but DeepSpeed: one full optimizer state
            names.append("optimizer.pt")
        names += sorted(
            {
                str(f.relative_to(path))
                for f in [*path.iterdir(), *path.glob("rank-*/*")]
                if f.suffix in (".json", ".pt", ".safetensors")
            }
            - set(names)
        )
    for name in names:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        try:
            if file.suffix == ".json":
                json.loads(file.read_text())
            elif file.suffix == ".safetensors":
                with safe_open(file, "pt"):
                    pass
            else:
                zipfile.ZipFile(file).close()
        except (OSError, ValueError, zipfile.BadZipFile, SafetensorError) as exc:
            return f"{name} cannot be read: {exc}"
    return None


def whole_before(path: Path, only: Sequence[str] = ()) -> Path | None:
    """The newest checkpoint of ``path``'s run older than ``path`` that is not ``damaged`` (in ``only``'s files),
    for a message that names it; None when there is none."""
    return next(
        (
            p
            for p in reversed(Checkpoints(path.parent, 0, False).complete())
            if p.name < path.name and damaged(p, only) is None
        ),
        None,
    )


def load_states(path: Path, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """The named states of checkpoint ``path``: the shared ones and rank ``rank``'s own."""
    states = {
        f.name.removesuffix(".safetensors"): load_file(f)
        for f in path.glob("*.safetensors")
        if f.name != "trainable.safetensors"
    }
    states.update(
        {f.name.removesuffix(".safetensors"): load_file(f) for f in (path / _rank_dir(rank)).glob("*.safetensors")}
    )
    return states


def load_weights(path: Path, module: torch.nn.Module, backend) -> None:
    """Load checkpoint ``path``'s trainable weights into ``module`` (every rank; each keeps its shard)."""
    backend.load_trainable_state(module, load_file(path / "trainable.safetensors"))


def _rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def _save_states(states: dict[str, dict[str, torch.Tensor]], directory: Path) -> None:
    for name, tensors in states.items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, directory / f"{name}.safetensors")


def _backend_meta(backend) -> dict:
    name = type(backend).__name__
    # Single-process and DDP optimizer states are the same torch state dict.
    optimizer = "torch" if name in ("SingleProcess", "DDP") else name + str(getattr(backend, "stage", ""))
    return {"backend": name, "optimizer": optimizer, "world_size": backend.world.world_size}


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
