"""The ``POST /score`` exchange as bytes: request bodies in the configured wire format, and answers read back
into per-scorer arrays."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from shared.imagecodec import DEFAULT_FPS, as_hwc_uint8, encode_image, encode_video
from shared.protocol import JSON_MEDIA_TYPE, MAX_DEADLINE_MS, MSGPACK_MEDIA_TYPE, ScoreResponse
from shared.wire import pack_msgpack

DEFAULT_WIRE_FORMAT = "msgpack"
# msgpack*: raw uint8 pixels in a msgpack body (lossless, cheapest), optionally compressed when the
# replica lists the encoding in /info; png / raw: JSON bodies with base64 PNG files / base64 pixels.
WIRE_FORMATS = ("msgpack", "msgpack+zstd", "msgpack+lz4", "png", "raw")


def media_type(wire_format: str) -> str:
    return MSGPACK_MEDIA_TYPE if wire_format.startswith("msgpack") else JSON_MEDIA_TYPE


def check_metadata_arrays(metadata: Sequence[dict[str, Any]]) -> None:
    """Arrays in metadata travel as images: refuse those that are not uint8 ``[H, W(, 1|3)]``."""
    for index, meta in enumerate(metadata):
        for key, value in meta.items():
            if isinstance(value, np.ndarray) and key != "mask":
                try:
                    as_hwc_uint8(value)
                except ValueError as exc:
                    raise ValueError(
                        f"metadata[{index}][{key!r}]: arrays in metadata are sent as images, and {exc}"
                    ) from None


def encode_body(
    images: np.ndarray,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    start: int,
    *,
    wire_format: str,
    scorers: Sequence[str],
    timeout_s: float,
) -> bytes:
    """The uncompressed ``POST /score`` body asking ``scorers`` for these items, with item ids
    ``str(start + i)``; the server is asked to finish within 80% of the client's ``timeout_s``."""
    binary = wire_format.startswith("msgpack")
    image_format = "raw" if binary else wire_format
    body = {
        "request_id": uuid.uuid4().hex,
        "deadline_ms": min(max(1, int(timeout_s * 800)), MAX_DEADLINE_MS),
        "scorers": list(scorers),
        "items": [
            _item(str(start + i), image, prompt, meta, image_format, binary)
            for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True))
        ],
    }
    if binary:
        return pack_msgpack(body)
    try:
        return json.dumps(body).encode()
    except TypeError as exc:
        raise ValueError(f"metadata must be JSON-serialisable: {exc}") from exc


def _item(
    item_id: str, image: np.ndarray, prompt: str, meta: dict[str, Any], image_format: str, binary: bool
) -> dict[str, Any]:
    """One ``/score`` item. A task's mask (``meta["mask"]``, uint8 [H, W, 1], where in-process scorers read
    it) travels in the item's ``mask`` field: the protocol reserves that metadata key for the decoded mask. A video
    ``[F, H, W, C]`` travels as a video item with the fps of ``meta["fps"]`` (default 16).
    Other arrays in metadata (e.g. an edit's ``reference_image``) travel in ``metadata_images``, which the
    server decodes back into the item's metadata."""
    meta = dict(meta)
    mask = meta.pop("mask", None)
    arrays = {key: meta.pop(key) for key, value in list(meta.items()) if isinstance(value, np.ndarray)}
    item = {"id": item_id, "prompt": prompt, "metadata": meta}
    if image.ndim == 4:  # a video [F, H, W, C]: its fps travels in the video, where the server puts it back
        item["video"] = encode_video(image, meta.pop("fps", DEFAULT_FPS), image_format, binary=binary)
    else:
        item["image"] = encode_image(image, image_format, binary=binary)
    if mask is not None:
        item["mask"] = encode_image(np.asarray(mask, dtype=np.uint8), image_format, binary=binary)
    if arrays:
        item["metadata_images"] = {
            key: encode_image(array, image_format, binary=binary) for key, array in arrays.items()
        }
    return item


def store_scores(
    response: ScoreResponse,
    start: int,
    stop: int,
    components: dict[str, np.ndarray],
    errors: dict[str, dict[int, str]],
) -> None:
    """Copy one chunk's scores of every scorer in ``components``; a result missing from the response is a
    NaN with an error."""
    by_id = {result.id: result for result in response.results}
    for index in range(start, stop):
        item = by_id.get(str(index))
        for name in components:
            result = item.scores.get(name) if item is not None else None
            if result is None:
                errors[name][index] = f"MISSING: {response.instance} returned no {name} result"
            elif result.ok and result.score is not None:
                components[name][index] = result.score
            else:
                error = result.error
                errors[name][index] = f"{error.code.value}: {error.message}" if error else "missing error"


def detail(response: httpx.Response) -> str:
    """The error detail of an answer (its JSON ``detail``, else the start of its text)."""
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def retry_after_s(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None
