"""The reference-parity tier's record: which registered algorithm, sampler step or scorer a test checks, and
against which function of the authors' code (repository, commit, file, function) it was transcribed.

A parity test computes the same random inputs through our code and through a short transcription, written in
the test module, of the authors' function; it asserts equality, or the exact documented relation where we
depart on purpose (docs/departures.md). ``test_coverage.py`` checks every registered name has one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One function of the authors' code, at a commit a reader can check out."""

    repo: str
    """GitHub owner/name, e.g. "yifan123/flow_grpo"."""
    commit: str
    """The full 40-hex commit the transcription was read at."""
    file: str
    function: str

    def __post_init__(self):
        assert re.fullmatch(r"[0-9a-f]{40}", self.commit), f"{self.repo}: commit {self.commit!r} is not 40 hex"
        assert re.fullmatch(r"[\w.-]+/[\w.-]+", self.repo), self.repo

    def __str__(self) -> str:
        return f"{self.repo}@{self.commit[:10]} `{self.file}` `{self.function}`"


@dataclass(frozen=True)
class Parity:
    covers: tuple[str, ...]
    """Registered names the test checks: "algorithm:grpo", "step:sde", "scorer:ocr"."""
    source: Source | None
    own: str
    """Where there is no authors' code (a scorer of ours): why, in one line."""


def transcribes(*covers: str, source: Source | None = None, own: str = "") -> Callable:
    """Marks a parity test with the registered names it covers and the authors' function it transcribes (or,
    with ``own``, why none exists)."""
    assert covers and (source is None) != (not own), "give a source or say why there is none"

    def mark(test: Callable) -> Callable:
        test.parity = Parity(tuple(covers), source, own)
        return test

    return mark
