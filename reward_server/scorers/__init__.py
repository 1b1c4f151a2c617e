"""The scorer contract and the registry of scorers by name.

A scorer is any object with the attributes and methods of :class:`Scorer` (a Protocol: no base class).
Add one as a file in this package and one line in :data:`SCORERS`; the factory imports its module
lazily so that a server only pays for the scorers it runs.

Scorers receive decoded images (uint8 ``[H, W, C]``, C = 1 for grayscale or 3 for RGB) and return one
outcome per item: a float, or a :class:`ScoreOutcome` carrying details or a per-item error. An item a
scorer cannot score is an error (``ScoreOutcome.failure``), never a made-up number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from shared.protocol import ErrorCode


@dataclass(frozen=True)
class ScoreOutcome:
    """One scorer's result for one item: ``score`` set and ``error`` None, or the reverse."""

    score: float | None
    details: dict[str, Any] = field(default_factory=dict)
    error: ErrorCode | None = None
    message: str = ""

    @classmethod
    def failure(cls, code: ErrorCode, message: str, details: dict[str, Any] | None = None) -> ScoreOutcome:
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


ScorerFactory = Callable[..., Scorer]


def _digit(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.digit import DigitScorer

    return DigitScorer()


def _brightness(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.brightness import BrightnessScorer

    return BrightnessScorer()


def _jpeg_compressibility(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.jpeg import JpegCompressibilityScorer

    return JpegCompressibilityScorer()


def _ocr(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.ocr import OcrScorer

    return OcrScorer(backend="rapidocr", model_dir=model_dir)


def _ocr_flow_grpo(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.ocr import OcrScorer

    return OcrScorer(backend="rapidocr", model_dir=model_dir, similarity="flow_grpo")


def _ocr_paddle(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.ocr import OcrScorer

    return OcrScorer(backend="paddleocr", model_dir=model_dir)


def _qwenvl(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.qwenvl import QwenVLScorer

    return QwenVLScorer(backend="local", model_dir=model_dir)


def _qwenvl_api(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.qwenvl import QwenVLScorer

    return QwenVLScorer(backend="api", model_dir=model_dir)


def _aesthetic(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.aesthetic import AestheticScorer

    return AestheticScorer(model_dir=model_dir)


def _pickscore(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.clip_score import ClipScoreScorer

    return ClipScoreScorer("pickscore", 26.0, "PickScore (CLIP ViT-H/14 tuned on human preferences): "
                           "logit_scale * cos(text, image) / 26", model_dir)


def _clipscore(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.clip_score import ClipScoreScorer

    return ClipScoreScorer("clipscore", 30.0, "CLIP score (ViT-L/14): logit_scale * cos(text, image) / 30",
                           model_dir)


def _colorfulness(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.colorfulness import ColorfulnessScorer

    return ColorfulnessScorer()


def _geneval(model_dir: Path | None = None, mode: str = "strict") -> Scorer:
    from reward_server.scorers.geneval import GenEvalScorer

    return GenEvalScorer(model_dir=model_dir, mode=mode)


def _hpsv2(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.hps import HpsScorer

    return HpsScorer(model_dir=model_dir)


def _imagereward(model_dir: Path | None = None) -> Scorer:
    from reward_server.scorers.imagereward import ImageRewardScorer

    return ImageRewardScorer(model_dir=model_dir)


# name -> factory(model_dir: Path | None) -> Scorer. Factories of model-based scorers load from model_dir.
SCORERS: dict[str, ScorerFactory] = {
    "digit": _digit,
    "brightness": _brightness,
    "jpeg_compressibility": _jpeg_compressibility,
    "ocr": _ocr,
    "ocr_flow_grpo": _ocr_flow_grpo,
    "ocr_paddle": _ocr_paddle,
    "qwenvl": _qwenvl,
    "qwenvl_api": _qwenvl_api,
    "aesthetic": _aesthetic,
    "pickscore": _pickscore,
    "clipscore": _clipscore,
    "colorfulness": _colorfulness,
    "geneval": _geneval,
    "geneval_partial": lambda model_dir=None: _geneval(model_dir, mode="partial"),
    "hpsv2": _hpsv2,
    "imagereward": _imagereward,
}


def build_scorers(
    names: Sequence[str], *, model_dir: Path | None = None, load: bool = False
) -> dict[str, Scorer]:
    """Instantiate scorers by registry name (loading them if ``load``).

    Raises:
        ValueError: for a name that is not in :data:`SCORERS`.
    """
    unknown = [name for name in names if name not in SCORERS]
    if unknown:
        raise ValueError(f"unknown scorer(s) {unknown}; available: {sorted(SCORERS)}")
    scorers = {name: SCORERS[name](model_dir=model_dir) for name in names}
    if load:
        for scorer in scorers.values():
            scorer.load()
    return scorers


def run_scorer(
    scorer: Scorer, images: list[np.ndarray], prompts: list[str], metadata: list[dict[str, Any]]
) -> list[ScoreOutcome]:
    """Call ``scorer.score`` and normalise what it returns into one valid :class:`ScoreOutcome` per item.

    Exceptions become per-item INTERNAL errors (OOM for out-of-memory errors), non-finite scores become
    INTERNAL errors, and a wrong number of outcomes fails the whole batch. Never raises.
    """
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
    return [_normalise(item) for item in raw]


def _normalise(item: ScoreOutcome | float) -> ScoreOutcome:
    if not isinstance(item, ScoreOutcome):
        item = ScoreOutcome(score=item)
    if item.error is not None:
        return ScoreOutcome(score=None, details=item.details, error=item.error, message=item.message)
    try:
        value = float(item.score)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return ScoreOutcome.failure(
            ErrorCode.INTERNAL, f"scorer returned a non-number {item.score!r}", item.details
        )
    if not math.isfinite(value):
        return ScoreOutcome.failure(
            ErrorCode.INTERNAL, f"scorer returned a non-finite score {value}", item.details
        )
    return ScoreOutcome(score=value, details=item.details)


def _is_out_of_memory(exc: BaseException) -> bool:
    # torch.cuda.OutOfMemoryError and friends, matched by name so that this module needs no torch.
    return isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__
