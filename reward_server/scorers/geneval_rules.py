"""GenEval's checks as pure functions over detections (no models): selection, overlap, position, verdicts.

The ``geneval`` scorers feed these with Mask2Former detections and a CLIP colour classifier; tests feed
them rigged detections. Constants follow GenEval's evaluation defaults (evaluation/evaluate_images.py);
:func:`evaluate` is GenEval's verdict and :func:`flow_grpo_reward` Flow-GRPO's training reward, both exact
on given detections (tests/parity/test_scorers_geneval.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.geneval import COLORS, OBJECT_NAMES, RELATIONS  # noqa: F401 (read from here too)

# Other spellings of those classes in detector configs (Detectron2/transformers COCO, Pascal VOC style).
LABEL_ALIASES = {
    "mouse": "computer mouse",
    "remote": "tv remote",
    "keyboard": "computer keyboard",
    "tvmonitor": "tv",
    "tv monitor": "tv",
    "sofa": "couch",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "diningtable": "dining table",
    "pottedplant": "potted plant",
    "hair dryer": "hair drier",
}
COLOR_TEMPLATES = ("a photo of a {color} {obj}", "a photo of a {color}-colored {obj}", "a photo of a {color} object")

THRESHOLD = 0.3  # detection confidence kept for every tag but counting
COUNTING_THRESHOLD = 0.9  # counting prompts keep only confident detections
MAX_OBJECTS = 16  # per class, most confident first
MAX_OVERLAP = 1.0  # IoU at which a less confident same-class box is dropped; 1.0 keeps all (GenEval's default)
POSITION_MARGIN = 0.1  # centre offsets shrink by this fraction of the two boxes' summed sizes


@dataclass(frozen=True)
class Detection:
    """One detected instance: ``box`` as (x1, y1, x2, y2) pixels, confidence, optional boolean mask [H, W]."""

    box: tuple[float, float, float, float]
    score: float
    mask: np.ndarray | None = None


def canonical_label(label: str) -> str | None:
    """The GenEval class a detector's label names, or None for labels outside GenEval's vocabulary."""
    name = label.strip().lower().replace("_", " ")
    name = LABEL_ALIASES.get(name, name)
    return name if name in OBJECT_NAMES else None


def box_iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """IoU with inclusive pixel coordinates (width x2 - x1 + 1), the convention GenEval's overlap test uses."""

    def area(x1: float, y1: float, x2: float, y2: float) -> float:
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)

    inter = area(max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3]))
    union = area(*box_a[:4]) + area(*box_b[:4]) - inter
    return inter / union if union else 0.0


def select_detections(
    candidates: dict[str, list[Detection]],
    tag: str,
    *,
    threshold: float = THRESHOLD,
    counting_threshold: float = COUNTING_THRESHOLD,
    max_objects: int = MAX_OBJECTS,
    max_overlap: float = MAX_OVERLAP,
) -> dict[str, list[Detection]]:
    """Per class: keep detections above the tag's confidence threshold, most confident first, at most
    ``max_objects``, then greedily drop any whose IoU with a kept one reaches ``max_overlap`` (< 1.0)."""
    cutoff = counting_threshold if tag == "counting" else threshold
    kept: dict[str, list[Detection]] = {}
    for name, detections in candidates.items():
        queue = sorted((d for d in detections if d.score > cutoff), key=lambda d: -d.score)[:max_objects]
        chosen: list[Detection] = []
        while queue:
            best = queue.pop(0)
            chosen.append(best)
            if max_overlap < 1.0:
                queue = [d for d in queue if box_iou(best.box, d.box) < max_overlap]
        if chosen:
            kept[name] = chosen
    return kept


def relative_position(box_a: Sequence[float], box_b: Sequence[float], margin: float = POSITION_MARGIN) -> set[str]:
    """Where box A lies relative to box B: a subset of :data:`RELATIONS`.

    The centre offset is shrunk towards zero by ``margin`` times the two boxes' summed width (height),
    and a relation holds when its shrunk component exceeds half the unshrunk offset's length.
    """
    a, b = np.asarray(box_a[:4], float).reshape(2, 2), np.asarray(box_b[:4], float).reshape(2, 2)
    offset = a.mean(0) - b.mean(0)
    sizes = np.abs(a[1] - a[0]) + np.abs(b[1] - b[0])
    shrunk = np.sign(offset) * np.maximum(np.abs(offset) - margin * sizes, 0.0)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    found = set()
    if dx < -0.5:
        found.add("left of")
    if dx > 0.5:
        found.add("right of")
    if dy < -0.5:
        found.add("above")
    if dy > 0.5:
        found.add("below")
    return found


def parse_spec(metadata: dict[str, Any]) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """``(tag, include, exclude)`` from a GenEval metadata row, validated.

    Raises:
        ValueError: naming what is missing or malformed in the row.
    """
    tag, include, exclude = metadata.get("tag"), metadata.get("include"), metadata.get("exclude", [])
    if not isinstance(tag, str) or not isinstance(include, list) or not include or not isinstance(exclude, list):
        raise ValueError("metadata needs GenEval's 'tag' (str) and 'include' (non-empty list), and 'exclude' a list")
    for index, clause in enumerate(include + exclude):
        if not isinstance(clause, dict) or clause.get("class") not in OBJECT_NAMES:
            raise ValueError(f"clause {clause!r}: 'class' must be one of GenEval's 80 object names")
        if not isinstance(clause.get("count"), int) or clause["count"] < 1:
            raise ValueError(f"clause {clause!r}: 'count' must be a positive integer")
        if index < len(include) and "color" in clause and clause["color"] not in COLORS:
            raise ValueError(f"clause {clause!r}: 'color' must be one of {COLORS}")
        if index < len(include) and "position" in clause:
            relation = clause["position"]
            if (
                not isinstance(relation, list | tuple)
                or len(relation) != 2
                or relation[0] not in RELATIONS
                or not isinstance(relation[1], int)
                or not 0 <= relation[1] < index
            ):
                raise ValueError(f"clause {clause!r}: 'position' must be [relation, index of an earlier clause]")
    return tag, include, exclude


