"""``qwenvl`` and ``qwenvl_api`` on tiny random Qwen2-VL / Qwen2.5-VL models built from configs.

No weights exist here, so no score below says anything about images. What is tested is the real code
path (save_pretrained -> the scorer's loading, PIL preprocessing, the chat text, M-RoPE inputs, the
forward pass and generation), the readout math (on a model whose output head is rigged so that known
digits win) and the API backend against a real HTTP server on 127.0.0.1 that runs the same tiny model.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_server import ChatServer, serve_chat
from fixtures_models import build_tiny_qwen_vl, rig_digits
from PIL import Image

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.judge import JudgeAnswer, JudgeQuery, build_query, read_answer
from reward_server.scorers.qwenvl import LocalQwenVL, QwenVLScorer
from shared.protocol import ErrorCode

RNG = np.random.default_rng(0)
IMAGES = [
    RNG.integers(0, 256, (64, 48, 3), dtype=np.uint8),
    RNG.integers(0, 256, (40, 90, 3), dtype=np.uint8),
]


def _scorer(model_dir: Path, **options: Any) -> QwenVLScorer:
    scorer = QwenVLScorer(backend="local", model_dir=model_dir, **options)
    scorer.load()
    return scorer


@pytest.fixture(scope="module")
def rigged_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<model_dir>/qwenvl``: a tiny Qwen2.5-VL whose answer is "4" with probability ~1."""
    model_dir = tmp_path_factory.mktemp("rigged")
    rig_digits(build_tiny_qwen_vl(model_dir / "qwenvl"), {"4": 5.0})
    return model_dir


@pytest.fixture(scope="module")
def random_scorer(tiny_qwenvl_model_dir: Path) -> QwenVLScorer:
    return _scorer(tiny_qwenvl_model_dir, min_answer_mass=0.0)


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "qwen2_vl"])
def test_rigged_head_gives_the_expected_score(variant: str, tmp_path: Path) -> None:
    rig_digits(build_tiny_qwen_vl(tmp_path / "qwenvl", variant=variant), {"4": 5.0})
    scorer = SCORERS["qwenvl"](model_dir=tmp_path)
    scorer.load()
    outcomes = run_scorer(scorer, IMAGES, ["a red apple", "a cat"], [{}, {"judge_task": "aesthetics"}])
    for outcome in outcomes:
        assert outcome.ok, outcome.message
        assert outcome.score == pytest.approx(0.75, abs=1e-4)  # rating 4 on 1..5
        assert outcome.details["probs"]["4"] == pytest.approx(1.0, abs=1e-4)
        assert outcome.details["answer_mass"] > 0.99
    assert [o.details["task"] for o in outcomes] == ["alignment", "aesthetics"]
    assert scorer.version.startswith(f"{variant}+") and scorer.version.endswith("+probs")


def test_tied_digits_average_their_ratings(tmp_path: Path) -> None:
    """Equal logits for "2" and "5" (and none elsewhere worth counting): rating 3.5, score 0.625."""
    rig_digits(build_tiny_qwen_vl(tmp_path / "qwenvl"), {"2": 5.0, "5": 5.0})
    (outcome,) = _scorer(tmp_path).score(IMAGES[:1], ["a dog"], [{}])
    assert outcome.details["probs"]["2"] == pytest.approx(0.5, abs=1e-4)
    assert outcome.score == pytest.approx((3.5 - 1) / 4, abs=1e-4)


def test_probs_readout_is_the_expected_digit_under_the_model(random_scorer: QwenVLScorer) -> None:
    """On the untouched random model: recompute the first-token distribution with a plain forward pass."""
    backend = random_scorer._backend
    assert isinstance(backend, LocalQwenVL)
    query = build_query("alignment", IMAGES[1], "a cat", {}, "probs")
    assert isinstance(query, JudgeQuery)
    with torch.no_grad():
        logits = backend.model(**backend.encode([query])).logits[0, -1].double()
    digit_probs = torch.softmax(logits, dim=-1)[backend.digit_token_ids]
    expected = float((digit_probs / digit_probs.sum() * torch.arange(1, 6)).sum())
    (outcome,) = random_scorer.score([IMAGES[1]], ["a cat"], [{}])
    assert outcome.score == pytest.approx((expected - 1) / 4, abs=1e-5)
    assert outcome.details["answer_mass"] == pytest.approx(float(digit_probs.sum()), rel=1e-4)


def test_batches_with_left_padding_match_single_items(random_scorer: QwenVLScorer) -> None:
    prompts = ["a small red apple on a table", "cat"]
    batch = random_scorer.score(IMAGES, prompts, [{}, {}])
    for image, prompt, together in zip(IMAGES, prompts, batch, strict=True):
        (alone,) = random_scorer.score([image], [prompt], [{}])
        assert together.score == pytest.approx(alone.score, abs=1e-4)


