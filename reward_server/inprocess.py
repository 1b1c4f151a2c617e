"""A reward server without HTTP: the :class:`shared.rewards.RewardClient` contract over scorers loaded in this
process (tests and runs without servers)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reward_server.scorers import Scorer, build_scorers, run_scorer
from shared.rewards import Combination, RewardResult, check_batch


class InProcessRewardClient:
    """Calls loaded scorer objects directly, on one background thread.

    Images take the same path as on a server (uint8 ``[H, W, C]``, C = 1 is grayscale) and per-item failures
    are NaN exactly as over HTTP.
    """

    def __init__(
        self,
        scorers: Mapping[str, Scorer],
        weights: dict[str, float],
        *,
        batch_size: int = 32,
        combine_mode: str = "sum",
    ) -> None:
        """Args: ``scorers`` are loaded scorer objects; ``weights`` must only name scorers among them."""
        self.combination = Combination(weights, combine_mode)
        missing = [name for name in self.weights if name not in scorers]
        if missing:
            raise ValueError(f"weights name scorer(s) {missing} that are not given; have {sorted(scorers)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.scorers = dict(scorers)
        self.batch_size = batch_size
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-inproc")

    @classmethod
    def from_names(
        cls, weights: dict[str, float], *, batch_size: int = 32, combine_mode: str = "sum"
    ) -> InProcessRewardClient:
        """Build and load the weighted scorers from the scorer registry."""
        return cls(build_scorers(list(weights), load=True), weights, batch_size=batch_size, combine_mode=combine_mode)

    @property
    def weights(self) -> dict[str, float]:
        """Scorer name -> weight of its component in the combined reward."""
        return self.combination.weights

    failed_attempts = 0  # no requests to fail

    async def score_async(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        return await asyncio.wrap_future(self.submit(images, prompts, metadata))

    def submit(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> concurrent.futures.Future[RewardResult]:
        batch = check_batch(images, prompts, metadata)
        return self._executor.submit(self._score, *batch)

    def score(
        self, images: np.ndarray, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None
    ) -> RewardResult:
        return self.submit(images, prompts, metadata).result()

    def merge(self, parts: Sequence[RewardResult]) -> RewardResult:
        return self.combination.cat(parts)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> InProcessRewardClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardResult:
        components, errors = self.combination.empty(len(images))
        for start in range(0, len(images), self.batch_size):
            stop = min(start + self.batch_size, len(images))
            for name in self.weights:
                outcomes = run_scorer(
                    self.scorers[name], list(images[start:stop]), prompts[start:stop], metadata[start:stop]
                )
                for index, outcome in enumerate(outcomes, start):
                    if outcome.error is None:
                        components[name][index] = outcome.score
                    else:
                        errors[name][index] = f"{outcome.error.value}: {outcome.message}"
        return self.combination.result(components, errors, ["in-process"])
