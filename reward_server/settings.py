"""Behaviour settings of one reward server process (limits, batching, drain, auth)."""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import dataclass, field

from reward_server.scorers.frames import FrameSampling


def _default_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ServerSettings:
    """What a reward server accepts and how it batches.

    Attributes:
        token: if set, ``/score`` and ``/info`` require ``Authorization: Bearer <token>``.
        max_items: items per request; more is a 413.
        max_image_side: longest image side in pixels; more is a 422 (checked before decompressing).
        max_frames: frames per video item; more is a 413. A video's frames count as images in
            ``max_pixels_per_request``.
        video_frames: frames an image scorer scores per video item, evenly spaced, first and last included.
        video_reduce: how those frames' scores become the item's: ``mean`` or ``min``
            (:mod:`reward_server.scorers.frames`).
        max_pixels_per_request: height x width summed over a request's images, masks and metadata
            images; more is a 413 (checked from the headers, before decompressing). It bounds the memory
            a request decodes to (3 bytes per RGB pixel), which the body size does not: PNGs compress
            flat images a thousandfold.
        max_pixels_in_flight: the pixels that requests being decoded and scored hold at once; a request that
            would exceed it waits (in arrival order) until earlier ones answer, one request alone always runs.
            None: twice ``max_pixels_per_request``. It bounds what concurrent requests decode to together.
        max_body_bytes: request body size; more is a 413.
        max_values: values (array and map entries: numbers, strings, ...) in a request body; more is a 413,
            before it is parsed. It bounds the memory a parsed body takes, which the body size does not: a
            value is 1-2 bytes of body and some 50 in memory, and a compressed body of KB decompresses to MB.
        body_timeout_s: longest wait for the next part of a request's body; a client that stalls longer
            gets a 408 and its connection closes.
        min_body_rate: bytes per second a body must average once it has taken ``body_timeout_s``; a slower
            one gets a 408 (a client trickling a byte now and then held its connection and its buffered part
            for good, each part pushing the stall timer back).
        max_body_bytes_in_flight: the bytes of all bodies being received and parsed at once; a request whose
            body would pass it gets a 503 (Retry-After) and its connection closes. None: four times
            ``max_body_bytes``. It bounds what slow or many clients can make the server hold.
        head_timeout_s: longest wait for a request's whole head (request line and headers), from the
            connection's opening or a later request's first byte; then the connection closes
            (``python -m reward_server``: reward_server/connections.py).
        max_head_bytes: a request's request line and headers; more is a 431 and the connection closes.
        max_batch_size: items per call to a scorer; requests are split or merged into micro-batches.
        batch_wait_ms: how long a scorer worker waits for more requests to fill a micro-batch.
        max_queue_items: items waiting per scorer; a request that would exceed it gets a 429.
        drain_grace_s: after SIGTERM, how long ``/readyz`` answers 503 while the port stays open, so that
            clients and load balancers move away before the listener closes.
        instance_id: reported in every response, to tell replicas apart.
    """

    token: str | None = None
    max_items: int = 256
    max_image_side: int = 4096
    max_frames: int = 1024
    video_frames: int = 8
    video_reduce: str = "mean"
    max_pixels_per_request: int = 128 * 1024 * 1024
    max_pixels_in_flight: int | None = None
    max_body_bytes: int = 256 * 1024 * 1024
    max_values: int = 1_000_000
    body_timeout_s: float = 30.0
    min_body_rate: int = 64 * 1024
    max_body_bytes_in_flight: int | None = None
    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 * 1024
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    max_queue_items: int = 4096
    drain_grace_s: float = 2.0
    instance_id: str = field(default_factory=_default_instance_id)

    def __post_init__(self) -> None:
        for name in (
            "max_items",
            "max_image_side",
            "max_frames",
            "max_pixels_per_request",
            "max_body_bytes",
            "min_body_rate",
            "max_head_bytes",
            "max_values",
            "max_batch_size",
            "max_queue_items",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_items < self.max_items:
            raise ValueError(f"max_queue_items ({self.max_queue_items}) must be >= max_items ({self.max_items})")
        if self.max_pixels_in_flight is None:
            object.__setattr__(self, "max_pixels_in_flight", 2 * self.max_pixels_per_request)
        elif self.max_pixels_in_flight < self.max_pixels_per_request:
            raise ValueError(
                f"max_pixels_in_flight ({self.max_pixels_in_flight}) must be >= max_pixels_per_request "
                f"({self.max_pixels_per_request})"
            )
        if self.max_body_bytes_in_flight is None:
            object.__setattr__(self, "max_body_bytes_in_flight", 4 * self.max_body_bytes)
        elif self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be >= max_body_bytes "
                f"({self.max_body_bytes})"
            )
        for name in ("body_timeout_s", "head_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        for name in ("batch_wait_ms", "drain_grace_s"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN fails every comparison
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        FrameSampling(self.video_frames, self.video_reduce)  # raises on a bad value
        if self.token == "":
            raise ValueError("token must be None or a non-empty string")

    @property
    def frame_sampling(self) -> FrameSampling:
        """How image scorers score video items."""
        return FrameSampling(self.video_frames, self.video_reduce)
