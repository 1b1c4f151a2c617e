"""GenEval's verdict (djghosh13/geneval) and Flow-GRPO's GenEval reward (yifan123/reward-server) against our
rules, on random detection sets over the real GenEval rows of data/flow_grpo and random rows.

The detector and CLIP need real weights, so detections and colours are drawn at random and handed to both
sides: our ``select_detections`` + ``evaluate`` / ``flow_grpo_reward`` and transcriptions of the authors'
selection loop and verdict functions. The image path of ``geneval_flow_grpo`` (its client's JPEG) is checked
on pixels.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transcribed import Source, transcribes

from reward_server.scorers import geneval_rules as rules
from reward_server.scorers.geneval import jpeg_roundtrip

GENEVAL = Source(
    "djghosh13/geneval",
    "af4902f24d3ca90ebbb446dd9891a59e0f82725f",
    "evaluation/evaluate_images.py",
    "evaluate_image, evaluate, relative_position, compute_iou",
)
REWARD_SERVER = Source(
    "yifan123/reward-server",
    "92ac29fb322c028f8840db8f93c950422931710d",
    "reward_server/gen_eval.py",
    "evaluate_reward, evaluate_image",
)
FLOW_GRPO_CLIENT = Source(
    "yifan123/flow_grpo", "94e23ee5405ab7241fc1f75d30cac8147e2b1f53", "flow_grpo/rewards.py", "geneval_score"
)
ROWS = [
    json.loads(line)
    for line in (Path(__file__).resolve().parents[2] / "data/flow_grpo/geneval_test_metadata.jsonl")
    .read_text()
    .splitlines()
]


# ---- transcriptions of the authors' functions (boxes are rows [x1, y1, x2, y2, score]) -------------------


def _iou(box_a, box_b) -> float:
    """djghosh13/geneval@af4902f evaluation/evaluate_images.py ``compute_iou``: inclusive pixel boxes."""

    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]), min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0


def _relative_position(obj_a, obj_b, margin: float = 0.1) -> set[str]:
    """djghosh13/geneval@af4902f ``relative_position`` (POSITION_THRESHOLD = 0.1)."""
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - margin * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    return {
        name
        for name, hit in (
            ("left of", dx < -0.5),
            ("right of", dx > 0.5),
            ("above", dy < -0.5),
            ("below", dy > 0.5),
        )
        if hit
    }


def _select(bbox: dict[str, np.ndarray], tag: str, nms: float = 1.0) -> dict[str, list]:
    """djghosh13/geneval@af4902f ``evaluate_image``'s selection (the same in reward-server's): per class,
    descending confidence above 0.3 (0.9 for counting), at most 16, greedy overlap removal unless nms == 1."""
    threshold = 0.9 if tag == "counting" else 0.3
    detected = {}
    for name, rows in bbox.items():
        order = np.argsort(rows[:, 4])[::-1]
        order = order[rows[order, 4] > threshold][:16].tolist()
        kept = []
        while order:
            best = order.pop(0)
            kept.append((rows[best], None))
            order = [i for i in order if nms == 1 or _iou(rows[best], rows[i]) < nms]
        if kept:
            detected[name] = kept
    return detected


def _geneval_correct(objects: dict[str, list], metadata: dict, colors) -> bool:
    """djghosh13/geneval@af4902f ``evaluate``: include clauses ANDed (at least ``count``, colour and position
    judged on the ``count`` most confident), any exclude clause met fails."""
    correct, groups = True, []
    for req in metadata.get("include", []):
        found = objects.get(req["class"], [])[: req["count"]]
        matched = len(found) >= req["count"]
        if matched and "color" in req and colors(found, req["class"]).count(req["color"]) < req["count"]:
            matched = False
        if matched and "position" in req:
            relation, target = req["position"]
            if groups[target] is None:
                matched = False
            else:
                for obj in found:
                    if any(relation not in _relative_position(obj, other) for other in groups[target]):
                        matched = False
                        break
        correct = correct and matched
        groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
    return correct


def _flow_grpo_reward(objects: dict[str, list], metadata: dict, colors) -> tuple[bool, float]:
    """yifan123/reward-server@92ac29f reward_server/gen_eval.py ``evaluate_reward``: (strict, reward)."""
    correct, rewards, groups = True, [], []
    for req in metadata.get("include", []):
        count = req["count"]
        found = objects.get(req["class"], [])
        matched = True
        rewards.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            correct = matched = False
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                hits = colors(found, req["class"]).count(req["color"])
                rewards.append(1 - abs(count - hits) / count)
                if hits != count:
                    correct = matched = False
            if "position" in req and matched:
                relation, target = req["position"]
                if groups[target] is None:
                    correct = matched = False
                    rewards.append(0.0)
                else:
                    for obj in found:
                        for other in groups[target]:
                            if relation not in _relative_position(obj, other):
                                correct = matched = False
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)  # appended after the loops, failed or not
        groups.append(found if matched else None)
    return correct, (sum(rewards) / len(rewards) if rewards else 0)


def _flow_grpo_client_pixels(image: np.ndarray) -> np.ndarray:
    """yifan123/flow_grpo@94e23ee flow_grpo/rewards.py ``geneval_score``'s JPEG (PIL defaults), then
    reward-server's app_geneval.py decoding (``Image.open(..., formats=["jpeg"])``) and ``np.array``."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG")
    return np.array(Image.open(io.BytesIO(buffer.getvalue()), formats=["jpeg"]))


# ---- random inputs ---------------------------------------------------------------------------------------


