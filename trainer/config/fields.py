"""The vocabulary config dataclasses are written in: range-checked numeric types (``PositiveInt``,
``Probability``, ...), the ``Selected`` marker of sections chosen by name, ``LocalPath`` for files and folders a
run reads, ``ConfigError``, and ``renamed`` for a key that has a new name.

Algorithm, model and sampler configs import only this module; ``trainer.config.building`` reads the markers.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message names the field and the fix."""


def renamed(raw: Mapping, section: str, old: str, new: str, default: object) -> Mapping:
    """``raw`` (a section's keys) with the retired key ``old`` read as ``new``, with a one-line warning naming the new
    key: old configs keep working. Both given (``new`` other than its ``default``) is a ConfigError."""
    if old not in raw:
        return raw
    raw = dict(raw)
    value = raw.pop(old)
    if raw.get(new, default) not in (default, value):
        raise ConfigError(f"{section}.{old} is the old name of {section}.{new}: give only {section}.{new}")
    logger.warning("warning: %s.%s is deprecated and read as %s.%s: rename it so", section, old, section, new)
    return {**raw, new: value}


def did_you_mean(name: object, names: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the registered name nearest to ``name`` (``SD3``: ``sd3``), or ``""``."""
    lower = {key.lower(): key for key in names}
    text = str(name).lower()
    close = [text] if text in lower else difflib.get_close_matches(text, lower, n=1, cutoff=0.6)
    return f"; did you mean {lower[close[0]]}?" if close else ""


@dataclasses.dataclass(frozen=True)
class Selected:
    """Marks a section whose dataclass is chosen by its ``name`` key from ``registry``."""

    registry: Callable[[], Mapping[str, type]]
    default: str


class Place:
    """Marks a text field naming a file or folder the run reads (``LocalPath``): a run's saved config holds it
    absolute, so that a resume, ``generate`` or ``export`` started in another folder finds it."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The range a numeric field must lie in (``Annotated[float, Bounds(0, 1)]``); None leaves a side open.
    NaN is never in range, and infinity only where ``high`` is ``math.inf``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """Whether ``low`` itself is excluded."""
    high_open: bool = False
    """Whether ``high`` itself is excluded."""

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and (
            math.isnan(value) or (math.isinf(value) and not (value > 0 and self.high == math.inf))
        ):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a finite number"


PositiveInt = Annotated[int, Bounds(1)]
NonNegativeInt = Annotated[int, Bounds(0)]
PositiveFloat = Annotated[float, Bounds(0, low_open=True)]
NonNegativeFloat = Annotated[float, Bounds(0)]
Probability = Annotated[float, Bounds(0, 1)]
FiniteFloat = Annotated[float, Bounds()]
Decay = Annotated[float, Bounds(0, 1, high_open=True)]
"""An exponential decay rate (Adam's betas, an EMA's decay)."""
Seed = Annotated[int, Bounds(0, 2**63 - 1)]
"""A random seed: torch generators take a non-negative 64-bit integer."""
LocalPath = Annotated[str, Place()]
"""A file or folder the run reads, relative to the folder it starts in ("" where it reads none)."""
OptionalLocalPath = Annotated[str | None, Place()]


def hub_id(path: str) -> bool:
    """Whether ``path`` names no file or folder here and reads as a Hugging Face Hub id ("org/name"), which
    users give where a local folder is meant."""
    return not os.path.exists(path) and re.fullmatch(r"\w[\w.-]*/\w[\w.-]*", path) is not None
