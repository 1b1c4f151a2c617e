"""The scorer worker thread survives a batch that fails outside the scorer and resolves its jobs."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from reward_server.batching import ScorerWorker
from reward_server.scorers.base import ScoreOutcome
from shared.protocol import ErrorCode


class _Half:
    name = "half"
    score_range = (0.0, 1.0)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        return [0.5] * len(images)


def test_a_batch_failing_outside_the_scorer_fails_its_items_and_the_worker_goes_on() -> None:
    observed: list[int] = []

    def on_batch(size: int, seconds: float, outcomes: list[ScoreOutcome]) -> None:
        observed.append(size)
        if len(observed) == 1:
            raise RuntimeError("metrics backend broke")

    worker = ScorerWorker(_Half(), max_batch_size=4, batch_wait_s=0.0, max_queue_items=8, on_batch=on_batch)
    worker.start()
    image = np.zeros((4, 4, 1), np.uint8)

    async def two_jobs() -> tuple[list[ScoreOutcome], list[ScoreOutcome]]:
        first = await asyncio.wait_for(worker.submit([image] * 2, ["", ""], [{}, {}]), timeout=5)
        second = await asyncio.wait_for(worker.submit([image], [""], [{}]), timeout=5)
        return first.outcomes, second.outcomes

    try:
        failed, scored = asyncio.run(two_jobs())
        assert worker.alive and worker.queued_items == 0
    finally:
        worker.stop()
    assert [(o.error, o.score) for o in failed] == [(ErrorCode.INTERNAL, None)] * 2
    assert "the scorer worker failed on this batch" in failed[0].message
    assert [o.score for o in scored] == [0.5]
    assert not worker.alive
