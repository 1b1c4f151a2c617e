"""The real Flow-GRPO prompt sets through the registry: GenEval fields and OCR targets become per-item reward
metadata, and that metadata passes the reward protocol's validation on the wire as the trainer sends it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.protocol import ScoreRequest
from trainer.config import DataConfig
from trainer.data import build_task
from trainer.rewards.client import HttpRewardClient

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "flow_grpo"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="the shared prompt sets sit beside the checkout")


def _wire_metadata(prompts: list[str], metadata: list[dict]) -> list[dict]:
    """The metadata a reward server receives: the client's JSON body, validated as the server validates it."""
    client = HttpRewardClient(["http://127.0.0.1:9"], {"ocr": 1.0}, wire_format="png", verify_replicas=False)
    try:
        body = client.encode_body(np.zeros((len(prompts), 2, 2, 3), np.uint8), prompts, metadata)
    finally:
        client.close()
    return [item.metadata for item in ScoreRequest.model_validate_json(body).items]


@needs_data
def test_geneval_records_travel_as_reward_metadata():
    task = build_task(DataConfig(name="prompt_file", path=str(DATA / "geneval_test_metadata.jsonl")))
    records = [json.loads(line) for line in (DATA / "geneval_test_metadata.jsonl").read_text().splitlines()]
    assert len(task.prompts) == len(records) == 2212
    indices = list(range(0, len(records), 97))
    metadata = task.item_metadata(indices)
    for i, meta in zip(indices, metadata, strict=True):
        expected = {k: v for k, v in records[i].items() if k != "prompt"}
        assert {k: meta[k] for k in expected} == expected and {"tag", "include"} <= set(meta)
    assert _wire_metadata([task.prompts[i] for i in indices], metadata) == metadata
    wine = task.prompts.index("a photo of two wine glasses")
    assert task.item_metadata([wine])[0]["include"] == [{"class": "wine glass", "count": 2}]
    assert task.eval_prompts == task.prompts[:8] and task.inputs([0, 1]) is None


@needs_data
def test_text_rendering_prompts_carry_their_quoted_target():
    task = build_task(DataConfig(name="prompt_file", path=str(DATA / "ocr_test_prompts.txt")))
    metadata = task.item_metadata(list(range(len(task.prompts))))
    quoted = [p for p in task.prompts if p.count('"') >= 2]
    assert len(quoted) > 1000 and sum("text" in m for m in metadata) == len(quoted)
    first = metadata[0]
    assert first == {"text": "Spring Collection 2024"} and task.prompts[0].count(f'"{first["text"]}"') == 1
    assert _wire_metadata(task.prompts[:50], metadata[:50]) == metadata[:50]


@pytest.mark.parametrize("wire_format", ["png", "msgpack"])
def test_a_task_mask_travels_in_the_item_mask_field(wire_format):
    """Inpainting tasks put the mask in metadata (where in-process scorers read it); on the wire it must go in
    the item's ``mask`` field, which the protocol reserves, and decode back to the same pixels."""
    from shared.imagecodec import decode_image
    from shared.protocol import BinaryScoreRequest
    from shared.wire import unpack_msgpack

    mask = np.zeros((4, 4, 1), np.uint8)
    mask[:2] = 255
    client = HttpRewardClient(["http://127.0.0.1:9"], {"ocr": 1.0}, wire_format=wire_format, verify_replicas=False)
    try:
        body = client.encode_body(np.zeros((1, 4, 4, 3), np.uint8), ['a sign "OPEN"'], [{"text": "OPEN", "mask": mask}])
    finally:
        client.close()
    if wire_format == "msgpack":
        (item,) = BinaryScoreRequest.model_validate(unpack_msgpack(body)).items
    else:
        (item,) = ScoreRequest.model_validate_json(body).items
    assert item.metadata == {"text": "OPEN"} and item.mask is not None
    np.testing.assert_array_equal(decode_image(item.mask.format, item.mask.data, item.mask.shape).reshape(4, 4, -1)[..., :1], mask)
