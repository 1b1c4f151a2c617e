"""Failover over real HTTP: three ``python -m reward_server`` replicas, one SIGKILLed mid-run and restarted.

Every sample must still get its own reward (no 0-fill, no NaN) from the survivors, and the restarted
replica must be re-admitted by the client's background probe and serve requests again.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest

from reward_server.sleep_scorer import subsampled_brightness
from trainer.rewards import HttpRewardClient, LocalRewardPool

NUM_REPLICAS = 3
BATCH = 24
SIDE = 32
MAX_ROUNDS = 200
MAX_SECONDS = 60.0


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRewardPool]:
    # A 20 ms hold per micro-batch keeps requests in flight when the replica is killed.
    with LocalRewardPool(
        ["sleep"],
        replicas=NUM_REPLICAS,
        log_dir=tmp_path_factory.mktemp("failover"),
        extra_args=["--sleep-ms", "20", "--max-batch-size", "4", "--batch-wait-ms", "1"],
        ready_timeout_s=60,
    ) as running:
        yield running


def _batch(round_index: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct images per round, with their known ``sleep`` scores (never 0)."""
    rng = np.random.default_rng(round_index)
    images = rng.integers(1, 256, (BATCH, SIDE, SIDE, 3), dtype=np.uint8)
    return images, np.array([subsampled_brightness(image) for image in images])


def test_sigkill_mid_run_then_restart(pool: LocalRewardPool) -> None:
    victim = 1
    restarted_instance = f"local-{victim}-{pool.ports[victim]}-r1"
    served: Counter[str] = Counter()
    phase = "before"
    killed_at_round = restarted_at_round = readmitted_at_round = None
    started = time.monotonic()
    with HttpRewardClient(
        pool.urls,
        {"sleep": 1.0},
        batch_size=4,
        max_concurrency=6,
        timeout_s=10,
        backoff_s=0.01,
        max_retries=4,
        probe_interval_s=0.1,
    ) as client:
        for round_index in range(MAX_ROUNDS):
            assert time.monotonic() - started < MAX_SECONDS, f"no re-admission after {round_index} rounds"
            images, expected = _batch(round_index)
            future = client.submit(images, [f"round {round_index}"] * BATCH)
            if round_index == 5:  # kill while this round's requests are in flight
                time.sleep(0.01)
                pool.kill(victim)
                killed_at_round, phase = round_index, "down"
            result = future.result(timeout=30)
            np.testing.assert_array_equal(result.combined, expected)  # each sample its own reward
            assert not np.isnan(result.combined).any() and result.num_failed == 0
            served.update((phase, instance) for instance in result.instances)
            # A SIGKILL can surface as a connection refused (out at once) or as a dead keep-alive connection
            # (one strike of breaker_failures): how many rounds the breaker needs depends on scheduling.
            breaker_open = not client.replica_states()[pool.urls[victim]]["available"]
            if phase == "down" and round_index >= killed_at_round + 30:
                assert breaker_open, "breaker did not open within 30 rounds of the kill"
            if phase == "down" and round_index >= killed_at_round + 5 and breaker_open:
                restart = threading.Thread(target=pool.restart, args=(victim,))
                restart.start()  # scoring goes on while the replica starts
                phase, restarted_at_round = "restarting", round_index
            elif phase == "restarting" and not restart.is_alive():
                restart.join()
                phase = "after"
            elif phase == "after" and ("after", restarted_instance) in served:
                readmitted_at_round = round_index
                break
        states = client.replica_states()
    assert killed_at_round is not None and restarted_at_round is not None
    assert readmitted_at_round is not None, f"restarted replica never served again: {served}"
    assert all(state["available"] for state in states.values())
    survivors = {f"local-{i}-{pool.ports[i]}" for i in range(NUM_REPLICAS) if i != victim}
    down_instances = {instance for phase_name, instance in served if phase_name == "down"}
    assert down_instances <= survivors, "the killed replica answered while it was down"
