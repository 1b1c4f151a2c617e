"""``videoalign`` on a tiny random VideoReward checkpoint in the authors' layout, converted by ``convert_videoalign``:
bad items fail alone with a 4xx-class error, bad settings and layouts fail at load or conversion with a message
naming the problem, and the choices that change the reward (positions, the latest checkpoint) are the authors'."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_videoalign import build_tiny_videoalign_reference

from reward_server.scorers import SCORERS, run_scorer
from reward_server.scorers.base import ModelFilesMissing
from reward_server.scorers.convert_videoalign import checkpoint_dir, convert
from shared.protocol import ErrorCode

RNG = np.random.default_rng(1)
CLIP = RNG.integers(0, 256, (6, 36, 52, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model_dir with videoalign/, the reference VideoReward folder, its base directory)."""
    root = tmp_path_factory.mktemp("videoalign")
    src, base = build_tiny_videoalign_reference(root / "reference")
    convert(src, base, root / "models" / "videoalign")
    return root / "models", src, base


@pytest.fixture(scope="module")
def scorer(converted):
    loaded = SCORERS["videoalign"](model_dir=converted[0])
    loaded.load()
    return loaded


def test_bad_items_fail_alone(scorer) -> None:
    items = [CLIP, CLIP, CLIP, CLIP[:1], CLIP[0]]
    prompts = ["a cat <|TA_reward|>", "a cat", "a cat", "a cat", "a cat"]
    metadata = [{"fps": 8.0}, {"fps": 8.0}, {}, {"fps": 8.0}, {}]
    outcomes = run_scorer(scorer, items, prompts, metadata)
    assert [o.error for o in outcomes] == [ErrorCode.BAD_INPUT, None, *[ErrorCode.BAD_INPUT] * 3]
    assert "VideoReward token" in outcomes[0].message and "no fps" in outcomes[2].message
    assert "at least 2" in outcomes[3].message and "is an image" in outcomes[4].message
    good = outcomes[1]
    assert good.details["frames"] == [0, 2, 3, 5]  # 0.75 s at 2 fps is 1.5 frames: raised to the least, 4
    assert good.details["Overall"] == pytest.approx(sum(good.details[k] for k in ("VQ", "MQ", "TA")))
    assert scorer.version.startswith("videoalign+qwen2_vl+") and scorer.score_range == (None, None)


def test_settings_from_the_options_file(converted, scorer, tmp_path: Path) -> None:
    model_dir = tmp_path / "models"
    shutil.copytree(converted[0] / "videoalign", model_dir / "videoalign")
    (model_dir / "videoalign.json").write_text('{"num_frames": 6, "score": "TA"}')
    fixed = SCORERS["videoalign"](model_dir=model_dir)
    fixed.load()
    (outcome,) = run_scorer(fixed, [CLIP], ["a cat"], [{}])  # a fixed frame count needs no fps
    assert outcome.details["frames"] == list(range(6)) and outcome.score == outcome.details["TA"]
    (default,) = run_scorer(scorer, [CLIP], ["a cat"], [{"fps": 8.0}])
    assert abs(default.details["TA"] - outcome.details["TA"]) > 1e-6  # 6 frames, not 4
    for options, match in [
        ({"colour": 1}, "unknown keys"),
        ({"score": "overall"}, "one of"),
        ({"fps": 1.0, "num_frames": 4}, "same time"),
    ]:
        (model_dir / "videoalign.json").write_text(json.dumps(options))
        with pytest.raises(ValueError, match=match):
            SCORERS["videoalign"](model_dir=model_dir).load()
    (model_dir / "videoalign.json").unlink()
    config = json.loads((model_dir / "videoalign" / "model_config.json").read_text())
    config["data_config"]["sample_type"] = "multi_pts"
    (model_dir / "videoalign" / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only 'uniform'"):
        SCORERS["videoalign"](model_dir=model_dir).load()


def test_missing_files_are_named() -> None:
    with pytest.raises(ModelFilesMissing, match="--model-dir"):
        SCORERS["videoalign"]().load()


def test_missing_layout_and_wrong_checkpoints(converted, tmp_path: Path) -> None:
    _, src, base = converted
    with pytest.raises(FileNotFoundError, match="reward_head.safetensors"):
        SCORERS["videoalign"](model_dir=tmp_path).load()
    assert checkpoint_dir(src, None).name == "checkpoint-12"  # the latest step, as the authors' loader
    with pytest.raises(FileNotFoundError, match=r"found steps \[3, 12\]"):
        convert(src, base, tmp_path / "out", step=7)
    with pytest.raises(FileNotFoundError, match="model_config.json"):
        convert(base, base, tmp_path / "out")
    wrong = tmp_path / "wrong"
    shutil.copytree(src, wrong)
    non_lora = torch.load(wrong / "checkpoint-12" / "non_lora_state_dict.pth", weights_only=True)
    non_lora["base_model.model.rm_head.weight"] = non_lora["base_model.model.rm_head.weight"][:1]
    torch.save(non_lora, wrong / "checkpoint-12" / "non_lora_state_dict.pth")
    with pytest.raises(ValueError, match="not a VideoReward"):
        convert(wrong, base, tmp_path / "out")


def test_sequential_positions_are_what_the_heads_were_trained_on(scorer) -> None:
    """Qwen2-VL's own 3-D M-RoPE positions (what the model's forward would use) give other rewards."""
    patches, grid, _ = scorer.prepare(CLIP, 8.0)
    sequential = scorer.forward([(patches, grid)], ["a cat"])
    inputs = scorer.encode([(patches, grid)], ["a cat"])
    video_token = scorer._judge.model.config.video_token_id
    with torch.no_grad():  # mm_token_type_ids 2 marks video tokens: Qwen2-VL then computes its M-RoPE positions
        hidden = scorer._judge.model.model(**inputs, mm_token_type_ids=(inputs["input_ids"] == video_token).int() * 2)
    mrope = scorer.heads(hidden.last_hidden_state, inputs["input_ids"])
    assert float((mrope - sequential).abs().max()) > 1e-3


def test_trained_embeddings_survive_tied_output_weights(converted, tmp_path: Path) -> None:
    """Qwen2-VL-2B ties lm_head to the token embeddings: loading the merged state must not put the base's lm_head
    (the same tensor) back over the trained rows."""
    from safetensors.torch import load_file, save_file

    _, src, base = converted
    tied = tmp_path / "tied-base"
    shutil.copytree(base, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(str(tied / "model.safetensors"))
    (embed,) = [key for key in weights if key.endswith("embed_tokens.weight")]  # transformers saves 4.x names
    weights["lm_head.weight"] = weights[embed].clone()
    save_file(weights, str(tied / "model.safetensors"))
    out = convert(src, tied, tmp_path / "videoalign")
    trained = torch.load(src / "checkpoint-12" / "non_lora_state_dict.pth", weights_only=True)
    saved = load_file(str(out / "model.safetensors"))
    torch.testing.assert_close(saved[embed], trained["base_model.model.model.embed_tokens.weight"])
