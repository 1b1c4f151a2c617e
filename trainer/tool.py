"""What every command-line tool does alike: end on Ctrl-C with one line saying what it leaves (exit status 130),
and read ``~`` in path options. Imports nothing heavy, so that it holds from the tool's first import on (torch and
the model registry take seconds)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


def user_path(text: str) -> Path:
    """An option's path with ``~`` expanded: a shell leaves ``--out=~/x`` (and a quoted ``"~/x"``) as written."""
    return Path(text).expanduser()


def run_tool(main: Callable[[], int], interrupted: str) -> NoReturn:
    """``sys.exit(main())``; Ctrl-C anywhere in ``main`` (its imports, loading) prints ``interrupted`` instead of
    a KeyboardInterrupt traceback."""
    try:
        code = main()
    except KeyboardInterrupt:
        print(f"\n{interrupted}", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def tell_launcher(message: str) -> None:
    """Under torchrun, record ``message`` as this rank's cause of failure (its TORCHELASTIC_ERROR_FILE, in the
    form torch's ``@record`` writes): torchrun's failure summary then shows it for the rank, instead of
    "To enable traceback see: <docs>" under the one line that said what went wrong. Elsewhere: nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": record}, f)
