"""bench/algorithms.py's time-to-target figures from a run's metrics.jsonl records, the median [min-max] over
seeds with unreached seeds counted as infinite, and the markdown table read back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("bench_algorithms", Path(__file__).parents[2] / "bench" / "algorithms.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def _records(accuracies: list[float]) -> list[dict]:
    """An evaluation before RL and after each epoch of 160 images, 10 wall s and 8 CPU s, then the final one."""
    recs = [{"phase": "eval", "step": 0, "digit_accuracy": accuracies[0]}]
    for epoch, accuracy in enumerate(accuracies[1:], 1):
        recs.append({"phase": "rl", "step": epoch, "images": 160, "time_epoch_s": 10.0, "time_epoch_cpu_s": 8.0})
        recs.append({"phase": "eval", "step": epoch, "digit_accuracy": accuracy})
    return [*recs, {"phase": "final", "step": len(accuracies) - 1, "digit_accuracy": accuracies[-1]}]


def test_time_to_target_sums_the_epochs_up_to_the_first_evaluation_at_the_target():
    got = bench.time_to_target(_records([0.9, 0.94, 0.96, 0.93]), "digit_accuracy", 0.95)
    assert {k: got[k] for k in ("epoch", "images", "wall_s", "cpu_s", "final", "best")} == {
        "epoch": 2,
        "images": 320,
        "wall_s": 20.0,
        "cpu_s": 16.0,
        "final": 0.93,
        "best": 0.96,
    }
    assert got["curve"][0] == (0, 0, 0, 0.9)
    assert bench.time_to_target(_records([0.96, 0.9]), "digit_accuracy", 0.95)["images"] == 0  # before RL
    missed = bench.time_to_target(_records([0.9, 0.94]), "digit_accuracy", 0.95)
    assert missed["epoch"] is None and missed["wall_s"] is None
    assert got["forwards"] is None and not got["logged_forwards"]  # runs from before it was logged
    branched = _records([0.9, 0.94, 0.96])
    for r in branched[1::2]:
        r["rollout_forwards_per_image"] = 8.5
    assert bench.time_to_target(branched, "digit_accuracy", 0.95)["forwards"] == 2 * 160 * 8.5
    with pytest.raises(ValueError, match="pass the task's metric as --metric"):
        bench.time_to_target(_records([0.9]), "ocr_accuracy", 0.6)


def test_the_table_counts_unreached_seeds_as_infinite_and_parses_back():
    seeds = [
        bench.time_to_target(_records(curve), "digit_accuracy", 0.95)
        for curve in ([0.9, 0.96, 0.97], [0.9, 0.9, 0.94], [0.9, 0.94, 0.95])
    ]
    rows = bench.summary_rows({"grpo": seeds, "dpo": seeds[1:2]}, "digit_accuracy")
    table = bench.parse_markdown("text before\n\n" + bench.markdown(rows) + "\n\nnote")
    assert table == rows
    assert table[0]["reached"] == "2/3" and table[0]["images to target"] == "320 [160-n.r.]"
    assert table[0]["best digit_accuracy"] == "0.95 [0.94-0.97]"
    assert table[1]["RL wall s to target"] == "n.r." and table[1]["final digit_accuracy"] == "0.94"
