"""``geneval``: GenEval's rules on rigged detections (each wrong count, side or colour scores 0 under strict),
and the scorer end to end on a tiny random Mask2Former and CLIP loaded through its own load path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fixtures_geneval import build_tiny_geneval

from reward_server.scorers import SCORERS, ScoreOutcome, run_scorer
from reward_server.scorers import geneval_rules as rules
from reward_server.scorers.geneval import BACKGROUND, GenEvalScorer, crop_object, instances, jpeg_roundtrip
from shared.protocol import ErrorCode

DATA = Path(__file__).resolve().parents[2] / "data" / "flow_grpo" / "geneval_test_metadata.jsonl"


def _first_of_each_tag(path: Path) -> list[dict]:
    """The first row of each tag in GenEval's test metadata (Flow-GRPO's copy, in the repository), in file order."""
    rows = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["tag"], row)
    return list(rows.values())


REAL_ROWS = _first_of_each_tag(DATA)


def det(x1: float, y1: float, x2: float, y2: float, score: float = 0.95, mask: np.ndarray | None = None):
    return rules.Detection(box=(x1, y1, x2, y2), score=score, mask=mask)


def no_colors(name: str, found: list[rules.Detection]) -> list[str]:
    raise AssertionError("no colour check expected")


def strict_partial(row: dict[str, Any], detected: dict[str, list[rules.Detection]], colors=no_colors, **select):
    kept = rules.select_detections(detected, row["tag"], **select)
    return rules.strict_and_partial(rules.evaluate(row, kept, colors))


COUNT_TWO = {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]}


def test_counting_exact_count_passes_and_a_wrong_count_scores_zero() -> None:
    two = [det(0, 0, 10, 10), det(30, 0, 40, 10)]
    assert strict_partial(COUNT_TWO, {"cup": two}) == (1.0, 1.0)
    assert strict_partial(COUNT_TWO, {"cup": two[:1]}) == (0.0, 0.5)  # too few: the count check fails
    assert strict_partial(COUNT_TWO, {"cup": [*two, det(60, 0, 70, 10)]}) == (0.0, 0.5)  # too many: exclusion


def test_counting_keeps_only_confident_detections() -> None:
    # 0.9 for counting prompts, 0.3 otherwise, strictly above.
    shaky = [det(0, 0, 10, 10), det(30, 0, 40, 10, score=0.85), det(60, 0, 70, 10, score=0.9)]
    assert strict_partial(COUNT_TWO, {"cup": shaky}) == (0.0, 0.5)
    assert len(rules.select_detections({"cup": shaky}, "two_object")["cup"]) == 3
    assert rules.select_detections({"cup": [det(0, 0, 1, 1, score=0.3)]}, "single_object") == {}


def test_counting_overlapping_boxes_count_separately_unless_an_overlap_limit_is_set() -> None:
    # GenEval's default keeps overlapping same-class boxes (max_overlap 1.0): three near-identical cups count
    # as three (the exclusion fails); with a 0.5 IoU limit the duplicates go and the rest count as two.
    stacked = [det(0, 0, 19, 19, 0.99), det(1, 1, 20, 20, 0.97), det(50, 0, 69, 19, 0.96)]
    assert strict_partial(COUNT_TWO, {"cup": stacked}) == (0.0, 0.5)
    kept = rules.select_detections({"cup": stacked}, "counting", max_overlap=0.5)["cup"]
    assert [d.score for d in kept] == [0.99, 0.96]
    assert strict_partial(COUNT_TWO, {"cup": stacked}, max_overlap=0.5) == (1.0, 1.0)


def test_overlap_uses_inclusive_pixel_boxes_and_selection_caps_and_sorts() -> None:
    assert rules.box_iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0
    assert rules.box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)
    assert rules.box_iou((0, 0, 9, 9), (20, 20, 29, 29)) == 0.0
    many = [det(i, 0, i + 1, 1, score=0.4 + i / 100) for i in range(20)]
    kept = rules.select_detections({"cup": many}, "single_object")["cup"]
    assert len(kept) == rules.MAX_OBJECTS and kept[0].score == pytest.approx(0.59)
    assert [d.score for d in kept] == sorted((d.score for d in kept), reverse=True)


@pytest.mark.parametrize(
    ("box_a", "expected"),
    [
        ((0, 40, 20, 60), {"left of"}),
        ((80, 40, 100, 60), {"right of"}),
        ((40, 0, 60, 20), {"above"}),
        ((40, 80, 60, 100), {"below"}),
        ((0, 0, 20, 20), {"left of", "above"}),  # on the diagonal: both components exceed half the offset
        ((43, 40, 63, 60), set()),  # offset 3 px < margin 0.1 x (20 + 20) = 4 px: no relation
        ((36, 40, 56, 60), set()),  # 4 px exactly: shrunk to zero
        ((35, 40, 55, 60), set()),  # 5 px: 1 px left after the margin, 1/5 of the offset (needs > 1/2)
        ((32, 40, 52, 60), set()),  # 8 px: 4 px left, exactly half
        ((31, 40, 51, 60), {"left of"}),  # 9 px: 5 px left, more than half
        ((20, 30, 40, 50), {"left of"}),  # 20 px left, 10 px up: dy shrinks to 6 / 22.4 < 0.5
    ],
)
def test_relative_position_margins(box_a: tuple, expected: set[str]) -> None:
    assert rules.relative_position(box_a, (40, 40, 60, 60)) == expected


POSITION = {
    "tag": "position",
    "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["right of", 0]}],
}


def test_position_right_side_passes_and_a_wrong_side_scores_zero() -> None:
    dog = [det(0, 40, 20, 60)]
    assert strict_partial(POSITION, {"dog": dog, "cat": [det(80, 40, 100, 60)]}) == (1.0, 1.0)
    assert strict_partial(POSITION, {"dog": dog, "cat": [det(0, 0, 20, 10)]}) == (0.0, pytest.approx(2 / 3))
    assert strict_partial(POSITION, {"dog": dog, "cat": [det(3, 40, 23, 60)]}) == (0.0, pytest.approx(2 / 3))
    # No target object: the position check cannot pass either.
    assert strict_partial(POSITION, {"cat": [det(80, 40, 100, 60)]}) == (0.0, pytest.approx(1 / 3))


def test_position_uses_the_most_confident_detections_only() -> None:
    # GenEval judges the first `count` detections of the class; a less confident cat on the wrong side is ignored.
    cats = [det(80, 40, 100, 60, 0.9), det(0, 0, 10, 10, 0.5)]
    assert strict_partial(POSITION, {"dog": [det(0, 40, 20, 60)], "cat": cats}) == (1.0, 1.0)


def fixed_colors(colors: dict[str, list[str]]):
    return lambda name, found: colors[name][: len(found)]


COLOR_ATTR = {
    "tag": "color_attr",
    "include": [{"class": "handbag", "count": 1, "color": "pink"}, {"class": "scissors", "count": 1, "color": "black"}],
}


def test_colour_attribution_and_a_wrong_colour_scores_zero() -> None:
    found = {"handbag": [det(0, 0, 10, 10)], "scissors": [det(30, 0, 40, 10)]}
    right = fixed_colors({"handbag": ["pink"], "scissors": ["black"]})
    swapped = fixed_colors({"handbag": ["black"], "scissors": ["pink"]})
    assert strict_partial(COLOR_ATTR, found, right) == (1.0, 1.0)
    assert strict_partial(COLOR_ATTR, found, swapped) == (0.0, 0.5)
    # A missing object fails its colour check too (fixed denominator: four checks).
    assert strict_partial(COLOR_ATTR, {"handbag": found["handbag"]}, right) == (0.0, 0.5)


def dominant_color(name: str, found: list[rules.Detection], image: np.ndarray) -> list[str]:
    """A stand-in for CLIP: the most frequent of red/blue among a crop's non-grey pixels."""
    palette = {"red": (200, 0, 0), "blue": (0, 0, 200)}
    out = []
    for d in found:
        pixels = crop_object(image, d).reshape(-1, 3)
        votes = {c: int((pixels == rgb).all(1).sum()) for c, rgb in palette.items()}
        out.append(max(votes, key=votes.get))
    return out


