"""A graceful stop on SIGTERM or SIGUSR1, what a scheduler sends before it preempts a job or its time runs out
(SLURM's ``--signal``, a Kubernetes eviction, torchrun passing on its own SIGTERM), when torchrun is gone, and on a
first Ctrl-C once training has started: the run ends its warm-up step or RL epoch, writes a checkpoint and exits with
128 + the signal's number, so a stop loses no finished work. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

import torch

from shared.interrupt import interrupt_now, interrupted

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_GONE = signal.SIGHUP
"""What a rank stops for, as for a signal, when the torchrun that started it is gone (killed with SIGKILL, it leaves
its ranks running on, unsupervised, beside any run started again on their directory): 128 + 1 = exit status 129."""


class StopSignalled(BaseException):  # noqa: N818 (a request, not an error)
    """Every rank stopped at the same step after a rank received ``signum``; a checkpoint holds that step. Not an
    ``Exception``, as KeyboardInterrupt is not: raised by a signal handler wherever the process is, it must pass the
    ``except Exception`` of other code (diffusers' weight loading turned it into an OSError and a traceback)."""

    def __init__(self, signum: int):
        super().__init__(
            "torchrun, which started the ranks, is gone"
            if signum == LAUNCHER_GONE
            else "interrupted"
            if signum == signal.SIGINT
            else f"{signal.Signals(signum).name} received"
        )
        self.signum = signum


class StopRequests:
    """Records the first stop signal this process receives while entered (the handlers are installed from the main
    thread only) and, under torchrun, the launcher's end (checked every second); ``asked()`` agrees on it across
    ranks. A first Ctrl-C is such a request, said at once with ``finishing()`` (what the run finishes before it
    stops); a second one (or one after a stop signal) interrupts where the process is, as Ctrl-C does elsewhere.
    Tests set ``received`` as a handler would."""

    def __init__(self, backend, announce: bool = True, finishing: Callable[[], str] | None = None):
        self.backend = backend
        self.announce = announce  # said on stderr when it arrives (rank 0)
        self.finishing = finishing or (lambda: "this warm-up step or RL epoch and saving a checkpoint")
        self.received = 0
        self._agreed = 0
        self._previous: dict[int, object] = {}
        self._done = threading.Event()

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
            if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None):  # ignored: a background job's, it stays
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._ctrl_c)
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a rank torchrun started: it is our parent
            self._done.clear()
            threading.Thread(target=self._watch, args=(os.getppid(),), name="launcher-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._done.set()

    def _handle(self, signum: int, frame) -> None:
        if self.received:
            return
        self.received = signum
        if self.announce:  # to file descriptor 2: a print could re-enter the stream the interrupted code was writing
            with contextlib.suppress(OSError):  # an exception here would surface wherever the signal came in
                os.write(
                    2,
                    f"\n{StopSignalled(signum)}: the run stops after this warm-up step or RL epoch, once a "
                    "checkpoint is written (in its final evaluation: it finishes)\n".encode(),
                )

    def _ctrl_c(self, signum: int, frame) -> None:
        if self.received:  # the second: stop now
            interrupt_now()
        self.received = signum
        if self.announce:
            with contextlib.suppress(Exception):  # an error here would surface wherever the signal came in
                os.write(2, f"\nCtrl-C: {self.finishing()}; Ctrl-C again to stop now\n".encode())

    def _watch(self, launcher: int) -> None:
        while not self._done.wait(1.0):
            if os.getppid() != launcher:  # re-parented: torchrun is gone
                self._handle(LAUNCHER_GONE, None)
                return

    def asked(self) -> int:
        """The stop signal a rank received (0: none). Collective: every rank calls it at the same points; once
        a signal is agreed on it stays so."""
        if not self.received and interrupted():  # a Ctrl-C that library code swallowed (shared/interrupt.py)
            self.received = signal.SIGINT
        if not self._agreed:
            if self.backend.world.world_size == 1:
                self._agreed = self.received
            else:
                self._agreed = int(self.backend.gather(torch.tensor([self.received])).max())
        return self._agreed

    def stop_if_asked(self, checkpoint: Callable[[], None] | None = None) -> None:
        """Where a rank received a stop signal (``asked``, collective): ``checkpoint()``, then StopSignalled (in
        place of the error being handled, if any)."""
        signum = self.asked()
        if signum:
            if checkpoint is not None:
                checkpoint()
            raise StopSignalled(signum) from None


class StopsBeforeTraining:
    """Until ``release()`` (training starts, where ``StopRequests`` takes over): a stop signal raises
    ``StopSignalled`` where the process is (loading models, waiting on replicas), so the run's exits still run:
    its replicas stop and a run directory it made is removed; further ones (torchrun passes SIGTERM on) are
    ignored while they do. An error leaving the block after one is that stop (safetensors made a ValueError of
    what a signal raised inside its weight loading, as for Ctrl-C: shared/interrupt.py). Main thread only, as for
    ``StopRequests``."""

    def __init__(self):
        self._previous: dict[int, object] = {}
        self.received = 0

    def __enter__(self) -> StopsBeforeTraining:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._raise) for sig in SIGNALS}
        return self

    def _raise(self, signum: int, frame) -> None:
        ignore_stop_signals()
        self.received = signum
        raise StopSignalled(signum)

    def release(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, kind, exc, traceback) -> None:
        self.release()
        if self.received and isinstance(exc, Exception):
            raise StopSignalled(self.received) from exc


def ignore_stop_signals() -> None:
    """For the rest of a stopping process: torchrun passes SIGTERM on to the ranks still running when one exits,
    and it would end this one before it has stopped its reward servers and said where the run stopped."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
