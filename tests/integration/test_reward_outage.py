"""A reward pool that goes away, over real HTTP (a ``python -m reward_server`` replica, SIGKILLed): a request
waits up to ``reward.outage_s`` for a replica to come back and is then scored; a run whose pool stays away
stops with a checkpoint of its finished work, and continuing it gives the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from warm_start import tiny_trainer

from trainer.checkpoint import Progress
from trainer.health import RewardFailure
from trainer.rewards import HttpRewardClient, LocalRewardPool, RewardRequestError, RewardUnavailableError
from trainer.stopping import StopSignalled

TINY = [
    "algorithm.group_size=2",
    "algorithm.sampler.num_steps=4",
    "algorithm.sampler.window_range=[0,2]",
    "data.prompts_per_epoch=4",
    "eval.samples_per_prompt=1",
    "eval.num_steps=2",
    "eval.every=1",
    "train.warmup_steps=2",
    "train.epochs=3",
    "train.checkpoint_every=0",
    "train.keep_checkpoints=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]
COMPARED = ("policy_loss", "grad_norm", "reward_mean", "reward_std", "digit_accuracy", "sft_loss")


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Iterator[LocalRewardPool]:
    with LocalRewardPool(["digit"], replicas=1, log_dir=tmp_path_factory.mktemp("outage")) as running:
        yield running


@pytest.fixture
def up(pool) -> Iterator[LocalRewardPool]:
    """The pool, serving again after the test whatever the test did to it."""
    yield pool
    if pool.exited(0):
        pool.restart(0)


def _client(pool: LocalRewardPool, outage_s: float) -> HttpRewardClient:
    return HttpRewardClient(
        pool.urls, {"digit": 1.0}, outage_s=outage_s, backoff_s=0.01, max_retries=2, probe_interval_s=0.1, timeout_s=10
    )


def _images() -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8), [f"a handwritten digit {d}" for d in range(6)]


def test_a_request_waits_for_a_restarting_replica_and_is_scored(up, caplog):
    images, prompts = _images()
    with _client(up, outage_s=60) as client:
        expected = client.score(images, prompts).combined
        assert client.failed_attempts == 0
        up.kill(0)
        restart = threading.Timer(1.0, up.restart, args=(0,))
        restart.start()
        with caplog.at_level(logging.WARNING, logger="rewardflow.rewards"):
            got = client.score(images, prompts)
        restart.join()
        assert client.failed_attempts >= 3  # max_retries 2: three before it waits (the epoch line says so)
    np.testing.assert_array_equal(got.combined, expected)  # each its own reward, none NaN
    assert got.num_failed == 0 and np.isfinite(expected).all()
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting up to 60 s for one to come back" in m for m in messages), messages
    assert any("back in rotation" in m and "without any" in m for m in messages), messages


def test_a_request_whose_replicas_stay_away_past_outage_s_fails_saying_so(up):
    images, prompts = _images()
    with _client(up, outage_s=1.0) as client:
        client.score(images, prompts)
        up.kill(0)
        started = time.monotonic()
        with pytest.raises(RewardUnavailableError, match=r"no replica back in rotation within reward.outage_s = 1 s"):
            client.score(images, prompts)
        assert 1.0 <= time.monotonic() - started < 10
    with _client(up, outage_s=0) as client:  # no waiting: the attempts alone, as before
        started = time.monotonic()
        with pytest.raises(RewardUnavailableError, match="after 3 attempts"):
            client.score(images, prompts)
        assert time.monotonic() - started < 5


def _records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: r[k] for k in ("phase", "step", *COMPARED) if k in r}
        for r in rows
        if r["phase"] in ("warmup", "rl", "eval", "final")
    ]


def _run(
    run_dir: Path, model_dir: str, pool: LocalRewardPool, before=None, resume: Path | None = None, outage_s: float = 0
):
    """A tiny run scored by ``pool``; ``before(trainer, name, step)`` is called before each RL epoch and
    evaluation."""
    client = _client(pool, outage_s=outage_s)
    trainer = tiny_trainer(run_dir, model_dir, *TINY, rewards=client)
    client.give_up_waiting = lambda: bool(trainer.stops.received)  # as trainer/build.py sets it
    if before is not None:
        rl_epoch, evaluate = trainer.rl_epoch, trainer.evaluate
        trainer.rl_epoch = lambda epoch: (before(trainer, "rl", epoch), rl_epoch(epoch))[1]
        trainer.evaluate = lambda step, grid: (before(trainer, "eval", step), evaluate(step, grid))[1]
    try:
        if resume is not None:
            trainer.resume(resume)
        trainer.fit()
        return trainer
    finally:
        trainer.logger.close()
        client.close()


@pytest.fixture(scope="module")
def reference(pool, tmp_path_factory, tiny_model_dir) -> tuple[Path, list[torch.Tensor]]:
    """The run whose pool never went away: its directory and trained weights."""
    run_dir = tmp_path_factory.mktemp("reference")
    trainer = _run(run_dir, tiny_model_dir, pool)
    return run_dir, [p.detach().clone() for p in trainer.adapter.trainable.parameters()]


@pytest.mark.parametrize("lost", ["rl", "eval", "rl+stop"])
def test_a_pool_down_stops_the_run_with_a_checkpoint_and_continuing_gives_the_uninterrupted_run(
    lost, up, reference, tmp_path, tiny_model_dir
):
    """The pool dies before RL epoch 2 (or before the evaluation after epoch 1): the run stops with a
    RewardFailure and a checkpoint after epoch 1 (which puts that evaluation first); continued once the pool is
    back, its records and weights are those of the run that never lost its pool. rl+stop: a stop signal comes
    while the run waits for the pool (outage_s 60): it ends the wait, and the run stops as the signal asks."""

    def kill(trainer, name: str, step: int) -> None:
        if (name, step) == (lost.removesuffix("+stop"), 1):
            up.kill(0)
            if lost.endswith("+stop"):  # as the handler does, a moment into the wait
                threading.Timer(1.0, setattr, args=(trainer.stops, "received", signal.SIGTERM)).start()

    expected = {
        "rl": (RewardFailure, "no reward"),
        "eval": (RewardFailure, "the evaluation after RL epoch 1"),
        "rl+stop": (StopSignalled, "SIGTERM"),
    }[lost]
    started = time.monotonic()
    with pytest.raises(expected[0], match=expected[1]):
        _run(tmp_path / "lost", tiny_model_dir, up, before=kill, outage_s=60 if lost.endswith("+stop") else 0)
    assert time.monotonic() - started < 40  # not the 60 s of outage_s
    (checkpoint,) = (tmp_path / "lost" / "checkpoints").iterdir()
    saved = Progress.load(checkpoint)
    assert (saved.epochs_done, saved.eval_due) == (1, lost == "eval")
    up.restart(0)
    continued = _run(tmp_path / "lost", tiny_model_dir, up, resume=checkpoint)
    assert _records(tmp_path / "lost") == _records(reference[0])
    for a, b in zip(continued.adapter.trainable.parameters(), reference[1], strict=True):
        assert torch.equal(a, b)


def _until_given_up(caplog, within_s: float) -> None:
    """Wait for the supervisor's warning that it restarts a replica no more."""
    deadline = time.monotonic() + within_s
    while not any("not restarted" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.1)


