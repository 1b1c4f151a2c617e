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
  trainer's client sends this; its encoding, decoding and compression live in :mod:`shared.wire`.

An item holds an ``image`` or a ``video`` (:class:`EncodedVideo`: its frames, each an image as above, and its fps).

Responses are always JSON.
"""

from __future__ import annotations

import uuid
from collections import Counter
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

PROTOCOL_VERSION = "1"
JSON_MEDIA_TYPE = "application/json"
MSGPACK_MEDIA_TYPE = "application/msgpack"
# Accepted as msgpack too: the names other tools use for the same format.
MSGPACK_MEDIA_TYPES = frozenset({MSGPACK_MEDIA_TYPE, "application/x-msgpack", "application/vnd.msgpack"})

EXIT_MODEL_FILES_MISSING = 3
"""A reward server's exit status when a scorer needs model files and no ``--model-dir`` was given (1: any other
load failure)."""

ImageFormat = Literal["png", "jpeg", "webp", "raw"]
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_FPS = 1000.0


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


class EncodedVideo(_Request):
    """A video clip on the wire: its frames in order, each an image of one size, and its frame rate.

    Lossless by default: the trainer's client sends raw frames in msgpack (compressed by ``Content-Encoding: zstd``
    where asked), PNG frames in JSON (bench/video_wire.py measured the choices). At most ``max_frames`` frames.
    """

    fps: float = Field(gt=0, le=MAX_FPS, description="frames per second, > 0")
    frames: list[EncodedImage] = Field(min_length=1, description="the clip's frames in order, all of one size")

    @field_validator("frames", mode="before")
    @classmethod
    def _check_count(cls, frames: Any, info: ValidationInfo) -> Any:
        """Refuse an over-long clip before its frames are validated (the server passes ``max_frames``)."""
        max_frames = (info.context or {}).get("max_frames")
        if max_frames is not None and isinstance(frames, list) and len(frames) > max_frames:
            raise TooManyFramesError(f"a video of {len(frames)} frames exceeds the limit of {max_frames} (max_frames)")
        return frames

    @model_validator(mode="after")
    def _check_sizes(self) -> EncodedVideo:
        shapes = {tuple(frame.shape) for frame in self.frames if frame.shape is not None}
        if len(shapes) > 1:
            raise ValueError(f"a video's frames must all have one shape, got {sorted(shapes)[:4]}")
        return self


class BinaryVideo(EncodedVideo):
    """A video in a msgpack body: like :class:`EncodedVideo`, with :class:`BinaryImage` frames."""

    frames: list[BinaryImage] = Field(min_length=1, description=EncodedVideo.model_fields["frames"].description)


class ScoreItem(_Request):
    """One image or video to score, with the prompt it was generated from. Scorers find a video's fps in metadata
    under ``fps``; a mask applies to every frame."""

    id: str = Field(min_length=1, max_length=256)
    prompt: str
    image: EncodedImage | None = Field(default=None, description="the image to score (or send a video)")
    video: EncodedVideo | None = Field(default=None, description="the video to score (or send an image)")
    mask: EncodedImage | None = None
    metadata: dict[str, Any] = Field(default_factory=dict, description="scorer-specific targets")
    metadata_images: dict[str, EncodedImage] = Field(
        default_factory=dict,
        description="images among the scorer-specific targets (e.g. an edit's reference_image); scorers "
        "find each decoded, as uint8 [H, W, C], in metadata under its key",
    )

    @model_validator(mode="after")
    def _check_metadata(self) -> ScoreItem:
        if (self.image is None) == (self.video is None):
            raise ValueError("an item holds exactly one of image and video")
        if self.video is not None and "fps" in self.metadata:
            raise ValueError("metadata key 'fps' is reserved in a video item (scorers find the video's fps there)")
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


class TooManyFramesError(TooManyItemsError):
    """A video holds more frames than the ``max_frames`` given in the validation context (a 413, like too many
    items)."""


class BinaryScoreItem(ScoreItem):
    """One item of a msgpack body."""

    image: BinaryImage | None = Field(default=None, description=ScoreItem.model_fields["image"].description)
    video: BinaryVideo | None = Field(default=None, description=ScoreItem.model_fields["video"].description)
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
    max_values: int | None = Field(
        default=None, description="array and map entries (numbers, strings, ...) in a request body, all told"
    )
    max_frames: int | None = Field(default=None, description="frames per video item (their pixels count as images)")


class VideoScoring(_Response):
    """How an image scorer scores a video item: ``frames`` frames evenly spaced (first and last included), their
    scores reduced by ``reduce`` (``mean`` or ``min``); the per-frame scores are in the item's details."""

    frames: int
    reduce: str


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
    video: VideoScoring | None = Field(default=None, description="None: a server older than video items")


class ErrorResponse(_Response):
    """Body of every 4xx/5xx answer: what is wrong, in words."""

    detail: str
