"""A write cut by the process's file size limit (RLIMIT_FSIZE, as `ulimit -f` or a batch system sets it) is said as
one, EFBIG naming the folder, like a full disk: safetensors reports it as a bare "I/O error", and the probe write
that finds a full disk (1 MiB) fits under a limit of 1 MiB or more, so a checkpoint or best/ write cut by it ended
the run in a traceback."""

from __future__ import annotations

import errno
import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRITE = """
import sys, torch
from pathlib import Path
from safetensors.torch import save_file
from trainer.disk import diagnosed_writes

folder = Path(sys.argv[1])
try:
    with diagnosed_writes(folder):
        (folder / "part").mkdir()
        if sys.argv[2] == "safetensors":
            save_file({"w": torch.zeros(1 << 20)}, folder / "part" / "w.safetensors")
        else:
            torch.save({"w": torch.zeros(1 << 20)}, folder / "part" / "w.pt")
except OSError as exc:
    print(exc.errno, exc.filename, exc.strerror)
"""


@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_a_write_past_the_file_size_limit_is_efbig_naming_the_folder(tmp_path, writer):
    limit = 1 << 20  # a 4 MiB tensor does not fit; the 1 MiB probe does

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", WRITE, str(tmp_path), writer],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    code, folder, said = done.stdout.split(" ", 2)
    assert (int(code), folder) == (errno.EFBIG, str(tmp_path)), done.stdout
    assert said.startswith("File too large (") and said.rstrip().endswith("MiB free there)"), said
