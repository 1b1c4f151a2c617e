"""Wire schemas of the reward protocol, shared by the reward servers and the trainer's client.

Requests are validated strictly (``extra="forbid"``) so that a misspelt field is a 422 with a message
instead of a silently ignored option. Responses ignore unknown fields so that an older client keeps
working against a newer server that adds fields.

A failed score is never a number: it is ``ok: false, score: null`` with an :class:`ItemError`.
This module must not import torch.

Two request bodies carry the same schema:

* JSON (``application/json``): images are base64 strings (:class:`ScoreRequest`), for people and tools.
* msgpack (``application/msgpack``): images are msgpack ``bin`` values holding the file bytes or, with
  format ``raw``, the uint8 pixels in row-major ``[H, W, C]`` order (:class:`BinaryScoreRequest`). The
  trainer's client sends this. Only plain values are accepted (maps with string keys, arrays, strings,
  numbers, booleans, nil, bin): extension types, timestamps included, are refused; nothing is ever
  unpickled. The body may be compressed with ``Content-Encoding: zstd`` or ``lz4`` (LZ4 frame) when
  the server lists that encoding in ``/info`` (``encodings``).

Responses are always JSON.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal

import msgpack
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

PROTOCOL_VERSION = "1"
JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
# Accepted as msgpack too: the names other tools use for the same format.
MSGPACK_MEDIA_TYPES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack", "application/vnd.msgpack"})

ImageFormat = Literal["png", "jpeg", "webp", "raw"]
MAX_DEADLINE_MS = 24 * 3600 * 1000


class ErrorCode(str, Enum):
    """Why one item could not be scored by one scorer."""

    TIMEOUT = "TIMEOUT"  # the request deadline passed before the item was computed
    DECODE = "DECODE"  # the image (or mask) could not be decoded
    OOM = "OOM"  # the scorer ran out of memory
    PARSE = "PARSE"  # the scorer could not parse its target (prompt, metadata) or its model's answer
    INTERNAL = "INTERNAL"  # the scorer raised or returned a non-finite score
    BAD_INPUT = "BAD_INPUT"  # the item is valid on the wire but unsuitable for this scorer (e.g. its size)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EncodedImage(_Request):
    """An image on the wire.

    ``png``, ``jpeg`` and ``webp`` carry the base64 of the file; ``raw`` carries the base64 of the
    uint8 pixels in row-major ``[H, W, C]`` order and requires ``shape`` (C is 1 or 3).
    """

    format: ImageFormat
    data: str = Field(min_length=1, description="base64 (standard alphabet, with padding)")
    shape: tuple[int, int, int] | None = Field(default=None, description="[H, W, C], raw format only")

    @model_validator(mode="after")
    def _check_shape(self) -> EncodedImage:
        _check_image_shape(self.format, self.shape)
        return self


class BinaryImage(_Request):
    """An image in a msgpack body: like :class:`EncodedImage`, but ``data`` holds the bytes themselves."""

    format: ImageFormat
    data: bytes = Field(min_length=1, description="file bytes, or uint8 pixels [H, W, C] for raw")
    shape: tuple[int, int, int] | None = Field(default=None, description="[H, W, C], raw format only")

    @model_validator(mode="after")
    def _check_shape(self) -> BinaryImage:
        _check_image_shape(self.format, self.shape)
        return self


def _check_image_shape(format: str, shape: tuple[int, int, int] | None) -> None:
    if format == "raw":
        if shape is None:
            raise ValueError("format 'raw' requires shape [H, W, C]")
        height, width, channels = shape
        if height <= 0 or width <= 0:
            raise ValueError(f"shape {list(shape)} must have positive height and width")
        if channels not in (1, 3):
            raise ValueError(f"shape {list(shape)} must have 1 (grayscale) or 3 (RGB) channels")
    elif shape is not None:
        raise ValueError(f"shape is only allowed with format 'raw', not {format!r}")


class ScoreItem(_Request):
    """One image to score, with the prompt it was generated from."""

    id: str = Field(min_length=1, max_length=256)
    prompt: str
    image: EncodedImage
    mask: EncodedImage | None = None
    metadata: dict[str, Any] = Field(default_factory=dict, description="scorer-specific targets")
    metadata_images: dict[str, EncodedImage] = Field(
        default_factory=dict,
        description="images among the scorer-specific targets (e.g. an edit's reference_image); scorers "
        "find each decoded, as uint8 [H, W, C], in metadata under its key",
    )

    @model_validator(mode="after")
    def _check_metadata(self) -> ScoreItem:
        if "mask" in self.metadata or "mask" in self.metadata_images:
            raise ValueError(
                "metadata key 'mask' is reserved (scorers find the decoded mask there); use the mask field"
            )
        both = sorted(self.metadata.keys() & self.metadata_images.keys())
        if both:
            raise ValueError(f"keys {both} are in both metadata and metadata_images; keep each in one")
        return self


class ScoreRequest(_Request):
    """Body of ``POST /score``."""

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1, max_length=256)
    deadline_ms: int | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_MS,
        description="time budget in ms from the server's receipt; items not computed by then fail with TIMEOUT",
    )
    scorers: list[str] | None = Field(default=None, min_length=1, description="default: all scorers")
    items: list[ScoreItem] = Field(min_length=1)

    @field_validator("items", mode="before")
    @classmethod
    def _check_count(cls, items: Any, info: ValidationInfo) -> Any:
        """Refuse an over-long list before its items are validated (the server passes ``max_items``)."""
        max_items = (info.context or {}).get("max_items")
        if max_items is not None and isinstance(items, list) and len(items) > max_items:
            raise TooManyItemsError(f"{len(items)} items exceed the limit of {max_items} (max_items)")
        return items

    @model_validator(mode="after")
    def _check_unique(self) -> ScoreRequest:
        counts = Counter(item.id for item in self.items)
        if len(counts) != len(self.items):
            duplicates = sorted(i for i, count in counts.items() if count > 1)
            raise ValueError(f"item ids must be unique; repeated: {duplicates[:5]}")
        if self.scorers is not None and len(set(self.scorers)) != len(self.scorers):
            raise ValueError(f"scorers must be unique, got {self.scorers}")
        return self


class TooManyItemsError(Exception):
    """A request holds more items than the ``max_items`` given in the validation context.

    Not a ``ValueError``, so that pydantic lets it through instead of turning it into a validation error.
    """


class BinaryScoreItem(ScoreItem):
    """One item of a msgpack body."""

    image: BinaryImage
    mask: BinaryImage | None = None
    metadata_images: dict[str, BinaryImage] = Field(
        default_factory=dict, description=ScoreItem.model_fields["metadata_images"].description
    )


class BinaryScoreRequest(ScoreRequest):
    """Body of ``POST /score`` sent as msgpack (same fields and rules as :class:`ScoreRequest`)."""

    items: list[BinaryScoreItem] = Field(min_length=1)


class ItemError(_Response):
    code: ErrorCode
    message: str


class ScorerResult(_Response):
    """The outcome of one scorer on one item: a finite score, or an error, never both."""

    ok: bool
    score: float | None = Field(default=None, allow_inf_nan=False)
    details: dict[str, Any] = Field(default_factory=dict)
    error: ItemError | None = None

    @model_validator(mode="after")
    def _check_consistent(self) -> ScorerResult:
        if self.ok and (self.score is None or self.error is not None):
            raise ValueError("ok result needs a score and no error")
        if not self.ok and (self.score is not None or self.error is None):
            raise ValueError("failed result needs an error and no score")
        return self


class ItemResult(_Response):
    id: str
    scores: dict[str, ScorerResult]


class ScorerTiming(_Response):
    queue_ms: float = Field(description="from submission to the start of the first batch holding the items")
    inference_ms: float = Field(description="time spent in the scorer on the batches holding the items")
    batch_size: int = Field(description="largest micro-batch the items were scored in")


class Timing(_Response):
    total_ms: float
    decode_ms: float
    scorers: dict[str, ScorerTiming]


class ScoreResponse(_Response):
    """Body of a 200 answer to ``POST /score``; results are in request order."""

    request_id: str
    instance: str = Field(description="id of the server process that answered")
    models: dict[str, str] = Field(description="scorer name -> model version / fingerprint")
    results: list[ItemResult]
    timing: Timing


class ScorerInfo(_Response):
    name: str
    version: str
    score_min: float | None = Field(description="None: unbounded below")
    score_max: float | None = Field(description="None: unbounded above")
    description: str


class Limits(_Response):
    max_items: int
    max_image_side: int
    max_body_bytes: int = Field(description="for the body as sent and, if compressed, as decompressed")
    max_pixels_per_request: int | None = Field(
        default=None, description="height x width summed over a request's images, masks and metadata images"
    )


class InfoResponse(_Response):
    """Body of ``GET /info``."""

    protocol_version: str = PROTOCOL_VERSION
    instance: str
    ready: bool
    scorers: list[ScorerInfo]
    limits: Limits
    media_types: list[str] = Field(
        default_factory=lambda: [JSON_MEDIA_TYPE], description="request body types POST /score accepts"
    )
    encodings: list[str] = Field(
        default_factory=list, description="Content-Encoding values POST /score accepts besides identity"
    )


class ErrorResponse(_Response):
    """Body of every 4xx/5xx answer: what is wrong, in words."""

    detail: str


# Binary bodies -------------------------------------------------------------------------------------


class BodyError(ValueError):
    """A request body cannot be decoded (bad msgpack, corrupt compressed data, unsupported encoding)."""


class BodyTooLargeError(BodyError):
    """A compressed body decompresses to more than the allowed size."""


_BIN32 = b"\xc6"
_PLAIN_LEAVES = (str, int, float, bool, bytes, type(None))  # what unpack_msgpack lets through


def pack_msgpack(obj: Any) -> bytes:
    """msgpack-encode ``obj``: dicts, lists and tuples, plain leaves, and buffers as ``bin``.

    Buffer leaves (``bytes``, ``bytearray``, ``memoryview``, C-contiguous ``np.ndarray``) become ``bin``
    values holding their raw bytes, copied once, straight into the joined body: a uint8 image array is
    sent as its pixels without an intermediate copy.

    Raises:
        ValueError: for a value msgpack cannot represent (e.g. a numpy scalar in metadata).
    """
    packer = msgpack.Packer(autoreset=True)
    segments: list[Any] = []
    stack: list[Any] = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            segments.append(packer.pack_map_header(len(value)))
            for key, item in reversed(list(value.items())):
                stack.append(item)
                stack.append(_Key(key))
        elif isinstance(value, (list, tuple)):
            segments.append(packer.pack_array_header(len(value)))
            stack.extend(reversed(value))
        elif isinstance(value, (bytes, bytearray, memoryview, np.ndarray)):
            view = memoryview(value)
            if not view.c_contiguous:
                raise ValueError("buffers in a msgpack body must be C-contiguous")
            segments.append(_BIN32 + view.nbytes.to_bytes(4, "big"))
            segments.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
        else:
            if isinstance(value, _Key):
                value = value.key
                if not isinstance(value, str):
                    raise ValueError(f"map keys must be strings, got {type(value).__name__}")
            try:
                segments.append(packer.pack(value))
            except (TypeError, ValueError, OverflowError) as exc:
                raise ValueError(f"cannot encode {type(value).__name__} in msgpack: {exc}") from exc
    return b"".join(segments)


class _Key:
    """Marks a map key on :func:`pack_msgpack`'s stack (keys must be strings)."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = key


