"""What the reward server tests (tests/integration/serving/) share: the pool's scorers and limits, stub scorers,
items and test images."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from servers import free_port
from sklearn.datasets import load_digits

from shared.imagecodec import encode_image

SCORERS = ["digit", "brightness", "jpeg_compressibility"]
POOL_LIMITS = ["--max-items", "16", "--max-body-bytes", "300000", "--max-image-side", "64"]


def dead_url() -> str:
    """A loopback URL with nothing listening (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(0.02)


async def queued(app: Any, items: int, scorer: str = "slow", timeout_s: float = 10.0) -> None:
    """Wait until ``scorer``'s queue holds ``items`` items (a request is in, not just sent)."""

    async def poll() -> None:
        while app.state.service.workers[scorer].queued_items < items:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


class StubScorer:
    """A scorer for server behaviour tests: waits ``delay_s`` per batch, loads when ``gate`` opens."""

    description = "test scorer"
    score_range = (0.0, 1.0)

    def __init__(
        self,
        name: str = "slow",
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
        version: str = "t-v1",
    ) -> None:
        self.name = name
        self.delay_s = delay_s
        self.gate = gate
        self.version = version

    def load(self) -> None:
        if self.gate is not None:
            self.gate.wait(timeout=60)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        time.sleep(self.delay_s)
        return [0.5] * len(images)


def score_item(
    item_id: str, image: np.ndarray, prompt: str = "digit 1", wire_format: str = "png", **extra: Any
) -> dict:
    return {"id": item_id, "prompt": prompt, "image": encode_image(image, wire_format), **extra}


def digit_images(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out sklearn digits as uint8 [B, 16, 16, 1] (bright = ink) and their labels."""
    digits = load_digits()
    indices = np.random.default_rng(0).permutation(len(digits.target))[900 : 900 + count]
    images = np.stack([np.kron(digits.images[i], np.ones((2, 2))) for i in indices]) * 255 / 16
    return np.round(images).astype(np.uint8)[..., None], digits.target[indices]
