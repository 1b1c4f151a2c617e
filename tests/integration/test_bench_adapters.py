"""bench/adapters.py end to end on the tiny models of the two families whose plain pipelines need bench/plain.py
(HunyuanVideo 1.5's VAE decodes one clip at a time; LTX-2's pipeline vocodes audio it has no vocoder for): each
row has every column, and the ratios are finite and positive."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


@pytest.mark.slow  # two tiny video families, one pair of calls per column: about 16 s on one core
def test_the_bench_compares_the_video_families_whose_pipelines_need_stand_ins():
    names = ("ltx2", "hunyuan_video15")
    command = [sys.executable, "bench/adapters.py", "--names", ",".join(names), "--repeats", "1", "--threads", "1"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("adapter "))
    for name in names:
        cells = next(line.split() for line in lines if line.startswith(f"{name} "))
        assert len(cells) == len(header), (header, cells)
        ratios = [float(cell[:-1]) for cell in cells if cell.endswith("x")]
        assert len(ratios) == 7 and all(math.isfinite(r) and r > 0 for r in ratios), cells
