"""bench/outputs.py, run as its README says: the table comparing the costs of a run's image outputs."""

from __future__ import annotations


def test_the_outputs_bench_prints_its_table():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "bench/outputs.py", "--side", "16", "--prompts", "2", "--samples", "2", "--repeats", "1"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and not line.startswith("| output")]
    assert [r[0] for r in rows] == [
        "| evaluation grid, PNG level 6 + TensorBoard re-encoding (before)",
        "| evaluation grid, PNG level 1, its bytes to TensorBoard (now)",
        "| rollout samples (2), JPEG q90, TensorBoard",
    ]
    assert all(float(r[1]) >= 0 and float(r[2].rstrip(" |")) > 0 for r in rows)
