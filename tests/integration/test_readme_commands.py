"""The shell commands of the README and the docs pages that pick a run out of ``outputs/`` pick the newest: ``ls -d
outputs/*/final | tail -1`` took the run whose name sorts last (a named run, ``toy``, after every dated one), not
the newest."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_readme_command_that_picks_a_run_picks_the_newest(tmp_path):
    picks = [pick for page in PAGES for pick in re.findall(r"\$\((ls [^)]*outputs/[^)]*)\)", page.read_text())]
    assert picks  # the generate example's --weights (README.md, docs/concepts.md)
    for age, name in ((300, "zz-named-run"), (200, "20261201-090000"), (100, "20261202-090000")):
        final = tmp_path / "outputs" / name / "final"
        final.mkdir(parents=True)
        os.utime(final, (1_000_000 - age, 1_000_000 - age))
    for pick in picks:
        chosen = subprocess.run(["bash", "-c", pick], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
        assert chosen == "outputs/20261202-090000/final\n", pick
