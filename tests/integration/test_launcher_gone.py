"""A rank whose launcher is gone: a process started as torchrun starts its ranks, whose parent then exits (as a
torchrun killed with SIGKILL), asks to stop as for SIGHUP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.stopping import LAUNCHER_GONE, StopSignalled

WATCHED = """
import sys, time, torch
from trainer.display import Display
from trainer.distributed import SingleProcess
from trainer.stopping import StopRequests
with StopRequests(SingleProcess(torch.device("cpu")), announce=False) as stops:
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while not stops.asked() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(sys.argv[1], "w") as out:
        out.write(str(stops.asked()))
"""


LAUNCHER = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
assert rank.stdout.readline() == "ready\\n"
"""  # exits as soon as its child is watching: the child is re-parented


def test_a_rank_whose_torchrun_is_gone_asks_to_stop(tmp_path):
    """A process started as torchrun starts its ranks (TORCHELASTIC_RUN_ID set) whose parent exits, as a torchrun
    killed with SIGKILL does: within a second or two it asks to stop, as for SIGHUP."""
    out = tmp_path / "asked"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", LAUNCHER, WATCHED, str(out)], env=env, check=True, timeout=60)
    deadline = time.monotonic() + 30
    while not (out.is_file() and out.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text() == str(int(LAUNCHER_GONE)) == str(int(signal.SIGHUP))
    assert str(StopSignalled(LAUNCHER_GONE)) == "torchrun, which started the ranks, is gone"
