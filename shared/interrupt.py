"""How a command-line tool ends on Ctrl-C: one line saying what it leaves, exit status 130, whatever the process was
doing. Imports nothing heavy, so that it holds from the tool's first import on (torch and the model registry take
seconds). The trainer's tools and the reward server use it.

Ctrl-C raises KeyboardInterrupt wherever the process is, and library code does not always pass it on: a failed
import became diffusers' RuntimeError, a weight load safetensors' ValueError and then diffusers' OSError, and some
code swallows it. So the handler also records it (``interrupted()``): an error escaping after it is the interrupt."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import NoReturn

_asked = False


def _on_ctrl_c(signum: int, frame) -> None:
    interrupt_now()


def interrupt_now() -> NoReturn:
    """What Ctrl-C does in a tool: recorded (``interrupted``), a KeyboardInterrupt wherever the process is (the
    trainer's loop does so on a second Ctrl-C: trainer/stopping.py)."""
    global _asked
    _asked = True
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether Ctrl-C (SIGINT) came since ``run_tool`` started the tool."""
    return _asked


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt after a Ctrl-C that library code swallowed: a tool's loops call it between items."""
    if _asked:
        raise KeyboardInterrupt


@contextlib.contextmanager
def as_interrupt() -> Iterator[None]:
    """An error escaping the block after a Ctrl-C is re-raised as the KeyboardInterrupt it was made of."""
    try:
        yield
    except Exception as exc:
        if not _asked:
            raise
        raise KeyboardInterrupt from exc


def run_tool(main: Callable[[], int], said: str) -> NoReturn:
    """``sys.exit(main())``; Ctrl-C anywhere in ``main`` (its imports, loading) prints ``said`` instead of a
    traceback. A SIGINT that the shell ignored for a background job stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_ctrl_c)
        atexit.register(_shut_down)
    try:
        with as_interrupt():
            code = main()
    except KeyboardInterrupt:
        print(f"\n{said}", file=sys.stderr, flush=True)
        code = 130
    if signal.getsignal(signal.SIGINT) is _on_ctrl_c:  # a Ctrl-C as the interpreter shuts down: see _shut_down
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
    # A KeyboardInterrupt that ended code run from a string (exec of a str: dataclasses make their __init__ so, as
    # a tool's imports define them) marks it unhandled, caught or not, and under `python -m` Python then ends the
    # process by SIGINT (status -2) whatever it exits with; the next string run, this one, clears the mark.
    exec("")
    sys.exit(code)


def run_module(module: str, said: str) -> NoReturn:
    """``run_tool`` of ``module``'s ``main``, imported inside it: ``python -m`` runs the tool's file as ``__main__``,
    where its module-level imports would come before any handler."""
    run_tool(lambda: importlib.import_module(module).main(), said)


def _shut_down() -> None:
    """Python's last exit function (registered first): a Ctrl-C while the interpreter shuts down (a second or more,
    after its threads and exit functions) killed the tool by SIGINT, its exit status -2 instead of the tool's: Python
    restores SIGINT's default action there, unless it is ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