def test_colour_is_read_from_the_masked_crop() -> None:
    # A small red disc on a blue field: its box is mostly blue, its mask only red.
    image = np.zeros((64, 64, 3), np.uint8)
    image[:] = (0, 0, 200)
    yy, xx = np.mgrid[:64, :64]
    disc = (yy - 32) ** 2 + (xx - 32) ** 2 <= 10**2
    image[disc] = (200, 0, 0)
    box = (0, 0, 64, 64)
    crop = crop_object(image, det(*box, mask=disc))
    assert crop.shape == (64, 64, 3)
    assert (crop[~disc] == BACKGROUND).all() and (crop[disc] == (200, 0, 0)).all()
    row = {"tag": "colors", "include": [{"class": "apple", "count": 1, "color": "red"}]}

    def classify(name, found):
        return dominant_color(name, found, image)

    assert strict_partial(row, {"apple": [det(*box, mask=disc)]}, classify) == (1.0, 1.0)
    assert strict_partial(row, {"apple": [det(*box)]}, classify) == (0.0, 0.5)  # unmasked: the blue wins
    assert crop_object(image, det(10.4, 20.6, 30.5, 40)).shape == (19, 20, 3)  # rounded box


TWO = {"tag": "two_object", "include": [{"class": "bowl", "count": 1}, {"class": "skis", "count": 1}]}


