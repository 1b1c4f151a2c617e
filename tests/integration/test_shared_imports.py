"""A fresh interpreter importing the reward protocol (shared.protocol, shared.wire, shared.imagecodec) loads no
torch: the reward server's images and other clients of the protocol do without it."""

from __future__ import annotations

import subprocess
import sys


def test_shared_does_not_import_torch() -> None:
    code = "import sys, shared.protocol, shared.wire, shared.imagecodec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
