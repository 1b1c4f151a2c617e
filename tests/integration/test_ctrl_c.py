"""Ctrl-C ends a tool with its one line, exit status 130, even where library code did not pass the
KeyboardInterrupt on: in CI a Ctrl-C during the trainer's imports ended in diffusers' RuntimeError traceback; here,
one during the weight load became safetensors' ValueError, then diffusers' OSError, and one ending exec'd code had
`python -m` end the tool by SIGINT. The script below does to the KeyboardInterrupt what that code did (those races
cannot be timed in a test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

import shared.interrupt
from trainer.distributed import SingleProcess
from trainer.stopping import StopRequests

REPO = Path(__file__).resolve().parents[2]

TOOL = """
import atexit, os, signal, sys, time
from shared.interrupt import run_tool

def ctrl_c(wait=10.0):  # the KeyboardInterrupt comes as os.kill returns, unless SIGINT is ignored
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(wait)

class Teardown:
    def __del__(self):
        ctrl_c(wait=0.5)

def main():
    if sys.argv[1] == "converted":  # diffusers' lazy import: except Exception as e: raise RuntimeError(...) from e
        try:
            ctrl_c()
        except BaseException as exc:
            raise RuntimeError("Failed to import diffusers.models.autoencoders.autoencoder_kl") from exc
    if sys.argv[1] == "user_error":  # a tool's except ValueError: user_error_exit(exc), as the tools end
        from trainer.config import user_error_exit

        try:
            try:
                ctrl_c()
            except BaseException:
                raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
        except ValueError as exc:
            return user_error_exit(exc)
    if sys.argv[1] == "in_string_code":  # the Ctrl-C ends code run from a string: a dataclass's exec'd __init__
        exec("ctrl_c()")
    if sys.argv[1] == "ignored":  # a background job's Ctrl-C: the shell ignores SIGINT for it
        ctrl_c(wait=0.2)
        print("went on", flush=True)
    if sys.argv[1] in ("exiting", "finalizing"):  # Ctrl-C again while Python ends: after main, or in module teardown
        global LAST
        LAST = Teardown() if sys.argv[1] == "finalizing" else None
        if LAST is None:
            atexit.register(ctrl_c)
        return 3
    if sys.argv[1] == "error":
        raise RuntimeError("a real error")
    return 0

run_tool(main, "interrupted: nothing done")
"""


def _tool(tmp_path: Path, case: str, sigint=signal.SIG_DFL) -> subprocess.CompletedProcess:
    """The tool above run as ours are, ``python -m`` (the module mode has a way of its own to end by SIGINT)."""
    (tmp_path / "small_tool.py").write_text(TOOL)
    return subprocess.run(
        [sys.executable, "-m", "small_tool", case],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


def test_a_ctrl_c_that_library_code_turned_into_its_own_error_still_ends_in_one_line(tmp_path):
    """And one that ended code run from a string: `python -m` then ended the tool by SIGINT (-2) after its line."""
    for case in ("converted", "user_error", "in_string_code"):
        done = _tool(tmp_path, case)
        assert (done.returncode, done.stderr) == (130, "\ninterrupted: nothing done\n"), (case, done.stderr)


def test_a_ctrl_c_while_the_tool_ends_leaves_its_exit_status(tmp_path):
    """Python restores SIGINT's default action as it shuts down: the second Ctrl-C of an impatient user killed it."""
    for case in ("exiting", "finalizing"):
        done = _tool(tmp_path, case)
        assert (done.returncode, done.stderr) == (3, ""), (case, done.stderr)


def test_other_errors_keep_their_traceback_and_an_ignored_sigint_stays_ignored(tmp_path):
    done = _tool(tmp_path, "error")
    assert done.returncode == 1 and "RuntimeError: a real error" in done.stderr and "Traceback" in done.stderr
    done = _tool(tmp_path, "ignored", sigint=signal.SIG_IGN)  # `cmd &` in a script: the shell ignores SIGINT for it
    assert (done.returncode, done.stdout, done.stderr) == (0, "went on\n", "")


def test_a_ctrl_c_that_library_code_swallowed_stops_the_run_at_its_next_step(monkeypatch):
    stops = StopRequests(SingleProcess(torch.device("cpu")), announce=False)
    assert stops.asked() == 0
    monkeypatch.setattr(shared.interrupt, "_asked", True)
    assert StopRequests(SingleProcess(torch.device("cpu")), announce=False).asked() == signal.SIGINT
