"""Prompt-file tasks on the real Flow-GRPO prompt sets and on malformed files."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.data.prompt_file import PromptFileTask

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "flow_grpo"


@pytest.mark.skipif(not DATA.is_dir(), reason="the shared prompt sets sit beside the checkout")
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
    path.write_text('{"prompt": "two cats", "tag": "counting"}\n{"prompt": "a dog"}\n'
                    '{"prompt": "two cats", "tag": "colors", "include": [1]}\n')
    task = PromptFileTask(str(path))
    assert task.item_metadata([2, 0, 1]) == [{"tag": "colors", "include": [1]}, {"tag": "counting"}, {}]
