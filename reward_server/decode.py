"""Reading a ``POST /score`` body: size caps, Content-Encoding, JSON or msgpack, schema, then the images.

Each refusal is the HTTP error the client's retry logic expects (413, 415 or 422; 408 for a body that stalls;
see :mod:`reward_server.app`); a corrupt image is a per-item DECODE outcome instead, so the rest is scored.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from fastapi import HTTPException, Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from reward_server.metrics import ServerMetrics
from reward_server.scorers.base import ScoreOutcome
from reward_server.settings import ServerSettings
from shared.imagecodec import DecodeError, ImageTooLargeError, OpenedImage, open_image
from shared.protocol import (
    JSON_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPE,
    MSGPACK_MEDIA_TYPES,
    BinaryScoreItem,
    BinaryScoreRequest,
    ErrorCode,
    ScoreItem,
    ScoreRequest,
    TooManyItemsError,
)
from shared.wire import (
    BodyError,
    BodyTooLargeError,
    check_json_values,
    decompress_body,
    supported_encodings,
    unpack_msgpack,
)

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # pyproject installs it there
    from async_timeout import timeout

Decoded = tuple[np.ndarray, dict[str, Any]] | ScoreOutcome
"""One item after decoding: its image ([H, W, C]) or video ([F, H, W, C]) and metadata (with mask and metadata images
as arrays, a video's fps under ``fps``), or a failure."""


class OpenedVideo:
    """A wire video whose frames' headers have been read (all of one size); :meth:`decode` stacks the frames.

    Unlike an image's, a video's faults are the request's (HTTP 422 naming item and frame): a clip is one object the
    client built, and a frame that does not decode means the clip is not what the client meant to send."""

    def __init__(self, where: str, frames: list[OpenedImage]) -> None:
        sizes = sorted({(frame.height, frame.width) for frame in frames})
        if len(sizes) > 1:
            raise HTTPException(422, f"{where}: a video's frames must all have one size, got (H, W) {sizes[:4]}")
        self.where, self.frames = where, frames
        self.height, self.width = sizes[0]

    @property
    def pixels(self) -> int:
        return self.height * self.width * len(self.frames)

    def decode(self) -> np.ndarray:
        """uint8 [F, H, W, C]."""
        arrays = []
        for index, frame in enumerate(self.frames):
            try:
                arrays.append(frame.decode())
            except DecodeError as exc:
                raise HTTPException(422, f"{self.where}: video frame {index} does not decode: {exc}") from None
        channels = sorted({array.shape[2] for array in arrays})
        if len(channels) > 1:
            raise HTTPException(422, f"{self.where}: a video's frames must all have one channel count, got {channels}")
        return np.stack(arrays)


Opened = dict[str | None, OpenedImage | OpenedVideo] | ScoreOutcome
"""One item after reading its headers: its images by key (None: the scored image or video), or a failure."""


class BodyBytes:
    """The bytes of the request bodies being received and parsed, at most ``limit`` in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextlib.contextmanager
    def receiving(self) -> Iterator[Callable[[int], None]]:
        """A function counting ``n`` more bytes of one body (a 429 past the limit); they are let go at the end."""
        mine = 0

        def take(n: int) -> None:
            nonlocal mine
            if self.held + n > self.limit:
                raise HTTPException(
                    429,
                    f"the server is receiving {self.held} bytes of request bodies already, and "
                    f"{self.limit} at most (--max-body-bytes-in-flight): try again",
                    headers={"Retry-After": "1", "Connection": "close"},
                )
            self.held += n
            mine += n

        try:
            yield take
        finally:
            self.held -= mine


async def parse_score_request(
    request: Request, settings: ServerSettings, metrics: ServerMetrics, bodies: BodyBytes
) -> ScoreRequest:
    """Read, decompress and validate a ``POST /score`` body (JSON or msgpack); raise the HTTP error. Its bytes
    count in ``bodies`` until it is parsed."""
    with bodies.receiving() as take:
        return await _parse(request, settings, metrics, take)


async def _parse(
    request: Request, settings: ServerSettings, metrics: ServerMetrics, take: Callable[[int], None]
) -> ScoreRequest:
    encodings = supported_encodings()
    encoding = request.headers.get("content-encoding", "identity").strip().lower() or "identity"
    if encoding != "identity" and encoding not in encodings:
        raise HTTPException(
            415,
            f"unsupported Content-Encoding {encoding!r}; supported: identity, {', '.join(encodings)}",
            headers={"Accept-Encoding": ", ".join(["identity", *encodings])},
        )
    media_type = request.headers.get("content-type", JSON_MEDIA_TYPE).split(";")[0].strip().lower() or JSON_MEDIA_TYPE
    binary = media_type in MSGPACK_MEDIA_TYPES
    if not binary and media_type != JSON_MEDIA_TYPE:  # curl -d sends application/x-www-form-urlencoded
        raise HTTPException(
            415,
            f"unsupported Content-Type {media_type!r}: send {JSON_MEDIA_TYPE} (curl: -H "
            f"'Content-Type: {JSON_MEDIA_TYPE}') or {MSGPACK_MEDIA_TYPE}",
        )
    max_body_bytes = settings.max_body_bytes
    body = await _read_body(request, settings, take)
    metrics.body_bytes.labels(MSGPACK_MEDIA_TYPE if binary else JSON_MEDIA_TYPE).observe(len(body))

    def parse() -> ScoreRequest:
        data = body if encoding == "identity" else decompress_body(body, encoding, max_body_bytes)
        context = {"max_items": settings.max_items, "max_frames": settings.max_frames}
        if binary:
            return BinaryScoreRequest.model_validate(unpack_msgpack(data, settings.max_values), context=context)
        check_json_values(data, settings.max_values)
        return ScoreRequest.model_validate_json(data, context=context)

    try:  # off the event loop: bodies of many megabytes take a while to decompress and parse
        return await asyncio.to_thread(parse)
    except (BodyTooLargeError, TooManyItemsError) as exc:
        raise HTTPException(413, str(exc)) from None
    except BodyError as exc:
        raise HTTPException(422, str(exc)) from None
    except ValidationError as exc:
        raise HTTPException(422, _describe_validation_error(exc)) from None


async def _read_body(request: Request, settings: ServerSettings, take: Callable[[int], None]) -> bytes:
    """Read the body, refusing with 413 as soon as it exceeds ``max_body_bytes`` (declared or actual), with 408
    when no part of it arrives for ``body_timeout_s`` or it averages under ``min_body_rate`` after that long,
    with 429 when ``take`` (the bytes of all bodies) refuses a part, and with 400 when the client goes away."""
    max_bytes, timeout_s, min_rate = settings.max_body_bytes, settings.body_timeout_s, settings.min_body_rate
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        async with timeout(timeout_s) as idle:  # pushed back as each part arrives
            async for chunk in request.stream():
                now = loop.time()
                idle.reschedule(now + timeout_s)
                size += len(chunk)
                if size > max_bytes:
                    raise HTTPException(413, f"body exceeds the limit of {max_bytes} bytes")
                if now - started > timeout_s and size < min_rate * (now - started):
                    raise HTTPException(
                        408,
                        f"the body came at {size / (now - started):.0f} bytes/s over "
                        f"{now - started:.0f} s, under the {min_rate} bytes/s this server needs "
                        "(--min-body-rate)",
                        headers={"Connection": "close"},
                    )
                take(len(chunk))
                chunks.append(chunk)
    except asyncio.TimeoutError:  # TimeoutError itself from 3.11 on
        detail = f"no part of the body arrived for {timeout_s:g} s after {size} bytes"
        raise HTTPException(408, detail, headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise HTTPException(400, f"the client disconnected after sending {size} bytes of the body") from None
    return b"".join(chunks)


def _describe_validation_error(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_input=False)[:10]:
        location = ".".join(str(part) for part in error["loc"]) or "body"
        problems.append(f"{location}: {error['msg']}")
    more = f" (and {exc.error_count() - 10} more)" if exc.error_count() > 10 else ""
    return "invalid request: " + "; ".join(problems) + more


def open_items(items: Sequence[ScoreItem | BinaryScoreItem], settings: ServerSettings) -> tuple[list[Opened], int]:
    """Read every image's header (no pixel decoded yet): each item's opened images, or its DECODE outcome, and
    the pixels they hold in all, so that an oversized image (422) or a request over ``max_pixels_per_request``
    (413) costs no memory."""
    opened: list[Opened] = []
    pixels = 0
    for index, item in enumerate(items):
        wire = {None: item.image, "mask": item.mask, **item.metadata_images}  # None: the scored image
        try:
            images: dict[str | None, OpenedImage | OpenedVideo] = {
                key: open_image(image.format, image.data, image.shape, max_side=settings.max_image_side)
                for key, image in wire.items()
                if image is not None
            }
            if item.video is not None:
                images[None] = _open_video(item, f"items.{index} (id {item.id!r})", settings.max_image_side)
        except ImageTooLargeError as exc:
            raise HTTPException(422, f"items.{index} (id {item.id!r}): {exc}") from None
        except DecodeError as exc:
            opened.append(ScoreOutcome.failure(ErrorCode.DECODE, str(exc)))
            continue
        pixels += sum(image.pixels for image in images.values())
        opened.append(images)
    if pixels > settings.max_pixels_per_request:
        raise HTTPException(
            413,
            f"the request's images, video frames, masks and metadata images hold {pixels} pixels (height x width), "
            f"more than the limit of {settings.max_pixels_per_request} (max_pixels_per_request); send fewer or "
            "smaller images (or videos) per request, or raise the server's --max-pixels-per-request",
        )
    return opened, pixels


def _open_video(item: ScoreItem | BinaryScoreItem, where: str, max_side: int) -> OpenedVideo:
    """The item's video frames' headers read (ImageTooLargeError for an oversized one, a 422 for a corrupt one)."""
    assert item.video is not None
    frames = []
    for number, frame in enumerate(item.video.frames):
        try:
            frames.append(open_image(frame.format, frame.data, frame.shape, max_side=max_side))
        except ImageTooLargeError:
            raise
        except DecodeError as exc:
            raise HTTPException(422, f"{where}: video frame {number} does not decode: {exc}") from None
    return OpenedVideo(where, frames)


def decode_opened(items: Sequence[ScoreItem | BinaryScoreItem], opened: Sequence[Opened]) -> list[Decoded]:
    """Decode the items :func:`open_items` opened into ``(image, metadata)``; a corrupt one is a DECODE outcome."""
    decoded: list[Decoded] = []
    for item, entry in zip(items, opened, strict=True):
        if isinstance(entry, ScoreOutcome):
            decoded.append(entry)
            continue
        try:
            arrays = {key: image.decode() for key, image in entry.items()}
        except DecodeError as exc:
            decoded.append(ScoreOutcome.failure(ErrorCode.DECODE, str(exc)))
            continue
        image = arrays.pop(None)
        if item.video is not None:
            arrays["fps"] = item.video.fps
        decoded.append((image, {**item.metadata, **arrays} if arrays else item.metadata))
    return decoded