def test_a_supervised_pool_restarts_a_replica_that_died_at_most_max_restarts_times(tmp_path, caplog):
    """What a run does with its own replicas: each one that exits is started again on its port, and serves."""
    with (
        LocalRewardPool(["digit"], replicas=1, log_dir=tmp_path) as pool,
        caplog.at_level(logging.WARNING, logger="rewardflow.rewards"),
    ):
        pool.supervise(max_restarts=1, interval_s=0.1)
        images, prompts = _images()
        with _client(pool, outage_s=60) as client:
            expected = client.score(images, prompts).combined
            first = pool.pid(0)
            pool.kill(0)
            got = client.score(images, prompts)  # waits for the supervisor's restart, then the probe
            assert pool.pid(0) != first and got.instances == [f"local-0-{pool.ports[0]}-r1"]
            np.testing.assert_array_equal(got.combined, expected)
            pool.kill(0)  # a second exit: past max_restarts, it stays down
            _until_given_up(caplog, within_s=5)
            assert pool.exited(0)
    restarting = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert len(restarting) == 1 and "exited with status -9" in restarting[0], restarting


def test_a_supervised_pool_counts_only_the_restarts_of_its_window(tmp_path, caplog):
    """A replica that dies now and then over a long run (an occasional OOM kill, a chaos bench's SIGKILLs) is started
    again every time: only ``max_restarts`` restarts within ``window_s`` are a crash loop that leaves it down. It
    was ``max_restarts`` over the pool's life, so a long run lost its replicas one by one."""
    with (
        LocalRewardPool(["digit"], replicas=1, log_dir=tmp_path) as pool,
        caplog.at_level(logging.WARNING, logger="rewardflow.rewards"),
    ):
        pool.supervise(max_restarts=1, interval_s=0.1, window_s=0.5)  # a restart takes longer than the window
        images, prompts = _images()
        with _client(pool, outage_s=60) as client:
            expected = client.score(images, prompts).combined
            for restart in (1, 2, 3):
                pool.kill(0)
                got = client.score(images, prompts)  # waits for the supervisor's restart, then the probe
                assert got.instances == [f"local-0-{pool.ports[0]}-r{restart}"]
                np.testing.assert_array_equal(got.combined, expected)
                time.sleep(0.5)  # the restart leaves the window
    assert not any("not restarted" in r.getMessage() for r in caplog.records)


