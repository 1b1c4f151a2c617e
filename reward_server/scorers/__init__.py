"""The registry of scorers by name.

A scorer is any object with the attributes and methods of :class:`~reward_server.scorers.base.Scorer` (a
Protocol: no base class). Add one as a file in this package and one line in :data:`SCORERS`; its module is
imported on use, so that a server only pays for the scorers it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from reward_server.scorers.base import ScoreOutcome, Scorer, run_scorer
from shared.registry import Entry, Registry

__all__ = ["SCORERS", "ScoreOutcome", "Scorer", "build_scorers", "run_scorer"]

_P = "reward_server.scorers."
_NO_MODEL = {"accepts": ()}  # offered ``model_dir=`` like the others, it loads no weights
SCORERS = Registry(
    {
        "digit": Entry(_P + "digit:DigitScorer", **_NO_MODEL),
        "brightness": Entry(_P + "brightness:BrightnessScorer", **_NO_MODEL),
        "jpeg_compressibility": Entry(_P + "jpeg:JpegCompressibilityScorer", **_NO_MODEL),
        "colorfulness": Entry(_P + "colorfulness:ColorfulnessScorer", **_NO_MODEL),
        "motion": Entry(_P + "motion:MotionScorer", **_NO_MODEL),
        "ocr": Entry(_P + "ocr:OcrScorer", backend="rapidocr"),
        "ocr_flow_grpo": Entry(_P + "ocr:OcrScorer", backend="rapidocr", similarity="flow_grpo", reading="flow_grpo"),
        "ocr_paddle": Entry(_P + "ocr:OcrScorer", backend="paddleocr"),
        "qwenvl": Entry(_P + "qwenvl:QwenVLScorer", backend="local"),
        "qwenvl_api": Entry(_P + "qwenvl:QwenVLScorer", backend="api"),
        "aesthetic": Entry(_P + "aesthetic:AestheticScorer"),
        "pickscore": Entry(
            _P + "clip_score:ClipScoreScorer",
            name="pickscore",
            divisor=26.0,
            description="PickScore (CLIP ViT-H/14 tuned on human preferences): logit_scale * cos(text, image) / 26",
        ),
        "clipscore": Entry(
            _P + "clip_score:ClipScoreScorer",
            name="clipscore",
            divisor=30.0,
            description="CLIP score (ViT-L/14): logit_scale * cos(text, image) / 30",
        ),
        "clipscore_flow_grpo": Entry(
            _P + "clip_score:ClipScoreScorer",
            name="clipscore_flow_grpo",
            folder="clipscore",
            divisor=30.0,
            preprocess="flow_grpo",
            description="CLIP score (ViT-L/14) with Flow-GRPO's bilinear resize: logit_scale * cos(text, image) / 30",
        ),
        "temporal_consistency": Entry(_P + "temporal:TemporalConsistencyScorer"),
        "geneval": Entry(_P + "geneval:GenEvalScorer", mode="strict"),
        "geneval_partial": Entry(_P + "geneval:GenEvalScorer", mode="partial"),
        "geneval_flow_grpo": Entry(_P + "geneval:GenEvalScorer", mode="flow_grpo"),
        "hpsv2": Entry(_P + "hps:HpsScorer"),
        "imagereward": Entry(_P + "imagereward:ImageRewardScorer"),
        "hpsv3": Entry(_P + "hpsv3:Hpsv3Scorer"),
        "videoalign": Entry(_P + "videoalign:VideoAlignScorer"),
        "unifiedreward": Entry(_P + "unifiedreward:UnifiedRewardScorer", backend="local"),
        "unifiedreward_api": Entry(_P + "unifiedreward:UnifiedRewardScorer", backend="api"),
    }
)
"""Scorer name -> its class and arguments, imported on use (``SCORERS[name](model_dir=...)`` builds one; the
scorers with weights load them from ``model_dir``)."""


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
