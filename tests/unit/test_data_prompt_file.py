"""Prompt-file tasks: the real Flow-GRPO prompt sets through the registry (GenEval fields and OCR targets become
per-item reward metadata, and that metadata passes the reward protocol's validation on the wire as the trainer
sends it), and malformed files refused naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.protocol import ScoreRequest
from trainer.config import DataConfig
from trainer.data import build_task
from trainer.data.prompt_file import PromptFileTask
from trainer.rewards.client import HttpRewardClient

DATA = Path(__file__).resolve().parents[2] / "data" / "flow_grpo"


def _wire_metadata(prompts: list[str], metadata: list[dict]) -> list[dict]:
    """The metadata a reward server receives: the client's JSON body, validated as the server validates it."""
    client = HttpRewardClient(["http://127.0.0.1:9"], {"ocr": 1.0}, wire_format="png", verify_replicas=False)
    try:
        body = client.encode_body(np.zeros((len(prompts), 2, 2, 3), np.uint8), prompts, metadata)
    finally:
        client.close()
    return [item.metadata for item in ScoreRequest.model_validate_json(body).items]


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
    np.testing.assert_array_equal(
        decode_image(item.mask.format, item.mask.data, item.mask.shape).reshape(4, 4, -1)[..., :1], mask
    )


def test_real_ocr_and_geneval_files():
    ocr = PromptFileTask(str(DATA / "ocr_test_prompts.txt"))
    assert len(ocr.prompts) == 1018  # 1,017 newlines; the last line has none
    assert ocr.item_metadata([0])[0]["text"] == "Spring Collection 2024"
    geneval = PromptFileTask(str(DATA / "geneval_test_metadata.jsonl"))
    assert len(geneval.prompts) == 2212  # as above, no final newline
    (meta,) = geneval.item_metadata([geneval.prompts.index("a photo of two wine glasses")])
    assert meta["tag"] == "counting" and meta["include"] == [{"class": "wine glass", "count": 2}]


def test_bad_rows_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a record needs a non-empty"):
        PromptFileTask(str(bad))
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        PromptFileTask(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        PromptFileTask(str(tmp_path / "missing.txt"))
    txt = tmp_path / "p.txt"
    txt.write_text('a sign that says "OPEN"\n\nplain prompt\n')
    task = PromptFileTask(str(txt))
    assert task.prompts == ['a sign that says "OPEN"', "plain prompt"]
    assert task.item_metadata([0, 1]) == [{"text": "OPEN"}, {}]
    with pytest.raises(ValueError, match="warmup_steps=0"):
        task.supervised_batch(2, None)


def test_a_folder_or_a_file_that_is_not_utf8_is_named_with_the_fix(tmp_path):
    """A folder was "no such file"; a Latin-1 file was "'utf-8' codec can't decode byte ..." with no file."""
    from trainer.data.edit_jsonl import read_edit_jsonl
    from trainer.data.inpaint_jsonl import read_inpaint_jsonl

    for read in (PromptFileTask, lambda p: read_edit_jsonl(p, 16), lambda p: read_inpaint_jsonl(p, 16)):
        with pytest.raises(ValueError, match=rf"data.path='{tmp_path}' is a folder: name the file in it"):
            read(str(tmp_path))
        with pytest.raises(ValueError, match=r"^data.path is not set: name the (a \.txt|an editing|an inpainting)"):
            read("")  # was "data.path='' is a folder": the current directory
    latin = tmp_path / "prompts.txt"
    latin.write_bytes("a cat\na caf\u00e9 sign\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{latin}:2: not UTF-8 text \(byte 0xe9 at offset 11\): save it as UTF-8"):
        PromptFileTask(str(latin))
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"prompt": "ok"}\n\xff\n')
    with pytest.raises(ValueError, match=rf"{rows}:2: not UTF-8 text \(byte 0xff at offset 17\)"):
        PromptFileTask(str(rows))


def test_the_suffix_picks_the_format_whatever_its_case_and_others_are_refused(tmp_path):
    upper = tmp_path / "P.JSONL"
    upper.write_text('{"prompt": "a cat", "tag": "single_object"}\n')
    task = PromptFileTask(str(upper))
    assert task.prompts == ["a cat"] and task.item_metadata([0]) == [{"tag": "single_object"}]
    (tmp_path / "p.TXT").write_text("a dog\n")
    assert PromptFileTask(str(tmp_path / "p.TXT")).prompts == ["a dog"]
    for name in ("p.json", "prompts"):
        (tmp_path / name).write_text('{"prompt": "a cat"}\n')
        with pytest.raises(ValueError, match=rf"data.path=.*{name}'.*reads \.txt .* or \.jsonl"):
            PromptFileTask(str(tmp_path / name))


def test_a_repeated_prompt_keeps_each_records_metadata(tmp_path):
    """Metadata belongs to the item, not to the prompt text: a prompt listed twice with other fields sends
    each record's own."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "two cats", "tag": "counting"}\n{"prompt": "a dog"}\n'
        '{"prompt": "two cats", "tag": "colors", "include": [1]}\n'
    )
    task = PromptFileTask(str(path))
    assert task.item_metadata([2, 0, 1]) == [{"tag": "colors", "include": [1]}, {"tag": "counting"}, {}]
