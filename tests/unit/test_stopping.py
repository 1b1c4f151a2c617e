"""A stop signal (SIGTERM, SIGUSR1) is recorded, not obeyed on the spot: the trainer asks at its step boundaries,
and a run stopped so says after which step it stopped and which checkpoint holds it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import shared.interrupt
from trainer.checkpoint import Progress
from trainer.config import load_config
from trainer.display import Display
from trainer.distributed import SingleProcess
from trainer.launch import finishing, signalled_at
from trainer.stopping import StopRequests, StopsBeforeTraining, StopSignalled


def test_the_first_stop_signal_is_recorded_and_the_handlers_are_restored_after(capfd):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    stops = StopRequests(SingleProcess(torch.device("cpu")))
    assert stops.asked() == 0
    with stops:
        os.kill(os.getpid(), signal.SIGUSR1)  # the process lives on: its default action would end it
        os.kill(os.getpid(), signal.SIGTERM)  # a second one changes nothing
        assert stops.received == signal.SIGUSR1 and stops.asked() == signal.SIGUSR1
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before
    assert capfd.readouterr().err.count("SIGUSR1 received: the run stops after this warm-up step or RL epoch") == 1
    assert str(StopSignalled(signal.SIGTERM)) == "SIGTERM received"


def test_a_first_ctrl_c_is_a_stop_request_said_at_once_and_a_second_stops_now(capfd, monkeypatch):
    """Ctrl-C in training stopped the run where it was (a first one now ends the step and checkpoints it, as a stop
    signal does); a Ctrl-C the shell ignored (a background job's) stays ignored."""
    monkeypatch.setattr(shared.interrupt, "_asked", False)  # the second Ctrl-C records itself there
    # Python's own Ctrl-C handler, unblocked, as a process started from a terminal has it: an earlier test on this
    # worker may leave it replaced (getsignal None: a library's C handler, which StopRequests leaves alone) or blocked
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    before = signal.getsignal(signal.SIGINT)
    stops = StopRequests(
        SingleProcess(torch.device("cpu")), finishing=lambda: "finishing RL epoch 3 of 8 and saving a checkpoint"
    )
    with stops:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the run goes on to its step's end
        assert stops.asked() == signal.SIGINT and not shared.interrupt.interrupted()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert shared.interrupt.interrupted() and signal.getsignal(signal.SIGINT) == before
    assert capfd.readouterr().err == (
        "\nCtrl-C: finishing RL epoch 3 of 8 and saving a checkpoint; Ctrl-C again to stop now\n"
    )
    assert str(StopSignalled(signal.SIGINT)) == "interrupted"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequests(SingleProcess(torch.device("cpu"))):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_first_ctrl_c_says_what_the_run_finishes_before_it_stops():
    """The unit the loop is in until it moves on: a Ctrl-C while warm-up step 4's checkpoint was written said "step 5"
    (from the progress, already counting step 4), and the run stopped after step 4."""
    config = load_config(overrides=["train.warmup_steps=10", "train.epochs=4"])
    display = Display(config.logging, is_main=False)
    said = lambda progress: finishing(progress, config, display)  # noqa: E731
    warmup = display.steps(range(3, 10), "warm-up (SFT)", "step", "warm-up step")
    next(warmup)
    assert said(Progress(3, 0)) == said(Progress(4, 0)) == "finishing warm-up step 4 of 10 and saving a checkpoint"
    list(warmup)
    with display.evaluating(10):
        assert said(Progress(10, 0)) == "finishing the evaluation before RL and saving a checkpoint"
    rl = display.steps(range(1, 4), "RL", "epoch", "RL epoch")
    next(rl)
    assert said(Progress(10, 1, True)) == "finishing RL epoch 2 of 4 and saving a checkpoint"
    with display.evaluating(10):
        assert said(Progress(10, 2, True)) == "finishing the evaluation after RL epoch 2 and saving a checkpoint"
    list(rl)
    assert said(Progress(10, 4, True)) == "finishing the final evaluation, which ends the run"


def test_a_run_stopped_by_a_signal_says_after_which_step_and_names_its_checkpoint(tmp_path):
    config = load_config(overrides=["train.warmup_steps=10", "train.epochs=4"])
    where = lambda progress: signalled_at(progress, config, tmp_path)  # noqa: E731
    assert where(Progress(3, 0)) == f"stopped after warm-up step 3 of 10; its checkpoint: {tmp_path}"
    assert where(Progress(10, 0, True)).startswith("stopped after the evaluation before RL;")
    assert where(Progress(10, 2, True)).startswith("stopped after RL epoch 2 of 4;")
    assert where(Progress(10, 2, True, eval_due=True)).startswith(
        "stopped after RL epoch 2 of 4 (its evaluation runs first when the run continues);"
    )


def test_a_stop_signal_during_set_up_passes_the_except_exception_of_code_it_interrupts():
    """A SIGTERM while diffusers loaded the weights became its OSError ('Unable to load weights ...'), a traceback
    and exit status 1: its load_state_dict catches Exception and tries another way."""

    def load_with_a_fallback() -> str:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        except Exception:
            return "swallowed"
        return "not interrupted"

    before = signal.getsignal(signal.SIGTERM)
    with StopsBeforeTraining(), pytest.raises(StopSignalled, match="SIGTERM received"):
        load_with_a_fallback()
    assert signal.getsignal(signal.SIGTERM) == before


def test_an_error_that_a_stop_signal_became_in_set_up_is_that_stop():
    """safetensors' weight loading made a ValueError of what the handler raised inside it, and diffusers an OSError
    of that: a traceback and exit status 1 instead of the stop's one line and 143."""

    def load_in_a_library():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    with pytest.raises(StopSignalled, match="SIGTERM received"), StopsBeforeTraining():
        load_in_a_library()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(OSError, match="no room"), StopsBeforeTraining():  # no signal: the error is the error
        raise OSError("no room")
    assert signal.getsignal(signal.SIGTERM) == before
