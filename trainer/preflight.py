"""The run's pre-flight: every piece a run needs from outside its config (the checkpoints it continues or starts
from, its output folder, its reward servers, its data files, its model folder, its precomputed stores) checked
before anything is built, and every problem reported at once, each with the setting or command that fixes it,
instead of one per attempt. The checks are the ones the parts run themselves; this gathers their messages."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import Checkpoints, damaged, whole_before
from trainer.config import Config
from trainer.data import Task, build_tasks
from trainer.launch import reward_problem
from trainer.models import model_path_problem
from trainer.models.stores import missing_store
from trainer.tool import cannot_write


class NotReady(ValueError):
    """The problems that keep a run from starting (found alike on every rank: rank 0 reports them)."""

    every_rank = True

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            problems[0]
            if len(problems) == 1
            else f"this run cannot start; {len(problems)} things to fix first:\n"
            + "\n".join(f"  - {problem}" for problem in problems)
        )


def preflight(config: Config, backend) -> tuple[Task, Task]:
    """The run's (task, evaluation task) once every piece it needs is there; else ``NotReady`` naming each that is
    not, on every rank alike (each rank checks what it sees: machines may see other files and servers)."""
    problems: list[str] = []
    for setting, path in ("train.resume", config.train.resume), ("train.init_from", config.train.init_from):
        if path and path != "auto":
            problems += _raised(require_checkpoint, Path(path), setting)
    output = Path(config.logging.output_dir)
    if (why := cannot_write(output.absolute(), folder=True)) is not None:
        problems.append(f"logging.output_dir={str(output)!r}: {why}")
    problems.append(reward_problem(config))
    tasks: list[tuple[Task, Task]] = []
    problems += _raised(lambda: tasks.append(build_tasks(config.data, config.eval)))
    problems.append(model_path_problem(config.model))
    problems += [store_problem(config.model, setting) for setting in ("text_embeddings", "image_latents")]
    found: dict[str, int] = {}
    for rank, theirs in enumerate(backend.all_gather_object([p for p in problems if p])):
        for problem in theirs:
            found.setdefault(problem, rank)
    if found:
        raise NotReady([problem if rank == 0 else f"on rank {rank}: {problem}" for problem, rank in found.items()])
    return tasks[0]


def _raised(check, *args) -> list[str]:
    """The problems ``check(*args)`` raises as ValueErrors (several where it names them: ``DataProblems``)."""
    try:
        check(*args)
    except ValueError as exc:
        return list(getattr(exc, "problems", [str(exc)]))
    return []


def store_problem(model, setting: str) -> str | None:
    """Why ``model.<setting>`` (``text_embeddings`` or ``image_latents``), where it is set, holds no store, naming
    the command that writes one; or None."""
    from trainer.models.latents import LATENT_INDEX, PRECOMPUTE_LATENTS
    from trainer.models.text import PRECOMPUTE, TEXT_INDEX

    directory = getattr(model, setting, "")
    if not directory:
        return None
    index, command = (TEXT_INDEX, PRECOMPUTE) if setting == "text_embeddings" else (LATENT_INDEX, PRECOMPUTE_LATENTS)
    return missing_store(f"model.{setting}={directory!r}", Path(directory) / index, command)


def require_checkpoint(path: Path, setting: str) -> None:
    """Refuse ``setting``'s path unless it is a complete checkpoint, naming the one meant where it is a run's
    directory (checked before anything is built or started)."""
    if (path / "progress.json").is_file() and (path / "trainable.safetensors").is_file():
        why = damaged(path, only=("trainable.safetensors",) if setting == "train.init_from" else ())
        if why is None:
            return
        older = whole_before(path)
        raise ValueError(
            f"{setting}={str(path)!r} cannot be loaded, {why}: "
            + (f"pass the checkpoint before it, {older}" if older else "restore it from a copy")
        )
    if not path.exists():
        raise ValueError(f"{setting}={str(path)!r}: no such directory; pass a <run>/checkpoints/step-* directory")
    hint = "pass a <run>/checkpoints/step-* directory"
    latest = Checkpoints(path / "checkpoints", 0, False).latest()
    if latest is not None:
        hint = f"{path} is a run directory: pass one of its checkpoints, e.g. {latest}"
    if setting == "train.resume":
        hint += ", or train.resume=auto with logging.run_name to continue the run's latest"
    raise ValueError(
        f"{setting}={str(path)!r} is not a complete checkpoint (no progress.json and trainable.safetensors): {hint}"
    )
