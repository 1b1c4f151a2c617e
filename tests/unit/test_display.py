"""Without a terminal (nohup, SLURM) a run printed nothing between its lines: 23 minutes of warm-up showed only the
run directory. A progress line now comes whenever nothing was printed for ``logging.progress_every_s``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from trainer.display import Display, duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_progress_line_comes_when_nothing_was_printed_for_the_interval(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    clock = Clock()
    display = Display(SimpleNamespace(progress=True, progress_every_s=60.0), is_main=True, clock=clock)
    steps = display.steps(range(100, 600), "warm-up (SFT)", "step", "warm-up step")
    assert list(steps)[:2] == [100, 101]
    clock.now += 30
    display.done(110, {"sft_loss": 0.4123, "grad_norm": 2.0})
    assert capsys.readouterr().out == ""  # 30 s: not yet
    clock.now += 30
    display.done(120, {"sft_loss": 0.4123, "grad_norm": 2.0})
    assert capsys.readouterr().out == (
        "[progress] warm-up (SFT): 120/600 steps (20%), 3.0 s/step, ETA 24m00s, sft_loss 0.4123\n"
    )
    clock.now += 59
    display.write("a line of the run")  # any line says the run is alive: the next progress line waits for it
    clock.now += 30
    display.doing("evaluating (8 prompts)")
    assert capsys.readouterr().out == "a line of the run\n"
    clock.now += 30
    display.doing("evaluating (8 prompts)")
    assert capsys.readouterr().out.endswith("sft_loss 0.4123; step 121 for 1m59s: evaluating (8 prompts)\n")


def test_no_progress_lines_on_a_terminal_off_rank_0_or_when_off(capsys, monkeypatch):
    for tty, rank0, every in ((True, True, 60.0), (False, False, 60.0), (False, True, 0.0)):
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        clock = Clock()
        display = Display(SimpleNamespace(progress=True, progress_every_s=every), is_main=rank0, clock=clock)
        list(display.steps(range(0, 10), "RL", "epoch", "RL epoch"))
        clock.now += 3600
        display.doing("sampling rollout chunk 1 of 2")
        assert "[progress]" not in capsys.readouterr().out


def test_durations_read_at_a_glance():
    assert [duration(s) for s in (0.4, 12, 249, 4080, 360000)] == ["0s", "12s", "4m09s", "1h08m", "100h00m"]