ColorClassifier = Callable[[str, list[Detection]], list[str]]


def evaluate(
    metadata: dict[str, Any],
    detected: dict[str, list[Detection]],
    classify_colors: ColorClassifier,
    *,
    margin: float = POSITION_MARGIN,
) -> list[dict[str, Any]]:
    """GenEval's verdict as a list of checks, each ``{check, class, expected, found, passed}``.

    The checks a row implies are fixed by the row alone (so a partial score has a fixed denominator): per
    include clause a count check, a colour check if it names a colour, a position check if it names one;
    per exclude clause an absence check. A check that depends on a failed one fails (GenEval stops there
    too), so "all passed" is exactly GenEval's ``correct``. Colour and position look only at the ``count``
    most confident detections of the class, as GenEval does.
    """
    _, include, exclude = parse_spec(metadata)
    checks: list[dict[str, Any]] = []
    groups: list[list[Detection] | None] = []
    for clause in include:
        name, count = clause["class"], clause["count"]
        found = detected.get(name, [])[:count]
        matched = len(found) >= count
        checks.append(
            {
                "check": "count",
                "class": name,
                "expected": f">={count}",
                "found": len(detected.get(name, [])),
                "passed": matched,
            }
        )
        if "color" in clause:
            colors = classify_colors(name, found) if matched else []
            matched = matched and colors.count(clause["color"]) >= count
            checks.append(
                {"check": "color", "class": name, "expected": clause["color"], "found": colors, "passed": matched}
            )
        if "position" in clause:
            checks.append(_position_check(clause, found, matched, groups, include, margin))
            matched = checks[-1]["passed"]
        groups.append(found if matched else None)
    for clause in exclude:
        name, count = clause["class"], clause["count"]
        present = len(detected.get(name, []))
        checks.append(
            {"check": "exclude", "class": name, "expected": f"<{count}", "found": present, "passed": present < count}
        )
    return checks


def _position_check(
    clause: dict[str, Any],
    found: list[Detection],
    matched: bool,
    groups: list[list[Detection] | None],
    include: list[dict[str, Any]],
    margin: float,
) -> dict[str, Any]:
    """An include clause's position check: every one of its ``found`` boxes in the relation to every box of the
    clause it refers to (which must have passed: ``groups`` holds None for one that failed), as GenEval checks."""
    relation, target = clause["position"]
    targets = groups[target]
    seen: list[list[str]] = []
    if matched and targets is not None:
        for obj in found:
            for other in targets:
                seen.append(sorted(relative_position(obj.box, other.box, margin)))
                matched = matched and relation in seen[-1]
    else:
        matched = False
    return {
        "check": "position",
        "class": clause["class"],
        "expected": f"{relation} {include[target]['class']}",
        "found": seen,
        "passed": matched,
    }


def strict_and_partial(checks: list[dict[str, Any]]) -> tuple[float, float]:
    """``(1.0 if every check passed else 0.0, fraction of checks passed)``."""
    passed = sum(bool(check["passed"]) for check in checks)
    return float(passed == len(checks)), passed / len(checks)


def flow_grpo_reward(
    metadata: dict[str, Any],
    detected: dict[str, list[Detection]],
    classify_colors: ColorClassifier,
    *,
    margin: float = POSITION_MARGIN,
) -> tuple[float, bool, list[float]]:
    """Flow-GRPO's GenEval training reward (its reward server's ``evaluate_reward``): the mean of these terms.

    Per include clause, with n the kept detections of its class (all of them, not the first ``count``):
    ``1 - |count - n| / count`` (below 0 past 2 x count); if n != count, one 0 more when the clause names
    a colour or a position; else a colour adds ``1 - |count - matches| / count``, and a position (when the
    colour matched) adds 0 if its target clause failed, [0, 1] if a pair is on the wrong side, 1 if every
    pair is right. Exclude clauses are ignored. Returns (reward, every clause matched exactly, terms).
    """
    _, include, _ = parse_spec(metadata)
    terms: list[float] = []
    groups: list[list[Detection] | None] = []
    for clause in include:
        name, count = clause["class"], clause["count"]
        found = detected.get(name, [])
        terms.append(1.0 - abs(count - len(found)) / count)
        matched = len(found) == count
        if not matched and ("color" in clause or "position" in clause):
            terms.append(0.0)
        if matched and "color" in clause:
            hits = classify_colors(name, found).count(clause["color"])
            terms.append(1.0 - abs(count - hits) / count)
            matched = hits == count
        if matched and "position" in clause:
            relation, target = clause["position"]
            targets = groups[target]
            matched = targets is not None and all(
                relation in relative_position(obj.box, other.box, margin) for obj in found for other in targets
            )
            terms.extend([0.0] if targets is None else [1.0] if matched else [0.0, 1.0])
        groups.append(found if matched else None)
    return sum(terms) / len(terms), all(group is not None for group in groups), terms