def test_random_model_answers_are_parse_errors_not_zeros(tiny_qwenvl_model_dir: Path) -> None:
    """A random model puts ~5/263 of its mass on the digits, and generates no <Score> tag."""
    probs = run_scorer(_scorer(tiny_qwenvl_model_dir), IMAGES, ["a", "b"], [{}, {}])
    generated = run_scorer(
        _scorer(tiny_qwenvl_model_dir, readout="generate", max_new_tokens=16), IMAGES[:1], ["a"], [{}]
    )
    for outcome in probs + generated:
        assert outcome.error == ErrorCode.PARSE and outcome.score is None
    assert probs[0].details["answer_mass"] < 0.5
    assert "<Score>" in generated[0].message and isinstance(generated[0].details["answer"], str)


def test_task_inputs_and_their_failures(rigged_dir: Path) -> None:
    scorer = _scorer(rigged_dir)
    reference = Image.fromarray(IMAGES[1])
    buffer = io.BytesIO()
    reference.save(buffer, format="PNG")
    wire = {"format": "png", "data": base64.b64encode(buffer.getvalue()).decode()}
    gray = IMAGES[0][:, :, :1]
    items = [
        ('a sign "OPEN"', {"judge_task": "text"}, None),
        ("a sign", {"judge_task": "text", "text": "OPEN"}, None),
        ("a sign", {"judge_task": "text"}, ErrorCode.PARSE),
        ("make it blue", {"judge_task": "edit", "reference_image": wire}, None),
        ("make it blue", {"judge_task": "edit", "reference_image": IMAGES[1]}, None),
        ("make it blue", {"judge_task": "edit"}, ErrorCode.PARSE),
        (
            "make it blue",
            {"judge_task": "edit", "reference_image": {"format": "png", "data": "xx"}},
            ErrorCode.DECODE,
        ),
        ("a cat", {"judge_task": "poetry"}, ErrorCode.BAD_INPUT),
    ]
    outcomes = run_scorer(scorer, [gray] * len(items), [p for p, _, _ in items], [m for _, m, _ in items])
    assert [o.error for o in outcomes] == [code for _, _, code in items]
    assert all(o.score == pytest.approx(0.75, abs=1e-4) for o in outcomes if o.ok)


def test_build_query_shows_the_reference_first() -> None:
    query = build_query("edit", IMAGES[0], "make it blue", {"reference_image": IMAGES[1]}, "generate")
    assert isinstance(query, JudgeQuery)
    assert [image.shape for image in query.images] == [IMAGES[1].shape, IMAGES[0].shape]
    assert '"make it blue"' in query.question and query.question.endswith("<Score>x</Score> with x from 1 to 5.")


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The image is sharp. <Score>4</Score>", 0.75),
        ("<score> 2.5 </score>", 0.375),
        ("First <Score>1</Score>, on reflection <Score>5</Score>", 1.0),
        ("<Score>0</Score>", None),
        ("<Score>7</Score>", None),
        ("I would say 4", None),
        ("", None),
    ],
)
def test_score_tag_parsing(text: str, score: float | None) -> None:
    outcome = read_answer(JudgeAnswer(text, None), "generate", 0.5)
    assert outcome.score == (None if score is None else pytest.approx(score))
    assert outcome.ok == (score is not None)


def test_probs_readout_math_and_text_fallback() -> None:
    logprobs = {1: np.log(0.1), 2: np.log(0.1), 3: np.log(0.2), 4: np.log(0.4), 5: np.log(0.0 + 1e-300)}
    outcome = read_answer(JudgeAnswer("4", logprobs), "probs", 0.5)
    rating = (0.1 * 1 + 0.1 * 2 + 0.2 * 3 + 0.4 * 4) / 0.8
    assert outcome.score == pytest.approx((rating - 1) / 4) and outcome.details["answer_mass"] == pytest.approx(0.8)
    assert read_answer(JudgeAnswer("4", {4: np.log(0.3)}), "probs", 0.5).error == ErrorCode.PARSE
    assert read_answer(JudgeAnswer(" 2\n", None), "probs", 0.5).score == pytest.approx(0.25)
    assert read_answer(JudgeAnswer("two", None), "probs", 0.5).error == ErrorCode.PARSE


