"""How a run ends short of its end: one exception family, ``RunEnded``, that carries the exit status and what the
person at the terminal reads, and ``ended``, which says what an error leaving a run ends it as.

Ctrl-C 130 and a stop signal 128 + its number (nothing to continue before training; where it stopped and the command
that continues it once training started), a user-fixable error 2, a run that went wrong 1."""

from __future__ import annotations

import os
import sys

from shared.interrupt import interrupted
from trainer.config import Config, user_error_exit
from trainer.disk import NO_ROOM
from trainer.health import RewardFailure, TrainingDiverged
from trainer.memory import memory_advice, out_of_memory
from trainer.rewards.launcher import RewardPoolError
from trainer.stopping import StopSignalled
from trainer.tool import tell_launcher


class RunEnded(Exception):  # noqa: N818 (an outcome, not an error)
    """A run that ended early with exit ``status``; ``report`` prints ``message`` (rank 0) and returns the status.
    This base class: it ended before training started, so there is nothing to continue."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status = message, status

    def report(self) -> int:
        if os.environ.get("RANK", "0") == "0":
            print(f"\n{self.message}", flush=True)
        return self.status


class RunStopped(RunEnded):
    """Training stopped (Ctrl-C, a stop signal, a full disk, out of memory, a reward outage): ``how``, where it
    stopped and the command that continues it; torchrun's failure summary shows the same."""

    def __init__(self, how: str, where: str, command: str, status: int):
        super().__init__(f"{how}: {where}\ncontinue with: {command}", status)

    def report(self) -> int:
        tell_launcher(self.message)
        return super().report()


class RunRefused(RunEnded):
    """A run its settings or files keep from going on (status 2), or one that went wrong alike on every rank
    (status 1): ``error`` said in one line by ``user_error_exit``."""

    def __init__(self, error: Exception, status: int = 2):
        super().__init__(str(error), status)
        self.error = error

    def report(self) -> int:
        user_error_exit(self.error)
        return self.status


class ConfigRefused(RunEnded):
    """A config that does not load: said on stderr by each machine's first process, and to torchrun."""

    def report(self) -> int:
        tell_launcher(self.message)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # under torchrun, one process per machine reports
            print(self.message, file=sys.stderr)
        return self.status


def ended(exc: BaseException, config: Config) -> RunEnded | None:
    """What ``exc``, leaving a run, ends it as; None: a bug, whose traceback is the report. After a Ctrl-C, any
    error is that interrupt (what library code made of it: shared/interrupt.py), or the stop it cut short."""
    if isinstance(exc, RunEnded):
        return exc
    if isinstance(exc, KeyboardInterrupt) or (isinstance(exc, Exception) and interrupted()):
        stop = exc  # a second Ctrl-C while a first one's stop unwound: that stop
        while stop is not None and not isinstance(stop, RunStopped):
            stop = stop.__context__
        return stop or RunEnded("interrupted before training started: nothing to continue", 130)
    if isinstance(exc, StopSignalled):  # trainer.stopping.StopsBeforeTraining
        return RunEnded(f"{exc} before training started: nothing to continue", 128 + exc.signum)
    # User-fixable: bad paths, shapes, sizes (ValueError); a reward replica of the job's own that did not start
    # (the end of its log, in the message, says why).
    if isinstance(exc, ValueError | RewardPoolError):
        return RunRefused(exc)
    if isinstance(exc, OSError):  # no room for the run's first files (its checkpoints' own: RunStopped)
        where = exc.filename or config.logging.output_dir  # a failed write() names no file
        fix = "make room there, or set logging.output_dir to a folder with room"
        return RunRefused(ValueError(f"cannot write {where}: {exc.strerror}: {fix}")) if exc.errno in NO_ROOM else None
    if isinstance(exc, RewardFailure | TrainingDiverged):  # the run went wrong (trainer/health.py), alike on every rank
        exc.every_rank = True
        return RunRefused(exc, 1)
    if out_of_memory(exc):  # before training: loading the model, preparing it (trainer/memory.py)
        return RunRefused(ValueError(memory_advice(exc, config)))
    return None