def test_a_restarted_replica_that_never_gets_ready_is_killed_and_tried_again(tmp_path, caplog):
    """A restart that hangs (a model load that never ends, here a ready time no replica meets) does not leave a
    process out of rotation for good: it is killed, and the next check starts it again, up to max_restarts."""
    with (
        LocalRewardPool(["digit"], replicas=1, log_dir=tmp_path) as pool,
        caplog.at_level(logging.WARNING, logger="rewardflow.rewards"),
    ):
        pool.ready_timeout_s = 0.05  # no replica imports its scorers this fast
        pool.supervise(max_restarts=2, interval_s=0.1)
        pool.kill(0)
        _until_given_up(caplog, within_s=30)
        assert pool.exited(0)
    hung = [r.getMessage() for r in caplog.records if "did not restart" in r.getMessage()]
    assert len(hung) == 2 and all("not ready after 0.05 s" in m for m in hung), hung


def test_a_replica_restarted_with_another_token_leaves_rotation_and_the_others_score(tmp_path, caplog):
    """A 401 depends on the replica, not the request: the chunk goes to a replica that takes it. With no other
    replica in rotation, the refusal ends the request at once (no outage wait)."""
    with LocalRewardPool(["digit"], replicas=2, log_dir=tmp_path) as pool:
        images, prompts = _images()
        with _client(pool, outage_s=60) as client:
            expected = client.score(images, prompts).combined
            pool.kill(0)
            pool.env = {**os.environ, "REWARD_SERVER_TOKEN": "another"}  # replica 0 comes back with a token
            pool.restart(0)
            with caplog.at_level(logging.WARNING, logger="rewardflow.rewards"):
                for _ in range(3):  # the round-robin reaches replica 0 in these
                    np.testing.assert_array_equal(client.score(images, prompts).combined, expected)
            assert not client.replica_states()[pool.urls[0]]["available"]
            assert any("refused the request with HTTP 401" in r.getMessage() for r in caplog.records)
        with HttpRewardClient(pool.urls[:1], {"digit": 1.0}, outage_s=60, verify_replicas=False) as alone:
            started = time.monotonic()
            with pytest.raises(RewardRequestError, match="HTTP 401"):
                alone.score(images, prompts)
            assert time.monotonic() - started < 5


def test_an_evaluation_answered_without_a_single_reward_stops_the_run_with_a_checkpoint(tmp_path, tiny_model_dir):
    """Every image's 'sleep' score misses the request's deadline (TIMEOUT per item, HTTP 200): the evaluation
    before RL has no reward to judge by. It used to pass as reward_mean nan, and a run of no RL epochs then
    reported 'best: epoch -1, reward_mean -inf' and a best/ that was never written."""
    with (
        LocalRewardPool(
            ["digit", "sleep"], replicas=1, log_dir=tmp_path / "logs", extra_args=["--sleep-ms", "3000"]
        ) as pool,
        HttpRewardClient(pool.urls, {"digit": 1.0, "sleep": 0.5}, timeout_s=1, max_retries=0) as client,
    ):
        trainer = tiny_trainer(tmp_path / "run", tiny_model_dir, *TINY, rewards=client)
        try:
            with pytest.raises(RewardFailure, match=r"^the evaluation before RL: no image got a reward \(sleep: "):
                trainer.fit()
        finally:
            trainer.logger.close()
    (checkpoint,) = (tmp_path / "run" / "checkpoints").iterdir()  # the warm-up's: a resume evaluates first
    assert Progress.load(checkpoint) == Progress(2, 0, False) and not (tmp_path / "run" / "best").exists()


def test_an_evaluation_is_judged_while_some_rewards_and_every_alarm_scorer_came():
    from shared.rewards import RewardResult
    from trainer.evaluation import unscored_evaluation

    def result(combined, alarm) -> RewardResult:
        errors = {"ocr": {i: "TIMEOUT: deadline passed" for i, v in enumerate(alarm) if np.isnan(v)}}
        return RewardResult({"digit": np.array(combined), "ocr": np.array(alarm)}, np.array(combined), errors, [])

    nan = float("nan")
    assert unscored_evaluation("it", result([0.5, nan], [0.1, nan]), ["ocr"]) is None  # some of each
    assert unscored_evaluation("it", result([nan, nan], [0.1, 0.2]), []).startswith("it: no image got a reward")
    assert (
        unscored_evaluation("it", result([0.5, 0.2], [nan, nan]), ["ocr"])
        == "it: eval.alarm_scorers ocr scored no image (ocr: TIMEOUT: deadline passed)"
    )
    assert unscored_evaluation("it", result([0.5, 0.2], [nan, nan]), []) is None  # ocr is no alarm scorer here
