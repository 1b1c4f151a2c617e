"""A run acting on its scoreboard's verdicts (trainer/scoreboard.py): ``<run>/best/`` holds the weights (and EMA) of
the best evaluation so far, written atomically, and the reward-hacking alarm is printed, logged (a W&B alert too) and
acted on as ``eval.on_alarm`` says: a warning, a stop, or a rollback to best/."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from trainer import checkpoint
from trainer.checkpoint import Progress, load_weights
from trainer.config import Config, saved_dict
from trainer.distributed import ParallelBackend
from trainer.ema import EMA
from trainer.logging import RunLogger
from trainer.models.base import ModelAdapter
from trainer.scoreboard import Scoreboard


class Judge:
    """Gives each evaluation to ``scoreboard`` on every rank alike and acts on the verdict; ``say`` prints on rank 0."""

    def __init__(
        self,
        scoreboard: Scoreboard,
        best_dir: Path,
        adapter: ModelAdapter,
        backend: ParallelBackend,
        ema: EMA | None,
        logger: RunLogger,
        config: Config,
        say: Callable[[str], None],
    ):
        self.scoreboard, self.best_dir, self.adapter, self.backend, self.ema = (
            scoreboard,
            best_dir,
            adapter,
            backend,
            ema,
        )
        self.logger, self.config, self.say = logger, config, say
        self.rolled_back_at: int | None = None  # the evaluation whose alarm last rolled the weights back

    def __call__(self, epoch: int, metrics: dict[str, float], progress: Progress) -> bool:
        """Judge evaluation ``epoch`` (rank 0's ``metrics``): a new best is written to best/, an alarm said, logged
        and acted on. True: stop the run."""
        metrics = self.backend.broadcast(metrics if self.backend.world.rank == 0 else None)
        verdict = self.scoreboard.observe(epoch, metrics)
        if verdict.improved:
            self.save_best(epoch, metrics, progress)
        stop = verdict.stop
        if verdict.alarm is not None:
            action = self.config.eval.on_alarm
            warning = f"{verdict.alarm.message()} (eval.on_alarm={action})"
            self.say(f"warning: {warning}")
            self.logger.log(epoch, "alarm", {"metric": verdict.alarm.metric, **verdict.alarm.numbers()}, alert=warning)
            if action == "stop":
                best = self.best_dir if self.has_best() else "not in this run (see its resume's note)"
                stop = f"stopped by the reward-hacking alarm (eval.on_alarm=stop); the best weights: {best}"
            elif action == "rollback" and not self.has_best():
                stop = (
                    f"stopped by the reward-hacking alarm: eval.on_alarm=rollback has no best/ to roll back to "
                    f"(epoch {self.scoreboard.best_epoch}'s weights were not carried into this run)"
                )
            elif action == "rollback":
                self.restore_best()
                self.rolled_back_at = epoch
        if stop:
            self.say(stop)
            self.scoreboard.stopped = True
        return bool(stop)

    def save_best(self, epoch: int, metrics: dict[str, float], progress: Progress) -> None:
        """Write the weights (and EMA) just evaluated to best/, atomically, with what the evaluation measured."""
        states = self.ema.checkpoint_state() if self.ema is not None else {}
        evaluated = "ema" if self.ema is not None and self.config.eval.use_ema else "trained"
        meta = {
            "epoch": epoch,
            "select_by": self.scoreboard.select_by,
            "value": metrics[self.scoreboard.select_by],
            "evaluated": evaluated,
            "metrics": metrics,
        }
        checkpoint.write_atomically(
            self.best_dir,
            progress,
            self.adapter,
            self.backend,
            states,
            saved_dict(self.config),
            optimizer=False,
            meta=meta,
            replace=True,
        )

    def carry_from(self, continued: Path) -> None:
        """A run continuing another run's checkpoint ``continued`` takes that run's best/ when it holds the evaluation
        the checkpoint's scoreboard names best (that run may have gone on past it), so that its best/, its closing
        line and a roll-back have the weights (rank 0)."""
        source = continued.parent.parent / "best"
        if (
            self.best_dir.exists()
            or not (source / "meta.json").is_file()
            or source.resolve() == self.best_dir.resolve()
        ):
            return
        held = json.loads((source / "meta.json").read_text()).get("epoch")
        if held != self.scoreboard.best_epoch:
            self.say(
                f"note: best/ starts empty: {source} holds epoch {held}'s weights, not those of epoch "
                f"{self.scoreboard.best_epoch}, the best evaluation this checkpoint knows; this run writes best/ when "
                f"one of its evaluations beats that {self.scoreboard.select_by}"
            )
            return
        self.best_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".incomplete-best-", dir=self.best_dir.parent))
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        checkpoint.usual_mode(tmp)
        checkpoint.swap_in(tmp, self.best_dir)
        self.say(f"best/: the best evaluation so far (epoch {self.scoreboard.best_epoch}) is {source}'s, copied here")

    def has_best(self) -> bool:
        """Whether best/ holds weights (rank 0's view, on every rank): not in a run that continued another run's
        checkpoint without that run's best weights (``carry_from``), until an evaluation of its own beats them."""
        if self.backend.world.rank == 0:
            checkpoint.recover(self.best_dir)
        return bool(self.backend.broadcast(self.best_dir.is_dir() if self.backend.world.rank == 0 else None))

    def restore_best(self) -> None:
        """Roll back to best/: its trained weights and EMA, with fresh optimizer moments."""
        checkpoint.recover(self.best_dir)
        load_weights(self.best_dir, self.adapter.denoiser, self.backend)
        if self.ema is not None:
            states = checkpoint.load_states(self.best_dir, self.backend.world.rank)
            self.ema.load_checkpoint_state(states, self.best_dir)
        self.backend.reset_optimizer()
        self.say(f"rolled back to the weights of epoch {self.scoreboard.best_epoch} ({self.best_dir})")
