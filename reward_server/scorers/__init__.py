"""The registry of scorers by name.

A scorer is any object with the attributes and methods of :class:`~reward_server.scorers.base.Scorer` (a
Protocol: no base class). Add one as a file in this package and one line in :data:`SCORERS`; its module is
imported on use, so that a server only pays for the scorers it runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reward_server.scorers.base import ScoreOutcome, Scorer, run_scorer

__all__ = ["SCORERS", "ScoreOutcome", "Scorer", "ScorerSpec", "build_scorers", "run_scorer"]


@dataclass(frozen=True)
class ScorerSpec:
    """A registry entry: ``"module:Class"`` built with ``kwargs`` (and ``model_dir=`` when ``takes_model_dir``,
    the local directory model-based scorers load their weights from)."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    takes_model_dir: bool = True

    def __call__(self, model_dir: Path | None = None) -> Scorer:
        module, name = self.target.split(":")
        cls = getattr(importlib.import_module(f"reward_server.scorers.{module}"), name)
        return cls(**self.kwargs, **({"model_dir": model_dir} if self.takes_model_dir else {}))


_NO_MODEL = {"takes_model_dir": False}
SCORERS: dict[str, ScorerSpec] = {
    "digit": ScorerSpec("digit:DigitScorer", **_NO_MODEL),
    "brightness": ScorerSpec("brightness:BrightnessScorer", **_NO_MODEL),
    "jpeg_compressibility": ScorerSpec("jpeg:JpegCompressibilityScorer", **_NO_MODEL),
    "colorfulness": ScorerSpec("colorfulness:ColorfulnessScorer", **_NO_MODEL),
    "ocr": ScorerSpec("ocr:OcrScorer", {"backend": "rapidocr"}),
    "ocr_flow_grpo": ScorerSpec(
        "ocr:OcrScorer", {"backend": "rapidocr", "similarity": "flow_grpo", "reading": "flow_grpo"}
    ),
    "ocr_paddle": ScorerSpec("ocr:OcrScorer", {"backend": "paddleocr"}),
    "qwenvl": ScorerSpec("qwenvl:QwenVLScorer", {"backend": "local"}),
    "qwenvl_api": ScorerSpec("qwenvl:QwenVLScorer", {"backend": "api"}),
    "aesthetic": ScorerSpec("aesthetic:AestheticScorer"),
    "pickscore": ScorerSpec(
        "clip_score:ClipScoreScorer",
        {
            "name": "pickscore",
            "divisor": 26.0,
            "description": "PickScore (CLIP ViT-H/14 tuned on human preferences): logit_scale * cos(text, image) / 26",
        },
    ),
    "clipscore": ScorerSpec(
        "clip_score:ClipScoreScorer",
        {
            "name": "clipscore",
            "divisor": 30.0,
            "description": "CLIP score (ViT-L/14): logit_scale * cos(text, image) / 30",
        },
    ),
    "clipscore_flow_grpo": ScorerSpec(
        "clip_score:ClipScoreScorer",
        {
            "name": "clipscore_flow_grpo",
            "folder": "clipscore",
            "divisor": 30.0,
            "preprocess": "flow_grpo",
            "description": "CLIP score (ViT-L/14) with Flow-GRPO's bilinear resize: "
            "logit_scale * cos(text, image) / 30",
        },
    ),
    "geneval": ScorerSpec("geneval:GenEvalScorer", {"mode": "strict"}),
    "geneval_partial": ScorerSpec("geneval:GenEvalScorer", {"mode": "partial"}),
    "geneval_flow_grpo": ScorerSpec("geneval:GenEvalScorer", {"mode": "flow_grpo"}),
    "hpsv2": ScorerSpec("hps:HpsScorer"),
    "imagereward": ScorerSpec("imagereward:ImageRewardScorer"),
    "hpsv3": ScorerSpec("hpsv3:Hpsv3Scorer"),
    "unifiedreward": ScorerSpec("unifiedreward:UnifiedRewardScorer", {"backend": "local"}),
    "unifiedreward_api": ScorerSpec("unifiedreward:UnifiedRewardScorer", {"backend": "api"}),
}
"""Scorer name -> how to build it."""


def build_scorers(names: Sequence[str], *, model_dir: Path | None = None, load: bool = False) -> dict[str, Scorer]:
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
