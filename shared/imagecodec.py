"""Image codec for the reward protocol: uint8 ``[H, W, C]`` arrays (C = 1 or 3) to wire images and back.

numpy and PIL only (no torch). Wire images are dicts shaped like :class:`shared.protocol.EncodedImage`
(base64 text, for JSON bodies) or, with ``binary=True``, like :class:`shared.protocol.BinaryImage`
(bytes, for msgpack bodies), so that the client can build bodies without constructing pydantic models.

A video is its frames, each encoded as an image, and its fps (:func:`encode_video`).

``png`` and ``raw`` are lossless; ``jpeg`` and ``webp`` are lossy and meant for people and tools, not
for training. Decoding checks the image size from the header before decompressing it, so an
oversized image costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

_PIL_FORMATS = {"png": ("PNG",), "jpeg": ("JPEG", "MPO"), "webp": ("WEBP",)}
"""What PIL calls each wire format. MPO is a JPEG with extra frames after it (phone cameras write it); its
first frame, the one PIL decodes, is the plain JPEG image."""


class DecodeError(ValueError):
    """The wire image cannot be turned into a uint8 ``[H, W, C]`` array."""


class ImageTooLargeError(DecodeError):
    """The image is valid but one side exceeds the allowed maximum."""


def as_hwc_uint8(array: np.ndarray) -> np.ndarray:
    """Return ``array`` as a contiguous uint8 ``[H, W, C]`` array, adding C = 1 to an ``[H, W]`` array.

    Raises:
        ValueError: if the dtype is not uint8 or the shape is not ``[H, W]`` / ``[H, W, 1|3]``.
    """
    if array.dtype != np.uint8:
        raise ValueError(f"images must be uint8, got {array.dtype}")
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3) or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"images must be [H, W], [H, W, 1] or [H, W, 3], got shape {list(array.shape)}")
    return np.ascontiguousarray(array)


def encode_image(array: np.ndarray, format: str = "png", *, quality: int = 95, binary: bool = False) -> dict[str, Any]:
    """Encode one image into a wire dict ``{"format", "data"[, "shape"]}``.

    Args:
        array: uint8 ``[H, W]`` or ``[H, W, C]`` with C = 1 (sent as grayscale) or 3 (RGB).
        format: ``png`` (default, lossless), ``raw`` (lossless, fastest, largest), ``jpeg`` or ``webp``.
        quality: for the lossy formats only.
        binary: ``data`` is bytes (for msgpack bodies) instead of base64 text; for ``raw`` it is the
            contiguous array itself, which :func:`shared.wire.pack_msgpack` writes without a copy.
    """
    array = as_hwc_uint8(array)
    if format == "raw":
        return {
            "format": "raw",
            "data": array if binary else base64.b64encode(array.tobytes()).decode("ascii"),
            "shape": list(array.shape),
        }
    if format not in _PIL_FORMATS:
        raise ValueError(f"unknown image format {format!r}; expected one of png, jpeg, webp, raw")
    image = Image.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
    buffer = io.BytesIO()
    if format == "png":
        # Level 1: the trainer encodes whole batches every step; higher levels cost CPU for a few % of size.
        image.save(buffer, format="PNG", compress_level=1)
    else:
        image.save(buffer, format=_PIL_FORMATS[format][0], quality=quality)
    payload = buffer.getvalue()
    return {"format": format, "data": payload if binary else base64.b64encode(payload).decode("ascii")}


DEFAULT_FPS = 16
"""A video's frame rate when its maker gives none (Wan's)."""


def encode_video(
    frames: np.ndarray, fps: float = DEFAULT_FPS, format: str = "png", *, binary: bool = False
) -> dict[str, Any]:
    """Encode a clip, uint8 ``[F, H, W, C]`` (C = 1 or 3), into a wire video dict ``{"fps", "frames"}`` whose frames
    are :func:`encode_image`'s (``raw`` frames of one contiguous clip are sent without a copy).

    Raises:
        ValueError: a clip that is not uint8 ``[F, H, W, 1|3]`` with F >= 1, or fps <= 0.
    """
    if frames.dtype != np.uint8 or frames.ndim != 4 or len(frames) == 0:
        raise ValueError(f"videos must be uint8 [F, H, W, C] with F >= 1, got {frames.dtype} {list(frames.shape)}")
    if not fps > 0:
        raise ValueError(f"a video's fps must be > 0, got {fps}")
    frames = np.ascontiguousarray(frames)
    return {"fps": float(fps), "frames": [encode_image(frame, format, binary=binary) for frame in frames]}


def encode_batch(images: np.ndarray | Sequence[np.ndarray], format: str = "png") -> list[dict[str, Any]]:
    """Encode a batch (uint8 ``[B, H, W, C]`` or a sequence of ``[H, W(, C)]`` arrays) into wire dicts."""
    return [encode_image(image, format) for image in images]


def decode_image(
    format: str, data: str | bytes, shape: Sequence[int] | None = None, *, max_side: int | None = None
) -> np.ndarray:
    """Decode a wire image into a uint8 ``[H, W, C]`` array with C = 1 or 3.

    ``data`` is base64 text (JSON bodies) or the bytes themselves (msgpack bodies).

    Files with an alpha channel lose it; palette and other modes become RGB, binary images 8-bit
    grayscale and 16-bit images 8-bit grayscale scaled by 1/256 (their high byte).

    Raises:
        ImageTooLargeError: a side exceeds ``max_side`` (checked before decompressing).
        DecodeError: anything else that prevents decoding (bad base64, corrupt file, format mismatch,
            raw data whose length does not match ``shape``).
    """
    return open_image(format, data, shape, max_side=max_side).decode()


class OpenedImage:
    """A wire image whose header has been read: its size is known, its pixels are not decoded yet."""

    def __init__(self, height: int, width: int, decode: Callable[[], np.ndarray]) -> None:
        self.height = height
        self.width = width
        self._decode = decode

    @property
    def pixels(self) -> int:
        return self.height * self.width

    def decode(self) -> np.ndarray:
        """The uint8 ``[H, W, C]`` array (see :func:`decode_image`).

        Raises:
            DecodeError: the file is corrupt past its header.
        """
        return self._decode()


def open_image(
    format: str, data: str | bytes, shape: Sequence[int] | None = None, *, max_side: int | None = None
) -> OpenedImage:
    """Read a wire image's header (its size) without decoding its pixels; :func:`decode_image` in two steps.

    Raises:
        ImageTooLargeError: a side exceeds ``max_side``.
        DecodeError: bad base64, unreadable header, format mismatch, raw data not matching ``shape``.
    """
    if format == "raw":
        return _open_raw(data, shape, max_side)
    if format not in _PIL_FORMATS:
        raise DecodeError(f"unknown image format {format!r}")
    payload = _b64decode(data) if isinstance(data, str) else data
    try:
        image = Image.open(io.BytesIO(payload))
    except UnidentifiedImageError:
        raise DecodeError(f"data is not a readable {format} image (unrecognised file content)") from None
    except Image.DecompressionBombError as exc:  # a header declaring over twice PIL's MAX_IMAGE_PIXELS
        limit = "" if max_side is None else f"; the maximum side is {max_side}"
        raise ImageTooLargeError(f"image is too large: {str(exc).rstrip('.')}{limit}") from None
    except Exception as exc:  # PIL raises several unrelated types for corrupt files
        raise DecodeError(f"data is not a readable {format} image: {exc}") from exc
    if image.format not in _PIL_FORMATS[format]:
        raise DecodeError(f"declared format {format!r} but the data is {image.format or 'unknown'}")
    _check_side(image.height, image.width, max_side)
    return OpenedImage(image.height, image.width, lambda: _decode_pil(image, format))


def _decode_pil(image: Image.Image, format: str) -> np.ndarray:
    try:
        if image.mode in ("P", "PA"):  # via RGBA so that palette transparency is resolved, then dropped
            image = image.convert("RGBA")
        if image.mode.startswith("I"):  # 16-bit grayscale (I;16*, or I holding 0..65535): keep the high byte
            array = (np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8)
        else:
            if image.mode not in ("L", "RGB"):
                image = image.convert("L" if image.mode in ("1", "LA", "F") else "RGB")
            array = np.asarray(image, dtype=np.uint8)
    except Exception as exc:
        raise DecodeError(f"corrupt {format} image: {exc}") from exc
    return as_hwc_uint8(array)


def _open_raw(data: str | bytes, shape: Sequence[int] | None, max_side: int | None) -> OpenedImage:
    if shape is None or len(shape) != 3 or shape[2] not in (1, 3) or min(shape) <= 0:
        raise DecodeError(f"raw images need shape [H, W, C] with C in (1, 3), got {shape}")
    height, width, channels = (int(s) for s in shape)
    _check_side(height, width, max_side)
    payload = _b64decode(data) if isinstance(data, str) else data
    expected = height * width * channels
    if len(payload) != expected:
        raise DecodeError(f"raw data has {len(payload)} bytes but shape {list(shape)} needs {expected}")
    return OpenedImage(
        height, width, lambda: np.frombuffer(payload, dtype=np.uint8).reshape(height, width, channels).copy()
    )


def _b64decode(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"data is not valid base64: {exc}") from exc


def _check_side(height: int, width: int, max_side: int | None) -> None:
    if max_side is not None and max(height, width) > max_side:
        raise ImageTooLargeError(f"image is {height}x{width}, larger than the maximum side {max_side}")
