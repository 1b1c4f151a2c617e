"""Expensive test inputs made once per test run, however pytest-xdist spreads the tests that use them over its
workers (module- and session-scoped fixtures run once per worker that runs one of their tests)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once_per_run(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(folder)``'s result (JSON data), made by the first worker to ask, in a fresh ``folder`` of the run's
    temporary folder (above the workers' own), under a file lock; the others wait for it and read it."""
    root = factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    done = shared / f"{name}.json"
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if not done.is_file():
            folder = shared / name
            shutil.rmtree(folder, ignore_errors=True)  # what a worker whose ``make`` failed left
            folder.mkdir()
            done.write_text(json.dumps(make(folder)))
        return json.loads(done.read_text())