def test_two_objects_and_exclusions() -> None:
    assert strict_partial(TWO, {"bowl": [det(0, 0, 5, 5)], "skis": [det(9, 9, 19, 19, 0.31)]}) == (1.0, 1.0)
    assert strict_partial(TWO, {"bowl": [det(0, 0, 5, 5)], "skis": [det(9, 9, 19, 19, 0.29)]}) == (0.0, 0.5)
    assert strict_partial(TWO, {"bowl": [det(0, 0, 5, 5)], "cup": [det(9, 9, 19, 19)]}) == (0.0, 0.5)
    single = {
        "tag": "single_object",
        "include": [{"class": "bowl", "count": 1}],
        "exclude": [{"class": "cup", "count": 1}],
    }
    assert strict_partial(single, {"bowl": [det(0, 0, 5, 5)]}) == (1.0, 1.0)
    assert strict_partial(single, {"bowl": [det(0, 0, 5, 5)], "cup": [det(9, 9, 19, 19)]}) == (0.0, 0.5)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({}, "needs GenEval's 'tag'"),
        ({"tag": "single_object", "include": []}, "needs GenEval's 'tag'"),
        ({"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}, "80 object names"),
        ({"tag": "single_object", "include": [{"class": "cup", "count": 0}]}, "positive integer"),
        ({"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "teal"}]}, "'color' must be"),
        ({"tag": "position", "include": [{"class": "cup", "count": 1, "position": ["left of", 0]}]}, "earlier clause"),
        (
            {
                "tag": "position",
                "include": [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["near", 0]}],
            },
            "'position'",
        ),
    ],
)
def test_malformed_rows_are_refused(row: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rules.parse_spec(row)


def test_detector_labels_map_to_geneval_names() -> None:
    assert rules.canonical_label("mouse") == "computer mouse"
    assert rules.canonical_label("Remote") == "tv remote"
    assert rules.canonical_label("dining table") == "dining table"
    assert rules.canonical_label("wall-other-merged") is None
    assert len(set(rules.OBJECT_NAMES)) == 80


# ---- end to end on tiny random models --------------------------------------------------------------------


@pytest.fixture(scope="module")
def geneval_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every query says "cup" with probability ~1: cups are detected, so colour and position paths run.
    return build_tiny_geneval(tmp_path_factory.mktemp("geneval-models"), favour="cup")


@pytest.fixture(scope="module")
def loaded(geneval_model_dir: Path):
    strict = SCORERS["geneval"](model_dir=geneval_model_dir)
    partial = SCORERS["geneval_partial"](model_dir=geneval_model_dir)
    strict.load()
    partial.load()
    return strict, partial


def _score(scorer, rows: list[dict], seed: int = 0) -> list[ScoreOutcome]:
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in rows]
    metadata = [{k: v for k, v in row.items() if k != "prompt"} for row in rows]
    return run_scorer(scorer, images, [row.get("prompt", "") for row in rows], metadata)


CUP_ROWS = [
    {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}]},
    {
        "tag": "position",
        "include": [{"class": "cup", "count": 1}, {"class": "cup", "count": 1, "position": ["left of", 0]}],
    },
    {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}]},
]


def test_tiny_models_score_real_rows_well_formed_and_deterministic(loaded) -> None:
    strict, partial = loaded
    assert strict.version.startswith("geneval+mask2former-swin+clip-32+") and strict.version == partial.version
    rows = REAL_ROWS + CUP_ROWS
    first, again = _score(strict, rows), _score(strict, rows)
    partials = _score(partial, rows)
    assert [o.details for o in first] == [o.details for o in again]
    for row, outcome, other in zip(rows, first, partials, strict=True):
        assert outcome.ok, outcome.message
        details = outcome.details
        assert outcome.score == details["strict"] in (0.0, 1.0) and 0.0 <= details["partial"] <= 1.0
        assert other.score == pytest.approx(details["partial"]) and other.details == details
        assert details["tag"] == row["tag"] and details["checks"]
        kinds = [check["check"] for check in details["checks"]]
        assert kinds.count("count") == len(row["include"]) and kinds.count("exclude") == len(row.get("exclude", []))
        assert kinds.count("color") == sum("color" in c for c in row["include"])
        assert kinds.count("position") == sum("position" in c for c in row["include"])
    colour = first[len(rows) - 3].details["checks"][1]  # the cup's colour was read by the tiny CLIP
    assert colour["check"] == "color" and len(colour["found"]) == 1 and colour["found"][0] in rules.COLORS
    assert first[len(rows) - 3].details["detected"]["cup"]


