"""``unifiedreward`` and ``unifiedreward_api`` on a tiny random Qwen2.5-VL rigged to answer "Final Score:4".

The rigged model checks the real path (loading, chat text, image tokens, greedy generation, decoding) with an
answer known in advance; what UnifiedReward's answers look like, and how they are read, is checked on text.
The API backend talks to a real chat server on 127.0.0.1 that runs the same tiny model.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from chat_server import serve_chat
from fixtures_models import build_tiny_qwen_vl, rig_answer
from PIL import Image

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.qwenvl import LocalQwenVL
from reward_server.scorers.unifiedreward import PROMPTS, UnifiedRewardScorer, read_rating
from shared.protocol import ErrorCode

RNG = np.random.default_rng(0)
IMAGES = [RNG.integers(0, 256, (40, 60, 3), dtype=np.uint8), RNG.integers(0, 256, (16, 16, 1), dtype=np.uint8)]
PROMPT_TEXTS = ["a cat", 'a sign that says "OPEN" on a red door']


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unifiedreward")
    rig_answer(build_tiny_qwen_vl(root / "unifiedreward"), "Final Score:4")
    return root


def test_local_backend_reads_the_generated_rating(model_dir: Path) -> None:
    scorer = SCORERS["unifiedreward"](model_dir=model_dir)
    scorer.load()
    outcomes = run_scorer(scorer, IMAGES, PROMPT_TEXTS, [{}, {}])
    assert [(o.ok, o.score, o.details["answer"]) for o in outcomes] == [(True, 4.0, "Final Score:4")] * 2
    assert scorer.version.startswith("unifiedreward+qwen2_5_vl+") and scorer.version.endswith("+point")
    assert scorer.score_range == (1.0, 5.0)


def test_api_backend_sends_the_prompt_and_reads_the_same_rating(model_dir: Path, tmp_path: Path) -> None:
    with serve_chat(LocalQwenVL(model_dir / "unifiedreward", max_new_tokens=32)) as server:
        host, port = server.server_address[:2]
        options = {
            "base_url": f"http://{host}:{port}/v1",
            "model": "tiny-qwen",
            "task": "flow_grpo",
            "max_new_tokens": 32,
        }
        (tmp_path / "unifiedreward_api.json").write_text(json.dumps(options))
        scorer = SCORERS["unifiedreward_api"](model_dir=tmp_path)
        scorer.load()
        outcomes = run_scorer(scorer, IMAGES, PROMPT_TEXTS, [{}, {}])
    assert [(o.ok, o.score) for o in outcomes] == [(True, 4.0)] * 2
    sent = server.requests[-len(PROMPT_TEXTS) :]  # one request per image, sent concurrently: in any order
    questions = sorted(
        part["text"] for request in sent for part in request["messages"][-1]["content"] if part["type"] == "text"
    )
    assert questions == sorted(PROMPTS["flow_grpo"].format(prompt=text) for text in PROMPT_TEXTS)
    assert all(request["max_tokens"] == 32 for request in sent)
    assert all(request["messages"][0]["role"] == "user" for request in sent)  # no system message, as Flow-GRPO
    sizes = {
        Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))).size
        for request in sent
        for part in request["messages"][-1]["content"]
        if part["type"] == "image_url"
    }
    assert sizes == {(512, 512)}
    assert all(question.startswith("<image>\n") for question in questions)
    assert {question.rsplit("Text Caption: ", 1)[1] for question in questions} == {f"[{t}]" for t in PROMPT_TEXTS}


@pytest.mark.parametrize(
    ("task", "text", "score"),
    [
        ("point", "cat (object): 1\nred (attribute): 0\nFinal Score: 3", 3.0),
        ("point", "Final Score: 2\n... on reflection, Final Score: 4.5", 4.5),
        ("point", "Final Score:5", 5.0),
        ("point", "Final Score: 0", None),
        ("point", "Final Score: 7", None),
        ("point", "I would rate it 4 out of 5.", None),
        ("flow_grpo", "Final Score: 1.0", 1.0),
        ("flow_grpo", "Final Score: 2\n... on reflection, Final Score: 4.5", 2.0),  # the first, as Flow-GRPO
        ("flow_grpo", "Final Score: 0", None),
        ("acs", "Alignment Score (1-5): 2.5\nCoherence Score (1-5): 4\nStyle Score (1-5): 3", 9.5 / 3),
        ("acs", "Alignment Score (1-5): 2\nStyle Score (1-5): 3", None),
        ("acs", "Final Score: 4", None),
    ],
)
def test_ratings_are_read_from_the_answer_or_are_parse_errors(task: str, text: str, score: float | None) -> None:
    outcome = read_rating(text, task)
    if score is None:
        assert outcome.error == ErrorCode.PARSE and outcome.score is None and outcome.details["answer"] == text
    else:
        assert outcome.ok and outcome.score == pytest.approx(score)
    if task == "acs" and score is not None:
        assert (outcome.details["alignment"], outcome.details["coherence"], outcome.details["style"]) == (2.5, 4, 3)


def test_prompts_put_the_caption_in_brackets_and_ask_for_their_format() -> None:
    for task, template in PROMPTS.items():
        question = template.format(prompt="a {curly} cat")
        assert question.endswith("Your task is provided as follows:\nText Caption: [a {curly} cat]"), task
    assert "'element (type): value'" in PROMPTS["point"] and "after 'Final Score:'" in PROMPTS["point"]
    assert "Coherence Score (1-5): Y" in PROMPTS["acs"] and "<image>" not in PROMPTS["point"] + PROMPTS["acs"]


def test_load_needs_a_model_dir_and_checks_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model-dir"):
        SCORERS["unifiedreward"]().load()
    with pytest.raises(ValueError, match="unknown unifiedreward task"):
        UnifiedRewardScorer(model_dir=tmp_path, task="vibes")
    (tmp_path / "unifiedreward.json").write_text(json.dumps({"task": "vibes"}))
    with pytest.raises(ValueError, match="unknown unifiedreward task"):
        SCORERS["unifiedreward"](model_dir=tmp_path).load()
    (tmp_path / "unifiedreward.json").write_text(json.dumps({"readout": "probs"}))
    with pytest.raises(ValueError, match="unknown keys"):
        SCORERS["unifiedreward"](model_dir=tmp_path).load()
    with pytest.raises(FileNotFoundError, match="unifiedreward_api.json"):
        SCORERS["unifiedreward_api"](model_dir=tmp_path).load()
