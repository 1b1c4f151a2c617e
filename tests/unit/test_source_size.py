"""No source file of the packages over 450 lines: a file that long holds several things (STYLE.md)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_source_file_is_over_450_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in ("trainer", "reward_server", "shared")
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert len(sizes) > 50
    assert {path: lines for path, lines in sizes.items() if lines > 450} == {}