def test_flow_grpo_mode_scores_the_jpeg_as_flow_grpos_server_sees_it(geneval_model_dir: Path, loaded) -> None:
    """``geneval_flow_grpo`` detects on the JPEG'd image with its channels reversed (what mmdet is handed in
    Flow-GRPO's server): its detections are ``geneval``'s on exactly those pixels; its score is the mean
    of its terms, and GenEval's own verdict stays in the details."""
    strict, _ = loaded
    flow = SCORERS["geneval_flow_grpo"](model_dir=geneval_model_dir)
    flow.load()
    assert flow.name == "geneval_flow_grpo" and flow.score_range == (2.0 - rules.MAX_OBJECTS, 1.0)
    rows = REAL_ROWS + CUP_ROWS
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in rows]
    metadata = [{k: v for k, v in row.items() if k != "prompt"} for row in rows]
    ours = run_scorer(flow, images, [""] * len(rows), metadata)
    seen = run_scorer(strict, [jpeg_roundtrip(image)[:, :, ::-1] for image in images], [""] * len(rows), metadata)
    plain = run_scorer(strict, images, [""] * len(rows), metadata)
    assert [o.details["detected"] for o in ours] == [o.details["detected"] for o in seen]
    assert [o.details["detected"] for o in ours] != [o.details["detected"] for o in plain]
    for outcome in ours:
        terms = outcome.details["flow_grpo"]["terms"]
        assert outcome.ok and outcome.score == pytest.approx(sum(terms) / len(terms))
        assert outcome.details["strict"] in (0.0, 1.0)
    assert len({o.score for o in ours}) > 1


def test_unusable_metadata_is_an_error_not_a_zero(loaded) -> None:
    strict, _ = loaded
    rows = [{"prompt": "a cup"}, {"tag": "single_object", "include": [{"class": "unicorn", "count": 1}]}]
    outcomes = _score(strict, rows)
    assert [o.error for o in outcomes] == [ErrorCode.PARSE, ErrorCode.PARSE]
    assert all(o.score is None for o in outcomes)


def test_load_refuses_missing_or_partial_directories(tmp_path: Path, geneval_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="geneval needs --model-dir"):
        SCORERS["geneval"]().load()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        SCORERS["geneval"](model_dir=tmp_path).load()
    with pytest.raises(ValueError, match="mode must be one of"):
        GenEvalScorer(geneval_model_dir, mode="lenient")


def test_instances_follow_mmdets_rule_and_map_masks_back_through_the_padding() -> None:
    # A 48x72 image resized to 64x96 and padded to 64x128; masks come at stride 4 (16x32).
    class_logits = torch.full((3, 5), -10.0)
    class_logits[0, 1] = class_logits[2, 1] = 10.0  # queries 0 and 2: "cup"; query 1: "dog"
    class_logits[1, 2] = 10.0
    masks = torch.full((3, 16, 32), -10.0)
    masks[0, 4:8, 0:12] = 10.0  # padded pixels rows 16-32, columns 0-48: image rows 12-24, columns 0-36
    masks[1, 0:4, 0:4] = 10.0
    masks[2, :, 26:] = 10.0  # only in the padding: nothing left after the crop
    found = instances(class_logits, masks, (64, 128), (64, 96), (48, 72), {1: "cup"})  # dogs not wanted
    assert list(found) == ["cup"] and len(found["cup"]) == 1
    cup = found["cup"][0]
    assert cup.box == pytest.approx((0, 12, 36, 24), abs=1)  # without the padding crop: columns 0-27
    assert cup.mask.shape == (48, 72) and cup.mask[18, 10] and not cup.mask[30, 10]
    # Class probability ~1 times the mean mask probability inside the mask (the upsampled edges pull it below 1).
    inside = masks[0, 4:8, 0:12].sigmoid().mean().item()
    assert 0.95 < cup.score < inside
    # A class probability at or below the lowest threshold never becomes a candidate.
    class_logits[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    assert instances(class_logits, masks, (64, 128), (64, 96), (48, 72), {1: "cup"}) == {}


def test_a_class_the_detector_cannot_name_is_an_error(geneval_model_dir: Path) -> None:
    scorer = SCORERS["geneval"](model_dir=geneval_model_dir)
    scorer.load()
    scorer._label_names = {i: name for i, name in scorer._label_names.items() if name != "bowl"}
    (outcome,) = _score(scorer, [{"tag": "single_object", "include": [{"class": "bowl", "count": 1}]}])
    assert outcome.error == ErrorCode.BAD_INPUT and "bowl" in outcome.message and outcome.score is None