def _refuse_ext(code: int, data: bytes) -> Any:
    raise BodyError(f"msgpack extension type {code} is not accepted")


def unpack_msgpack(body: bytes) -> Any:
    """Decode a msgpack body into plain Python values.

    Raises:
        BodyError: invalid msgpack, trailing data, invalid UTF-8, non-string map keys, or any extension
            type (timestamps included).
    """
    try:
        value = msgpack.unpackb(
            body, raw=False, strict_map_key=True, ext_hook=_refuse_ext, timestamp=0, use_list=True
        )
    except BodyError:
        raise
    except Exception as exc:  # msgpack raises ValueError subclasses, UnicodeDecodeError, TypeError
        raise BodyError(f"invalid msgpack body: {type(exc).__name__}: {exc}") from None
    stack = [value]
    while stack:  # timestamps bypass ext_hook: refuse every non-plain value here
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, _PLAIN_LEAVES):
            raise BodyError(f"msgpack value of type {type(item).__name__} is not accepted")
    return value


def _zstd_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]] | None:
    try:
        import zstandard
    except ImportError:
        return None

    def compress(body: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=1).compress(body)

    def decompress(body: bytes, max_bytes: int) -> bytes:
        # One frame, as compress() writes it. Its declared size (if any) is checked before and after:
        # a frame cut short is an error here; without a declared size the body parser catches it.
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise BodyError(f"corrupt zstd body: {exc}") from None
        if declared > max_bytes:
            raise BodyTooLargeError(f"zstd body declares {declared} bytes, more than {max_bytes} bytes")
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        chunks, size = [], 0
        try:
            while chunk := reader.read(1 << 22):
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLargeError(f"zstd body decompresses to more than {max_bytes} bytes")
                chunks.append(chunk)
        except zstandard.ZstdError as exc:
            raise BodyError(f"corrupt zstd body: {exc}") from None
        if declared >= 0 and size != declared:
            raise BodyError(f"corrupt zstd body: {size} bytes decompressed, the frame declares {declared}")
        return b"".join(chunks)

    return compress, decompress


