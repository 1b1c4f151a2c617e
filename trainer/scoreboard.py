"""The scoreboard of a run's evaluations: which one was best (``train.select_by``, kept in ``<run>/best/``), when
to stop early (``train.early_stop``), and the reward-hacking alarm (the held-out reward rises while an alarm
metric falls). It keeps its own checkpoint state (``trainer.state.Stateful``), so a resumed run judges alike.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

import torch

from trainer.state import State

REWARD = "reward_mean"
"""The evaluation's training reward: the reward's combination scored on the held-out samples."""


@dataclass(frozen=True)
class Alarm:
    """The reward rose from ``reward_then`` to ``reward_now`` while alarm metric ``metric`` fell from ``metric_then`` to
    ``metric_now`` between evaluations at epochs ``since`` and ``epoch``."""

    epoch: int
    since: int
    metric: str
    reward_then: float
    reward_now: float
    metric_then: float
    metric_now: float

    def message(self) -> str:
        return (
            f"reward-hacking alarm at epoch {self.epoch}: the held-out {REWARD} rose {self.reward_then:.3f} -> "
            f"{self.reward_now:.3f} since epoch {self.since} while {self.metric} fell {self.metric_then:.3f} -> "
            f"{self.metric_now:.3f}"
        )

    def numbers(self) -> dict[str, float]:
        return {
            "since": self.since,
            "reward_then": self.reward_then,
            "reward_now": self.reward_now,
            "metric_then": self.metric_then,
            "metric_now": self.metric_now,
        }


def hacking_alarm(epochs: list[int], history: dict[str, list[float]], window: int, margin: float) -> Alarm | None:
    """The alarm over the last ``window`` evaluations: with r the held-out reward and g an alarm metric (every
    metric but the reward), it fires when r[-1] > r[-1-window] and g[-1-window] - g[-1] > margin (the first
    alarm metric in name order that does); None otherwise or with fewer than window + 1 evaluations."""
    if len(epochs) <= window or REWARD not in history:
        return None
    rewards = history[REWARD]
    then, now = rewards[-1 - window], rewards[-1]
    if not now > then:  # NaN (no reward) never rises
        return None
    for name in sorted(history):
        values = history[name]
        if name != REWARD and values[-1 - window] - values[-1] > margin:
            return Alarm(epochs[-1], epochs[-1 - window], name, then, now, values[-1 - window], values[-1])
    return None


@dataclass(frozen=True)
class Verdict:
    """What one evaluation decides: whether it is the new best, the alarm it raised, why to stop (or "")."""

    improved: bool
    alarm: Alarm | None
    stop: str


class Scoreboard:
    """Tracks the evaluations of a run (maximising ``select_by``); ``observe`` judges each one."""

    def __init__(self, select_by: str, early_stop: int, alarm_window: int, alarm_margin: float):
        self.select_by = select_by
        self.early_stop = early_stop
        self.alarm_window, self.alarm_margin = alarm_window, alarm_margin
        self.epochs: list[int] = []
        self.history: dict[str, list[float]] = {}
        self.best_epoch, self.best_value = -1, -math.inf
        self.since_best = 0
        self.alarm_epoch = -1
        """Epoch of the last alarm (-1: none); an alarm is raised once until the best improves."""
        self.stopped = False

    def observe(self, epoch: int, metrics: dict[str, float]) -> Verdict:
        """Record the evaluation of ``epoch`` and judge it; a ``select_by`` it lacks is a ValueError."""
        if self.select_by not in metrics:
            raise ValueError(
                f"train.select_by={self.select_by!r} is not an evaluation metric; the evaluation logs: "
                f"{', '.join(sorted(metrics))}"
            )
        for name in sorted(set(metrics) | set(self.history)):
            self.history.setdefault(name, [math.nan] * len(self.epochs)).append(float(metrics.get(name, math.nan)))
        self.epochs.append(epoch)
        value = float(metrics[self.select_by])
        improved = value > self.best_value  # NaN never improves
        if improved:
            self.best_epoch, self.best_value, self.since_best = epoch, value, 0
        else:
            self.since_best += 1
        alarm = hacking_alarm(self.epochs, self.history, self.alarm_window, self.alarm_margin)
        if alarm is not None and self.alarm_epoch >= self.best_epoch:
            alarm = None  # already raised for this best
        if alarm is not None:
            self.alarm_epoch = epoch
        stop = ""
        if self.early_stop and self.since_best >= self.early_stop:
            stop = (
                f"early stop: {self.select_by} has not improved on epoch {self.best_epoch}'s "
                f"{self.best_value:.4g} in {self.since_best} evaluations (train.early_stop={self.early_stop})"
            )
        return Verdict(improved, alarm, stop)

    def report(self, best_dir: object | None, export_flags: str) -> str:
        """Which evaluation was best, by how much (over the first, before RL) and where its weights are (None: not
        in this run, which continued another run's checkpoint without them)."""
        values = self.history.get(self.select_by, [math.nan])
        which = "before RL" if self.best_epoch == 0 else f"epoch {self.best_epoch}"
        last = self.epochs[-1] if self.epochs else -1
        where = (
            "not in this run (it continued a checkpoint of another run, which no longer holds them)"
            if best_dir is None
            else f"{best_dir} (export: python -m trainer.export --checkpoint "
            f"{shlex.quote(str(best_dir))} {export_flags}--out DIR)"
        )
        return (
            f"best: {which}, {self.select_by} {self.best_value:.3f} (before RL {values[0]:.3f}, "
            f"{self.best_value - values[0]:+.3f}; last, epoch {last}: {values[-1]:.3f}); its weights: {where}"
        )

    def checkpoint_state(self) -> dict[str, State]:
        scalars = [self.best_epoch, self.best_value, self.since_best, self.alarm_epoch, float(self.stopped)]
        tensors = {
            "scalars": torch.tensor(scalars, dtype=torch.float64),
            "epochs": torch.tensor(self.epochs, dtype=torch.int64),
        }
        tensors.update(
            {f"metric/{name}": torch.tensor(values, dtype=torch.float64) for name, values in self.history.items()}
        )
        return {"scoreboard": State(tensors)}

    def load_checkpoint_state(self, saved: dict[str, dict[str, torch.Tensor]], source: object) -> None:
        state = saved.get("scoreboard", saved.get("guard"))  # checkpoints before 2026-12: "guard", "guard/<scorer>"
        if state is None:  # a checkpoint from before the scoreboard: judging starts afresh
            return
        best_epoch, self.best_value, since, alarm_epoch, stopped = state["scalars"].tolist()
        self.best_epoch, self.since_best, self.alarm_epoch = int(best_epoch), int(since), int(alarm_epoch)
        self.stopped = bool(stopped)
        self.epochs = state["epochs"].tolist()
        self.history = {
            re.sub(r"^guard/", "alarm/", key.removeprefix("metric/")): values.tolist()
            for key, values in sorted(state.items())
            if key.startswith("metric/")
        }
