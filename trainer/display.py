"""What the person watching a run sees between its printed lines (rank 0): on a terminal, tqdm's progress bars;
elsewhere (output to a file: nohup, SLURM), where a bar's redraws would run into the lines, a progress line
whenever nothing was printed for ``logging.progress_every_s`` seconds, saying what the run is doing, how far it is,
how fast it goes and when it will be done."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator

from tqdm.auto import tqdm


class Display:
    """The run's printed lines (``write``) and its progress: a phase is a ``steps`` range of counted units (warm-up
    steps, RL epochs), ``done`` after each, ``doing`` within one (a rollout chunk, the updates, an evaluation)."""

    def __init__(self, logging, is_main: bool, clock: Callable[[], float] = time.monotonic):
        self.is_main = is_main
        self.bars = is_main and logging.progress and sys.stderr.isatty()
        self.every_s = logging.progress_every_s if is_main and logging.progress and not self.bars else 0.0
        self.clock = clock
        self._said = clock()  # when a line was last printed
        self._phase: tuple[str, str, int, int, float] | None = None  # name, unit, first, total, started
        self._done = 0
        self._noun = ""
        self.current: int | None = None  # the unit the loop is in, from 1 (None between phases)
        self.in_evaluation = False
        self._since = 0.0  # when the unit under way started
        self._shown: dict[str, float] = {}
        self._doing = ""

    def steps(self, steps: range, name: str, unit: str, noun: str) -> Iterator[int]:
        """``steps`` (units ``steps.start`` to ``steps.stop`` of a phase of ``steps.stop``) as phase ``name``,
        under a bar on a terminal; ``noun`` names a unit ("RL epoch") in ``under_way``."""
        self._phase = name, unit, steps.start, steps.stop, self.clock()
        self._done, self._since, self._noun = steps.start, self.clock(), noun
        self._shown, self._doing = {}, ""
        for step in tqdm(steps, desc=name, disable=not self.bars):
            self.current = step + 1
            yield step
        self.current = None

    def under_way(self) -> str | None:
        """The unit the phase's loop is in, until the loop moves on ("RL epoch 3 of 100"); None between phases."""
        return None if self.current is None else f"{self._noun} {self.current} of {self._phase[3]}"

    def done(self, done: int, metrics: dict[str, float]) -> None:
        """``done`` units of the phase are done; the last one's losses and mean reward are shown."""
        self._done, self._since, self._doing = done, self.clock(), ""
        self._shown = {k: v for k, v in metrics.items() if k.endswith("loss") or k == "reward_mean"}
        self._show()

    def doing(self, what: str) -> None:
        """The run is at ``what`` within the phase's next unit (e.g. "sampling rollout chunk 2 of 8")."""
        self._doing = what
        self._show()

    @contextlib.contextmanager
    def evaluating(self, prompts: int) -> Iterator[None]:
        """Within an evaluation of ``prompts`` prompts (``in_evaluation``)."""
        self.in_evaluation = True
        self.doing(f"evaluating ({prompts} prompts)")
        try:
            yield
        finally:
            self.in_evaluation = False

    def write(self, text: str) -> None:
        """Print a line of the run (rank 0), apart from a bar on a terminal."""
        if self.is_main:
            tqdm.write(text) if self.bars else print(text, flush=True)
            self._said = self.clock()

    def _show(self) -> None:
        if self.every_s and self._phase is not None and self.clock() - self._said >= self.every_s:
            self.write(self.line())

    def line(self) -> str:
        """E.g. "[progress] RL: 2/100 epochs (2%), 42.1 s/epoch, ETA 1h08m, reward_mean 0.41; epoch 3 for 12s:
        sampling rollout chunk 5 of 8" (a rate and time left once a unit is done here; then the last one's loss or
        reward; then what the run is at)."""
        name, unit, first, total, started = self._phase
        now = self.clock()
        parts = [f"{self._done}/{total} {unit}s ({self._done / max(total, 1):.0%})"]
        if first < self._done < total:
            rate = (self._done - first) / max(now - started, 1e-9)
            parts.append(f"{rate:.2f} {unit}s/s" if rate >= 1 else f"{1 / rate:.1f} s/{unit}")
            parts.append(f"ETA {duration((total - self._done) / rate)}")
        parts += [f"{k} {v:.4g}" for k, v in self._shown.items()]
        line = f"[progress] {name}: " + ", ".join(parts)
        if self._doing:
            at = f"{unit} {self._done + 1} for {duration(now - self._since)}" if self._done < total else "then"
            line += f"; {at}: {self._doing}"
        return line


def duration(seconds: float) -> str:
    """``seconds`` as "1h08m", "4m09s" or "12s"."""
    if not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