def _lz4_codec() -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]] | None:
    try:
        import lz4.frame
    except ImportError:
        return None

    def compress(body: bytes) -> bytes:
        return lz4.frame.compress(body, compression_level=0, store_size=True)

    def decompress(body: bytes, max_bytes: int) -> bytes:
        decompressor = lz4.frame.LZ4FrameDecompressor()
        try:
            data = decompressor.decompress(body, max_length=max_bytes + 1)
        except RuntimeError as exc:
            raise BodyError(f"corrupt lz4 body: {exc}") from None
        if len(data) > max_bytes:
            raise BodyTooLargeError(f"lz4 body decompresses to more than {max_bytes} bytes")
        if not decompressor.eof or decompressor.unused_data:
            raise BodyError("corrupt lz4 body: truncated frame or trailing data")
        return data

    return compress, decompress


# Content-Encoding name -> (compress, bounded decompress); only the codecs whose package is installed.
_CODECS = {
    name: codec for name, codec in (("zstd", _zstd_codec()), ("lz4", _lz4_codec())) if codec is not None
}


def supported_encodings() -> list[str]:
    """Content-Encoding values (besides identity) this process can compress and decompress."""
    return sorted(_CODECS)


def compress_body(body: bytes, encoding: str) -> bytes:
    """Compress a request body: ``zstd`` (level 1) or ``lz4`` (LZ4 frame, fastest level).

    Raises:
        ValueError: the encoding is unknown or its package is not installed.
    """
    if encoding not in _CODECS:
        raise ValueError(f"encoding {encoding!r} is not available here; available: {supported_encodings()}")
    return _CODECS[encoding][0](body)


def decompress_body(body: bytes, encoding: str, max_bytes: int) -> bytes:
    """Decompress a request body, refusing to produce more than ``max_bytes``.

    Raises:
        BodyTooLargeError: the result would exceed ``max_bytes`` (decompression stops there).
        BodyError: unsupported encoding or corrupt data.
    """
    if encoding not in _CODECS:
        raise BodyError(f"unsupported Content-Encoding {encoding!r}; supported: {supported_encodings()}")
    return _CODECS[encoding][1](body, max_bytes)
