"""What the trainer's command-line tools do alike: read ``~`` in path options, check their output path before a
model loads, tell torchrun why a rank ended. (How they end on Ctrl-C: shared/interrupt.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


def user_path(text: str) -> Path:
    """An option's path with ``~`` expanded: a shell leaves ``--out=~/x`` (and a quoted ``"~/x"``) as written."""
    return Path(text).expanduser()


def cannot_write(path: Path, folder: bool) -> str | None:
    """Why ``path``, a folder to make or fill (``folder``) or a file to write, cannot be written, or None: a
    command-line tool checks its output before it loads a model."""
    if path.exists() and path.is_dir() != folder:
        return f"{path} is {'a file, not a folder' if folder else 'a folder'}"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing != path and not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing if existing.is_dir() else existing.parent, os.W_OK | os.X_OK):
        return f"{existing} is not writable here"
    return None


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