def test_load_needs_a_model_dir_and_checks_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--model-dir"):
        SCORERS["qwenvl"]().load()
    with pytest.raises(FileNotFoundError, match="config.json"):
        SCORERS["qwenvl"](model_dir=tmp_path).load()
    with pytest.raises(FileNotFoundError, match="qwenvl_api.json"):
        SCORERS["qwenvl_api"](model_dir=tmp_path).load()
    (tmp_path / "qwenvl.json").write_text(json.dumps({"readout": "vibes"}))
    with pytest.raises(ValueError, match="unknown readout"):
        SCORERS["qwenvl"](model_dir=tmp_path).load()
    (tmp_path / "qwenvl.json").write_text(json.dumps({"base_url": "http://127.0.0.1:1/v1"}))
    with pytest.raises(ValueError, match="unknown keys"):
        SCORERS["qwenvl"](model_dir=tmp_path).load()
    with pytest.raises(ValueError, match="needs readout 'generate'"):
        QwenVLScorer(model_dir=tmp_path, task="flow_grpo")


def test_flow_grpo_task_per_item_needs_the_generate_readout(random_scorer: QwenVLScorer) -> None:
    """Flow-GRPO's question asks for an analysis first: under the probs readout the item is refused, the
    others of the batch are scored."""
    flow, plain = random_scorer.score(IMAGES, ["a cat"] * 2, [{"judge_task": "flow_grpo"}, {}])
    assert flow.error == ErrorCode.BAD_INPUT and "generate" in flow.message
    assert plain.ok and plain.details["task"] == "alignment"


# --- the OpenAI-compatible backend against a real local server running the tiny model -----------------


@pytest.fixture
def chat_server(rigged_dir: Path, request: pytest.FixtureRequest) -> Iterator[ChatServer]:
    judge = LocalQwenVL(rigged_dir / "qwenvl", max_new_tokens=16)
    with serve_chat(judge, **getattr(request, "param", {})) as server:
        yield server


def _api_scorer(server: ChatServer, tmp_path: Path, **options: Any) -> QwenVLScorer:
    host, port = server.server_address[:2]
    config = {"base_url": f"http://{host}:{port}/v1", "model": "tiny-qwen", "timeout_s": 60, **options}
    (tmp_path / "qwenvl_api.json").write_text(json.dumps(config))
    scorer = SCORERS["qwenvl_api"](model_dir=tmp_path)
    scorer.load()
    return scorer


def test_api_backend_matches_the_local_backend(chat_server: ChatServer, rigged_dir: Path, tmp_path: Path) -> None:
    api = _api_scorer(chat_server, tmp_path, task="aesthetics")
    local = _scorer(rigged_dir, task="aesthetics")
    metadata = [{}, {"judge_task": "edit", "reference_image": IMAGES[0]}]
    remote_outcomes = api.score(IMAGES, ["a cat", "make it blue"], metadata)
    local_outcomes = local.score(IMAGES, ["a cat", "make it blue"], metadata)
    for remote, here in zip(remote_outcomes, local_outcomes, strict=True):
        assert remote.ok, remote.message
        assert remote.score == pytest.approx(here.score, abs=1e-4) == pytest.approx(0.75, abs=1e-4)
    assert api.version == "api:tiny-qwen+/models/tiny-qwen+probs"
    sent = chat_server.requests[-1]
    assert sent["logprobs"] is True and sent["top_logprobs"] == 20 and sent["max_tokens"] == 1
    assert sum(part["type"] == "image_url" for part in sent["messages"][1]["content"]) in (1, 2)


@pytest.mark.parametrize("chat_server", [{"logprobs": False}], indirect=True)
def test_api_backend_reads_the_digit_when_the_server_gives_no_logprobs(chat_server: ChatServer, tmp_path: Path) -> None:
    (outcome,) = _api_scorer(chat_server, tmp_path).score(IMAGES[:1], ["a cat"], [{}])
    assert outcome.score == pytest.approx(0.75) and outcome.details["readout"] == "text"


@pytest.mark.parametrize("chat_server", [{"fail_on": "broken"}], indirect=True)
def test_api_backend_failures_are_per_item(chat_server: ChatServer, tmp_path: Path) -> None:
    scorer = _api_scorer(chat_server, tmp_path)
    outcomes = run_scorer(scorer, IMAGES, ["a cat", "a broken cat"], [{}, {}])
    assert outcomes[0].ok and outcomes[0].score == pytest.approx(0.75, abs=1e-4)
    assert outcomes[1].error == ErrorCode.INTERNAL and "500" in outcomes[1].message
    generated = _api_scorer(chat_server, tmp_path, readout="generate", max_new_tokens=16).score(
        IMAGES[:1], ["a cat"], [{}]
    )
    assert generated[0].error == ErrorCode.PARSE  # the rigged model answers "4444...", no <Score> tag


def test_api_backend_refuses_a_model_the_server_does_not_serve(chat_server: ChatServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not 'other-model'"):
        _api_scorer(chat_server, tmp_path, model="other-model")
