"""Writes that fail for want of room (a full disk, a quota, a read-only remount, a file size limit), said as such:
the writers' own errors hide the cause (torch.save says "unexpected pos 576 vs 534")."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""A write's errors whose fix is the filesystem's: no space left, over quota, read-only, a file size limit."""


@contextlib.contextmanager
def diagnosed_writes(folder: Path) -> Iterator[None]:
    """Raise a write under ``folder`` that failed for want of room (``NO_ROOM``) as an OSError of that errno
    naming the folder and its free space: a probe write finds the cause where the writer's own error hides it
    (torch.save says "unexpected pos 576 vs 534"); other failures go on as they were."""
    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as exc:
        code = exc.errno if isinstance(exc, OSError) else _os_error(exc)
        code = code if code in NO_ROOM else _probe(folder) or _cut(folder)
        if code is None:
            raise
        free = shutil.disk_usage(folder).free / 2**20 if folder.exists() else 0.0
        raise OSError(code, f"{os.strerror(code)} ({free:.0f} MiB free there)", str(folder)) from exc


def tree_mib(folder: Path) -> float:
    """The size in MiB of the files under ``folder`` (a checkpoint's: what a full disk must make room for)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def _probe(folder: Path) -> int | None:
    """The errno (one of ``NO_ROOM``) with which a 1 MiB write into ``folder`` fails, or None."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(2**20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc.errno if exc.errno in NO_ROOM else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


def _os_error(exc: BaseException) -> int | None:
    """The errno a library's error message quotes (safetensors: "I/O error: File too large (os error 27)"), or None."""
    quoted = re.search(r"\(os error (\d+)\)", str(exc))
    return int(quoted[1]) if quoted else None


def _cut(folder: Path) -> int | None:
    """EFBIG when a file under ``folder`` stopped at exactly this process's file size limit (RLIMIT_FSIZE: a write
    past it is cut there), which a probe write within the limit does not find; else None."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY or not folder.is_dir():
        return None
    return errno.EFBIG if any(f.is_file() and f.stat().st_size == limit for f in folder.rglob("*")) else None
