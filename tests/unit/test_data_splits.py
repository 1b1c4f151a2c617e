"""Training and test splits that cannot meet: the committed training sets (data/geneval, data/ocr; their commands
write them byte for byte: tests/integration/test_data_commands.py) share no prompt, GenEval check or OCR text with
the test sets, and read as the trainer reads them (a run whose data.path shares items with eval.path:
tests/unit/test_data_overlap.py)."""

from __future__ import annotations

import json
from pathlib import Path

from reward_server.scorers import geneval_rules
from reward_server.scorers.ocr import target_text
from trainer.data import make_geneval_prompts as geneval
from trainer.data import make_ocr_prompts as ocr
from trainer.data.prompt_file import PromptFileTask, quoted_text

REPO = Path(__file__).resolve().parents[2]
GENEVAL_TEST = REPO / geneval.TEST
OCR_TEST = REPO / ocr.TEST


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _rebuild(row: dict) -> dict:
    """``row`` made anew by our generator's maker of its tag, from its objects, counts, colours and relation."""
    first, *rest = row["include"]
    second = rest[0] if rest else {}
    if row["tag"] == "two_object":
        return geneval.two_object(first["class"], second["class"])
    if row["tag"] == "counting":
        return geneval.counting(first["class"], first["count"])
    if row["tag"] == "colors":
        return geneval.colors(first["class"], first["color"])
    if row["tag"] == "position":
        return geneval.position(second["class"], second["position"][0], first["class"])
    return geneval.color_attr(first["class"], first["color"], second["class"], second["color"])


def test_our_geneval_templates_rebuild_every_test_record():
    """GenEval's generator, as transcribed: each record of its test set (but single_object, which no training
    record uses) comes back byte for byte from its objects, counts, colours and relation; the vocabulary is the
    one the geneval scorer checks against."""
    assert (geneval.OBJECTS, geneval.COLORS, geneval.RELATIONS) == (
        geneval_rules.OBJECT_NAMES,
        geneval_rules.COLORS,
        geneval_rules.RELATIONS,
    )
    rebuilt = 0
    for row in _jsonl(GENEVAL_TEST):
        if row["tag"] != "single_object":
            assert json.dumps(_rebuild(row)) == json.dumps(row)
            rebuilt += 1
    assert rebuilt == 2212 - 320  # all but the 80 single_object prompts (4 rows each)


def test_geneval_training_records_share_no_check_with_the_test_set():
    """No training record asks what a test record asks, in either order (a mirrored relation included); each is
    a valid GenEval spec; the tags are mixed in Flow-GRPO's proportions."""
    test, train = _jsonl(GENEVAL_TEST), _jsonl(REPO / geneval.OUT)
    assert len(train) == geneval.ROWS
    assert not {geneval.spec(r) for r in train} & {geneval.spec(r) for r in test}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    mirrored = geneval.position("laptop", "left of", "cow")  # the test set's "a cow right of a laptop", mirrored
    assert geneval.spec(mirrored) in {geneval.spec(r) for r in test}
    for record in train:
        geneval_rules.parse_spec(record)
    counts = {tag: sum(r["tag"] == tag for r in train) for tag in geneval.TAG_WEIGHTS}
    total = sum(geneval.TAG_WEIGHTS.values())
    assert all(abs(counts[t] - geneval.ROWS * w / total) < 1 for t, w in geneval.TAG_WEIGHTS.items()), counts
    task = PromptFileTask(str(REPO / geneval.OUT))
    assert task.item_metadata([0])[0] == {k: v for k, v in train[0].items() if k != "prompt"}


def test_the_geneval_generator_leaves_out_what_it_is_told_is_test():
    """A record the generator writes from nothing is absent, mirror image and all, once a test set holds it."""
    free = geneval.generate([], rows=300, seed=3)
    position = next(r for r in free if r["tag"] == "position")
    (b, a), relation = (c["class"] for c in position["include"]), position["include"][1]["position"][0]
    mirror = geneval.position(b, geneval.MIRROR[relation], a)
    told = geneval.generate([mirror], rows=300, seed=3)
    assert geneval.spec(position) not in {geneval.spec(r) for r in told}
    assert geneval.generate([], rows=300, seed=3) == free  # seeded


def test_ocr_training_prompts_hold_no_test_text():
    """Each training prompt has one quoted text, the target the trainer and the OCR scorer read; none holds a
    test target's words in a row, and none is a test prompt."""
    test, train = _lines(OCR_TEST), _lines(REPO / ocr.OUT)
    assert len(train) == len(set(train)) == ocr.PROMPTS and not set(train) & set(test)
    banned = ocr.target_words(test)
    assert len(banned) > 900
    for prompt in train:
        text = quoted_text(prompt)
        assert prompt.count('"') == 2 and target_text(prompt, {}) == text
        assert not ocr.runs(ocr.words(text)) & banned, text
    test_texts = {quoted_text(p).lower() for p in test}
    assert not {quoted_text(p).lower() for p in train} & test_texts
    task = PromptFileTask(str(REPO / ocr.OUT))
    assert task.item_metadata([0]) == [{"text": quoted_text(train[0])}]


def test_the_ocr_generator_leaves_out_what_it_is_told_is_test():
    """A text the generator writes from nothing is absent once a test prompt quotes it, and so is every text
    holding it (its words in a row, whatever the case)."""
    free = ocr.generate([], count=200, seed=5)
    text = quoted_text(free[0])
    told = ocr.generate([f'A wall that says "{text.upper()}".'], count=200, seed=5)
    assert not any(ocr.words(text) in ocr.runs(ocr.words(quoted_text(p))) for p in told)
    assert ocr.generate([], count=200, seed=5) == free  # seeded
