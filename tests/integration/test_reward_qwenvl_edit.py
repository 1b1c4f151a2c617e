"""The qwenvl edit judge behind a real reward server gets its reference image from the trainer's client.

The reference image is a uint8 array in the item's metadata (as the in-process client passes it); over
HTTP it travels as a metadata image and the server decodes it back into an array. The model is a tiny
Qwen2.5-VL whose head is rigged to answer "4" (score 0.75), so a score means the edit query was built.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fixtures_models import build_tiny_qwen_vl, rig_digits
from servers import serve

from reward_server.app import create_app
from reward_server.scorers import SCORERS
from reward_server.settings import ServerSettings
from trainer.rewards import HttpRewardClient


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<model_dir>/qwenvl``: a tiny Qwen2.5-VL whose answer is "4" with probability ~1."""
    path = tmp_path_factory.mktemp("rigged")
    rig_digits(build_tiny_qwen_vl(path / "qwenvl"), {"4": 5.0})
    return path


@pytest.mark.parametrize("wire_format", ["msgpack", "png"])
def test_edit_items_with_a_reference_array_are_scored(model_dir: Path, wire_format: str) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    reference = rng.integers(0, 256, (40, 24, 3), dtype=np.uint8)
    metadata = [{"judge_task": "edit", "reference_image": reference}, {"judge_task": "edit"}]
    app = create_app({"qwenvl": SCORERS["qwenvl"](model_dir=model_dir)}, ServerSettings())
    with serve(app) as url, HttpRewardClient([url], {"qwenvl": 1.0}, wire_format=wire_format) as client:
        result = client.score(images, ["make it blue"] * 2, metadata)
    assert result.combined[0] == pytest.approx(0.75, abs=1e-4), result.errors
    assert result.errors["qwenvl"] == {1: "PARSE: the edit task needs metadata['reference_image']"}
