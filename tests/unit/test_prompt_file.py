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
    assert ocr.metadata(ocr.prompts[0])["text"] == "Spring Collection 2024"
    geneval = PromptFileTask(str(DATA / "geneval_test_metadata.jsonl"))
    assert len(geneval.prompts) == 2212  # as above, no final newline
    meta = geneval.metadata("a photo of two wine glasses")
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
    assert task.metadata(task.prompts[0]) == {"text": "OPEN"} and task.metadata("plain prompt") == {}
    with pytest.raises(ValueError, match="warmup_steps=0"):
        task.supervised_batch(2, None)