def _random_row(rng: np.random.Generator) -> dict[str, Any]:
    """A GenEval-shaped row beyond the real ones: counts 1-4 with colours and positions together."""
    classes = rng.choice(rules.OBJECT_NAMES[:12], size=int(rng.integers(1, 4)), replace=False).tolist()
    include = []
    for index, name in enumerate(classes):
        clause: dict[str, Any] = {"class": name, "count": int(rng.integers(1, 5))}
        if rng.random() < 0.5:
            clause["color"] = str(rng.choice(rules.COLORS))
        if index and rng.random() < 0.6:
            clause["position"] = [str(rng.choice(rules.RELATIONS)), int(rng.integers(0, index))]
        include.append(clause)
    exclude = [{"class": str(rng.choice(classes)), "count": int(rng.integers(1, 6))} for _ in range(rng.integers(0, 3))]
    return {
        "tag": str(rng.choice(["counting", "colors", "position", "color_attr"])),
        "include": include,
        "exclude": exclude,
    }


def _random_detections(rng: np.random.Generator, row: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict]:
    """Per class of the row (and a distractor): boxes around the wanted count, confidences often above
    0.9, and a colour per box (the wanted one more often than not)."""
    wanted = {c["class"]: c for c in row["include"] + row.get("exclude", [])}
    bbox, colour_of = {}, {}
    for name in [*wanted, "bench"]:
        count = wanted.get(name, {}).get("count", 1)
        n = int(rng.integers(0, count + 3))
        x1y1 = rng.uniform(0, 400, (n, 2))
        x2y2 = x1y1 + rng.uniform(4, 120, (n, 2))
        scores = np.where(rng.random(n) < 0.6, rng.uniform(0.9, 1.0, n), rng.uniform(0.0, 1.0, n))
        bbox[name] = np.concatenate([x1y1, x2y2, scores[:, None]], axis=1)
        target_colour = wanted.get(name, {}).get("color", "red")
        for box in bbox[name]:
            colour_of[tuple(box[:4].tolist())] = target_colour if rng.random() < 0.7 else str(rng.choice(rules.COLORS))
    return bbox, colour_of


def _ours(bbox: dict[str, np.ndarray], tag: str, **select) -> dict[str, list[rules.Detection]]:
    candidates = {
        name: [rules.Detection(tuple(row[:4].tolist()), float(row[4])) for row in rows] for name, rows in bbox.items()
    }
    return rules.select_detections(candidates, tag, **select)


def _their_colours(colour_of: dict):
    return lambda found, name: [colour_of[tuple(obj[0][:4].tolist())] for obj in found]


def _our_colours(colour_of: dict):
    return lambda name, found: [colour_of[d.box] for d in found]


def _cases(seed: int, n_real: int = 600, n_random: int = 600):
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(ROWS), n_real, replace=False)
    rows = [ROWS[i] for i in picks] + [_random_row(rng) for _ in range(n_random)]
    for row in rows:
        yield row, *_random_detections(rng, row)


# ---- the tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_overlap", [1.0, 0.5])
@transcribes("scorer:geneval", "scorer:geneval_partial", source=GENEVAL)
def test_strict_is_genevals_verdict_and_partial_is_one_exactly_then(max_overlap: float) -> None:
    """``geneval`` = GenEval's ``correct``; ``geneval_partial`` (ours: the fraction of GenEval's checks passed)
    is 1.0 exactly when GenEval says correct, on the same selected detections."""
    verdicts = []
    for row, bbox, colour_of in _cases(seed=0):
        theirs_objects = _select(bbox, row["tag"], nms=max_overlap)
        ours_objects = _ours(bbox, row["tag"], max_overlap=max_overlap)
        assert {k: [tuple(o[0][:4].tolist()) for o in v] for k, v in theirs_objects.items()} == {
            k: [d.box for d in v] for k, v in ours_objects.items()
        }
        correct = _geneval_correct(theirs_objects, row, _their_colours(colour_of))
        checks = rules.evaluate(row, ours_objects, _our_colours(colour_of))
        strict, partial = rules.strict_and_partial(checks)
        assert strict == float(correct), (row, checks)
        assert (partial == 1.0) == correct and 0.0 <= partial <= 1.0
        verdicts.append(correct)
    assert 0.15 < np.mean(verdicts) < 0.85  # both verdicts occur often: the comparison has teeth


@transcribes("scorer:geneval_flow_grpo", source=REWARD_SERVER)
def test_geneval_flow_grpo_is_flow_grpos_reward_exactly() -> None:
    """``geneval_flow_grpo``'s score is ``evaluate_reward``'s reward, bit for bit, and its ``exact`` flag is
    that function's ``strict_correct``."""
    rewards = []
    for row, bbox, colour_of in _cases(seed=1):
        theirs_objects = _select(bbox, row["tag"])
        strict, reward = _flow_grpo_reward(theirs_objects, row, _their_colours(colour_of))
        ours, exact, terms = rules.flow_grpo_reward(row, _ours(bbox, row["tag"]), _our_colours(colour_of))
        assert ours == reward and exact == strict, (row, terms)
        rewards.append(reward)
    assert min(rewards) < 0 and max(rewards) == 1.0 and len(set(rewards)) > 20


@transcribes("scorer:geneval_flow_grpo", source=FLOW_GRPO_CLIENT)
def test_geneval_flow_grpo_sees_the_pixels_flow_grpos_server_sees() -> None:
    rng = np.random.default_rng(2)
    for shape in [(64, 48, 3), (512, 512, 3), (33, 17, 3)]:
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        seen = jpeg_roundtrip(image)
        np.testing.assert_array_equal(seen, _flow_grpo_client_pixels(image))
        assert np.abs(seen.astype(int) - image).max() > 0  # lossy: a copy of the input would fail here
