"""The reward server tests' fixtures: a pool of two ``python -m reward_server`` replicas (the production path),
an HTTP client of its first replica, and the in-process client scores are compared with (one of each per module)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fixtures_reward_server import POOL_LIMITS, SCORERS

from reward_server.inprocess import InProcessRewardClient
from trainer.rewards import LocalRewardPool


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRewardPool]:
    log_dir = tmp_path_factory.mktemp("pool")
    with LocalRewardPool(SCORERS, replicas=2, log_dir=log_dir, extra_args=POOL_LIMITS, ready_timeout_s=60) as running:
        yield running


@pytest.fixture(scope="module")
def http(pool: LocalRewardPool) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=pool.urls[0], trust_env=False, timeout=30.0) as client:
        yield client


@pytest.fixture(scope="module")
def in_process() -> Iterator[InProcessRewardClient]:
    with InProcessRewardClient.from_names({"digit": 1.0, "brightness": 0.5, "jpeg_compressibility": 0.1}) as client:
        yield client
