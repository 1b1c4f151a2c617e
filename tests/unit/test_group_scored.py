"""``trainer.health.group_scored`` on one process (its group is itself): the chunks' rewards come back in order, a
chunk no replica scored gets NaN with the reason, and any other error reaches the caller as it was raised. Under
sequence parallelism (the group's other ranks receive the first rank's answer) it is exercised by
tests/integration/test_sequence_parallel_training.py."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from shared.rewards import RewardResult
from trainer.distributed import SingleProcess
from trainer.health import UNSCORED, group_scored
from trainer.rewards.errors import RewardClientError


def _done(value: object) -> Future:
    future: Future = Future()
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
    return future


def _result(*values: float) -> RewardResult:
    rewards = np.array(values)
    return RewardResult({"digit": rewards}, rewards.copy(), {"digit": {}})


def test_chunks_come_back_in_order_and_an_unscored_one_is_nan():
    backend = SingleProcess(torch.device("cpu"))
    futures = [_done(_result(0.1, 0.2)), _done(RewardClientError("every replica is out")), _done(_result(0.3))]
    first, lost, last = group_scored(backend, futures, [2, 3, 1], ["digit"], "RL epoch 1")
    assert first.combined.tolist() == [0.1, 0.2] and last.combined.tolist() == [0.3]
    assert np.isnan(lost.combined).all() and len(lost.combined) == 3
    assert all(error.startswith(f"{UNSCORED}:") for error in lost.errors["digit"].values())


def test_another_error_is_raised_as_it_was():
    backend = SingleProcess(torch.device("cpu"))
    with pytest.raises(ValueError, match="malformed"):
        group_scored(backend, [_done(_result(0.5)), _done(ValueError("malformed"))], [1, 1], ["digit"], "RL epoch 1")
