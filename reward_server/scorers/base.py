"""The scorer contract: what a scorer returns per item (:class:`ScoreOutcome`), what the server needs from it
(:class:`Scorer`, a Protocol), and :func:`run_scorer`, which turns whatever a scorer does into one valid outcome
per item. Scorer modules import from here, so that the registry in ``__init__`` imports no scorer eagerly."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from reward_server.scorers.frames import FrameSampling, expand, is_video, reduce_scores
from shared.protocol import ErrorCode

MAX_MESSAGE = 500
"""Characters of a failure's message that go into a response."""
RANGE_SLACK = 1e-5
"""Relative float round-off a score may stand outside its scorer's range by (a float32 cosine of 1.0000001);
such a score is moved onto the range's edge."""


class ModelFilesMissing(ValueError):
    """A scorer that loads weights was started without ``--model-dir``: the server then exits with
    ``EXIT_MODEL_FILES_MISSING``, which tells a launcher to say where its replicas take model files from."""


@dataclass(frozen=True)
class ScoreOutcome:
    """One scorer's result for one item: ``score`` set and ``error`` None, or the reverse."""

    score: float | None
    details: dict[str, Any] = field(default_factory=dict)
    error: ErrorCode | None = None
    message: str = ""

    @classmethod
    def failure(cls, code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> ScoreOutcome:
        """A failed item; a message longer than MAX_MESSAGE characters (one quoting a huge prompt) is cut."""
        if len(message) > MAX_MESSAGE:
            message = f"{message[:MAX_MESSAGE]}... ({len(message)} characters in all)"
        return cls(score=None, details=details or {}, error=code, message=message)

    @property
    def ok(self) -> bool:
        return self.error is None


@runtime_checkable
class Scorer(Protocol):
    """What the reward server needs from a scorer.

    ``score`` is called from one worker thread at a time (never concurrently for the same object), with
    batches of at most the server's ``max_batch_size`` items. It may raise: the whole batch then fails
    with INTERNAL (or OOM for out-of-memory errors).
    """

    name: str
    description: str
    score_range: tuple[float | None, float | None]  # None: unbounded on that side

    @property
    def version(self) -> str:
        """Model name and a fingerprint of its weights; valid after :meth:`load`."""
        ...

    def load(self) -> None:
        """Load weights and warm up (e.g. one dummy batch). Called once, off the event loop."""
        ...

    def score(
        self, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
    ) -> Sequence[ScoreOutcome | float]:
        """Score a batch: one outcome per image, in order."""
        ...


def run_scorer(
    scorer: Scorer,
    images: list[np.ndarray],
    prompts: list[str],
    metadata: list[dict[str, Any]],
    sampling: FrameSampling | None = None,
) -> list[ScoreOutcome]:
    """Call ``scorer.score`` and normalise what it returns into one valid :class:`ScoreOutcome` per item.

    Exceptions become per-item INTERNAL errors (OOM for out-of-memory errors), non-finite scores and scores
    outside the scorer's ``score_range`` (past float round-off) become INTERNAL errors, and a wrong number of
    outcomes fails the whole batch. Videos (``[F, H, W, C]``) go whole to a scorer with ``modality = "video"``
    and as ``sampling``'s frames to the others (:mod:`reward_server.scorers.frames`). Never raises.
    """
    video_scorer = getattr(scorer, "modality", "image") == "video"
    if video_scorer or not any(is_video(image) for image in images):
        if video_scorer and not all(is_video(image) for image in images):
            message = f"scorer {scorer.name!r} scores videos (frames and fps), and this item is an image"
            still = ScoreOutcome.failure(ErrorCode.BAD_INPUT, message)
            rows = [row for row, image in enumerate(images) if is_video(image)]
            scored = _call(scorer, [images[r] for r in rows], [prompts[r] for r in rows], [metadata[r] for r in rows])
            outcomes = [still] * len(images)
            for row, outcome in zip(rows, scored, strict=True):
                outcomes[row] = outcome
            return outcomes
        return _call(scorer, images, prompts, metadata)
    sampling = sampling or FrameSampling()
    flat, flat_prompts, flat_meta, picked = expand(images, prompts, metadata, sampling)
    per_call = max(len(images), 1)  # never more images per call than the batch of items it came as
    flat_outcomes: list[ScoreOutcome] = []
    for start in range(0, len(flat), per_call):
        stop = start + per_call
        flat_outcomes += _call(scorer, flat[start:stop], flat_prompts[start:stop], flat_meta[start:stop])
    outcomes, at = [], 0
    for indices in picked:
        taken = max(len(indices), 1)
        parts, at = flat_outcomes[at : at + taken], at + taken
        outcomes.append(_reduce_frames(parts, indices, sampling.reduce) if indices else parts[0])
    return outcomes


def _call(
    scorer: Scorer, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
) -> list[ScoreOutcome]:
    """One ``scorer.score`` call, normalised (see :func:`run_scorer`)."""
    if not images:
        return []
    try:
        raw = list(scorer.score(images, prompts, metadata))
    except Exception as exc:
        code = ErrorCode.OOM if _is_out_of_memory(exc) else ErrorCode.INTERNAL
        outcome = ScoreOutcome.failure(code, f"{type(exc).__name__}: {exc}")
        return [outcome] * len(images)
    if len(raw) != len(images):
        outcome = ScoreOutcome.failure(
            ErrorCode.INTERNAL,
            f"scorer {scorer.name!r} returned {len(raw)} outcomes for {len(images)} images",
        )
        return [outcome] * len(images)
    return [_normalise(item, scorer.score_range) for item in raw]


def _reduce_frames(parts: list[ScoreOutcome], indices: list[int], reduce: str) -> ScoreOutcome:
    """A clip's outcome from its sampled frames' outcomes: the first failed frame fails it (a NaN, never a partial
    mean), else the reduced score with every frame's index, score and details."""
    details: dict[str, Any] = {"frames": indices, "frame_scores": [part.score for part in parts], "reduce": reduce}
    if any(part.details for part in parts):
        details["frame_details"] = [part.details for part in parts]
    for index, part in zip(indices, parts, strict=True):
        if part.error is not None:
            return ScoreOutcome.failure(part.error, f"frame {index}: {part.message}", details)
    return ScoreOutcome(score=reduce_scores([float(part.score) for part in parts], reduce), details=details)  # type: ignore[arg-type]


def _normalise(item: ScoreOutcome | float, score_range: tuple[float | None, float | None]) -> ScoreOutcome:
    if not isinstance(item, ScoreOutcome):
        item = ScoreOutcome(score=item)
    if item.error is not None:
        return ScoreOutcome(score=None, details=item.details, error=item.error, message=item.message)
    try:
        value = float(item.score)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return ScoreOutcome.failure(ErrorCode.INTERNAL, f"scorer returned a non-number {item.score!r}", item.details)
    if not math.isfinite(value):
        return ScoreOutcome.failure(ErrorCode.INTERNAL, f"scorer returned a non-finite score {value}", item.details)
    low, high = score_range
    inside = min(value, high) if high is not None else value
    inside = max(inside, low) if low is not None else inside
    if abs(inside - value) > RANGE_SLACK * max(1.0, abs(inside)):  # a bug (a misread answer), not a reward
        shown = f"[{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}]"
        return ScoreOutcome.failure(
            ErrorCode.INTERNAL, f"scorer returned {value:g}, outside its declared range {shown}", item.details
        )
    return ScoreOutcome(score=inside, details=item.details)


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError and friends, matched by name so that this module needs no torch.
    return isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__
