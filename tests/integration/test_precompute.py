"""Precomputed text embeddings (``python -m trainer.precompute`` -> ``model.text_embeddings``) on every
adapter's tiny model: the adapter then loads no text encoder or tokenizer, and its conditioning (and CFG
prediction, which reads the negative prompt from the store) is bit-identical to the adapter that encodes;
a prompt missing from the store and a store of other text encoders or settings raise errors naming the
precompute command. The CLI runs on a YAML config with a prompt-file dataset (first as its own process: it prints
no third-party notices)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as testing
import torch
import yaml
from tiny_models import TINY_NAMES, tiny_config, write_text_store

from trainer import precompute
from trainer.algorithms import build_algorithm
from trainer.algorithms.sft import SFT
from trainer.config import Config, DataConfig, TrainConfig, load_config, to_dict
from trainer.data import DigitsTask
from trainer.distributed import SingleProcess
from trainer.logging import RunLogger
from trainer.models import MODELS, ModelSpec, build_adapter
from trainer.models.text import TEXT_INDEX, TextEmbeddingStore, text_fingerprint
from trainer.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a photo of a cat", "the digit five"]
GUIDANCE = 3.0


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("precompute")


def assert_same_conditioning(encoding, reading, prompts) -> None:
    inputs = testing.image_inputs(encoding, len(prompts))
    a, b = encoding.encode_prompts(prompts, inputs), reading.encode_prompts(prompts, inputs)
    assert a.embeds.keys() == b.embeds.keys()
    assert all(torch.equal(a.embeds[k], b.embeds[k]) for k in a.embeds)
    x = encoding.prepare_latents(len(prompts), torch.Generator().manual_seed(0))
    sigma = encoding.sigmas(3)[1].expand(len(prompts))
    with torch.no_grad():
        assert torch.equal(
            encoding.predict(encoding.denoiser, x, sigma, a, GUIDANCE),
            reading.predict(reading.denoiser, x, sigma, b, GUIDANCE),
        )


@pytest.mark.parametrize("name", [name for name in TINY_NAMES if testing.tiny(name).text_store])
def test_precomputed_embeddings_replace_the_text_encoders(name, root, tmp_path):
    config = tiny_config(name, root, dtype="float32")
    write_text_store(config, tmp_path, [*PROMPTS, "", config.negative_prompt])
    reading = build_adapter(dataclasses.replace(config, text_embeddings=str(tmp_path)), "cpu")
    pipeline = reading.pipeline  # None where the pipeline cannot be built without them (Qwen-Image 2.1)
    assert pipeline is None or all(getattr(pipeline, sub) is None for sub in type(reading).text_components)
    assert_same_conditioning(build_adapter(config, "cpu"), reading, PROMPTS)
    with pytest.raises(ValueError, match=r"'a red sign' is not in model\.text_embeddings.*trainer\.precompute"):
        reading.encode_prompts(["a red sign"], testing.image_inputs(reading, 1))


def test_a_store_of_other_text_encoders_or_settings_is_refused(root, tmp_path):
    flux = tiny_config("flux", root, dtype="float32")
    write_text_store(flux, tmp_path, PROMPTS)
    for other in (
        dataclasses.replace(flux, max_sequence_length=8),
        dataclasses.replace(flux, dtype="bfloat16"),
        tiny_config("flux_fill", root, dtype="float32"),
        tiny_config("sd3", root, dtype="float32"),
    ):
        with pytest.raises(ValueError, match=r"computed for other text encoders.*trainer\.precompute"):
            build_adapter(dataclasses.replace(other, text_embeddings=str(tmp_path)), "cpu")
    with pytest.raises(ValueError, match="holds embeddings of other text encoders"):
        write_text_store(tiny_config("sd3", root, dtype="float32"), tmp_path, PROMPTS)
    with pytest.raises(ValueError, match="no such folder; write the store there with"):  # was "holds no index"
        build_adapter(dataclasses.replace(flux, text_embeddings=str(tmp_path / "empty")), "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"holds no {TEXT_INDEX}"):
        build_adapter(dataclasses.replace(flux, text_embeddings=str(tmp_path / "empty")), "cpu")


def test_precompute_cli_encodes_the_configured_dataset(root, tmp_path, capsys):
    config = tiny_config("qwen_image", root, dtype="float32")
    prompts = ["a photo of a red cat", 'a sign that says "hello"', "the digit five"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "model": to_dict(config),
                "data": {"name": "prompt_file", "path": str(tmp_path / "prompts.txt")},
                "train": {"device": "cpu"},
            }
        )
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.precompute",
            "--config",
            str(tmp_path / "run.yaml"),
            "--out",
            str(tmp_path / "text"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "5 prompts of qwen_image" in run.stdout, run.stdout + run.stderr
    for notice in ("requires torchvision", "Loading weights", "%|"):  # transformers' notices and loading bars
        assert notice not in run.stdout + run.stderr, notice
    index = json.loads((tmp_path / "text" / TEXT_INDEX).read_text())
    assert sorted(index["prompts"]) == sorted([*prompts, "", " "])
    reading = build_adapter(dataclasses.replace(config, text_embeddings=str(tmp_path / "text")), "cpu")
    assert reading.pipeline.text_encoder is None and reading.pipeline.tokenizer is None
    assert_same_conditioning(build_adapter(config, "cpu"), reading, prompts)

    (tmp_path / "test.txt").write_text("a test prompt\nanother test prompt\n")  # the evaluation's own file
    assert (
        precompute.main(
            [
                "--config",
                str(tmp_path / "run.yaml"),
                "--out",
                str(tmp_path / "text"),
                f"eval.path={tmp_path / 'test.txt'}",
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "text" / TEXT_INDEX).read_text())
    assert sorted(index["prompts"]) == sorted([*prompts, "", " ", "a test prompt", "another test prompt"])

    assert (
        precompute.main(
            ["--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "text"), "model.max_sequence_length=8"]
        )
        == 2
    )
    assert "holds embeddings of other text encoders" in capsys.readouterr().err


def test_precompute_cli_names_a_wrong_directory(root, tmp_path, capsys):
    """``--out`` at a file, and a ``model.path`` without the model (SD3 without T5 reads the transformer's config
    for its zero T5 tokens): messages naming the argument, not a traceback from pathlib or the hub client."""
    config = tiny_config("sd3", root, dtype="float32")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"model": to_dict(config), "train": {"device": "cpu"}}))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        precompute.main(["--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "file")])
    assert f"--out {tmp_path / 'file'} is a file: give a directory" in capsys.readouterr().err
    missing = tmp_path / "no-model"
    assert (
        precompute.main(
            ["--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "text"), f"model.path={missing}"]
        )
        == 2
    )
    assert f"model.path={str(missing)!r} is not a diffusers SD3 directory" in capsys.readouterr().err


def test_a_store_missing_a_prompt_of_the_run_is_refused_as_the_trainer_is_built(root, tmp_path):
    """Every prompt the run encodes is looked up before training: the dataset's and evaluation's prompts, the
    empty prompt of the warm-up's CFG dropout and the negative prompt of CFG, each only where the run uses it."""
    model = tiny_config("tiny", root, text_embeddings=str(tmp_path))
    digits = DigitsTask(16).prompts
    write_text_store(dataclasses.replace(model, text_embeddings=""), tmp_path, digits[:7])

    def trainer(adapter, *overrides):
        config = load_config(
            overrides=[
                "train.device=cpu",
                "train.warmup_steps=0",
                "eval.guidance_scale=1",
                "algorithm.sampler.guidance_scale=1",
                *overrides,
            ]
        )
        return Trainer(
            dataclasses.replace(config, model=model),
            adapter,
            build_algorithm(config.algorithm),
            SFT(config.warmup),
            DigitsTask(16),
            None,
            SingleProcess(torch.device("cpu")),
            RunLogger(tmp_path / "run", False, False),
        )

    store = re.escape(str(tmp_path))
    with pytest.raises(
        ValueError,
        match=rf"model\.text_embeddings='{store}' lacks 3 of the prompts this run encodes "
        rf"\(e\.g\. '{digits[7]}', '{digits[8]}', '{digits[9]}'\): add them with "
        rf"python -m trainer\.precompute --config RUN\.yaml --out {store}, "
        r".*data\.name=digits",
    ):
        trainer(build_adapter(model, "cpu"))
    write_text_store(dataclasses.replace(model, text_embeddings=""), tmp_path, digits[7:])
    adapter = build_adapter(model, "cpu")
    for uses_the_empty_prompt in (
        ["eval.guidance_scale=4.5"],
        ["algorithm.sampler.guidance_scale=4.5"],
        ["train.warmup_steps=1", "warmup.cfg_dropout=0.1"],
    ):
        with pytest.raises(ValueError, match=r"lacks 1 of the prompts this run encodes \(e\.g\. ''\)"):
            trainer(adapter, *uses_the_empty_prompt)
    trainer(adapter, "train.warmup_steps=1", "warmup.cfg_dropout=0")


def test_an_interrupted_precompute_encodes_only_what_the_store_lacks(root, tmp_path, monkeypatch):
    """Stopped by an exception after 3 of 6 prompts, the store's index lists those 3 (written as the error
    unwinds); a kill at the same point leaves the index of the last periodic save (2 of them). Run again, each
    encodes only the prompts its index lacks, and ends equal to an uninterrupted run; a complete store loads no
    text encoder at all."""
    model = tiny_config("flux", root, dtype="float32")
    prompts = ["a photo of a cat", "the digit five", "a red sign", "a big dog", "small text"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    config = Config(
        model=model,
        data=DataConfig(name="prompt_file", path=str(tmp_path / "prompts.txt")),
        train=TrainConfig(device="cpu"),
    )
    monkeypatch.setattr(TextEmbeddingStore, "save_every", 2)
    real_encoder = MODELS[model.name].prompt_encoder
    encoded: list[str] = []
    loads: list[int] = []

    def counting_encoder(config, device, stop_after=None):
        loads.append(1)
        encode = real_encoder(config, device)

        def counted(prompt):
            if len(encoded) == stop_after:
                shutil.copytree(tmp_path / "out", tmp_path / "killed")  # what a kill would leave
                raise KeyboardInterrupt
            encoded.append(prompt)
            return encode(prompt)

        return counted

    def run(directory, stop_after=None):
        encoded.clear()
        loads.clear()
        monkeypatch.setattr(
            ModelSpec, "prompt_encoder", lambda spec, config, device: counting_encoder(config, device, stop_after)
        )
        return precompute.precompute(config, str(tmp_path / directory))

    with pytest.raises(KeyboardInterrupt):
        run("out", stop_after=3)
    everything = [*prompts, ""]
    held = {name: list(json.loads((tmp_path / name / TEXT_INDEX).read_text())["prompts"]) for name in ("out", "killed")}
    assert held == {"out": everything[:3], "killed": everything[:2]}
    for name in ("out", "killed"):
        assert run(name) == (6 - len(held[name]), len(held[name]))
        assert encoded == everything[len(held[name]) :]
    assert run("straight") == (6, 0)
    assert run("out") == (0, 6) and not loads
    stores = [
        TextEmbeddingStore.open(str(tmp_path / name), text_fingerprint(model)) for name in ("straight", "out", "killed")
    ]
    assert all(sorted(s.files) == sorted(everything) for s in stores)
    for prompt in everything:
        straight, *others = (s.load(prompt, torch.device("cpu")) for s in stores)
        assert all(o.keys() == straight.keys() and all(torch.equal(o[k], straight[k]) for k in o) for o in others)


def test_a_ctrl_c_that_the_text_encoder_swallowed_stops_precompute_before_the_next_prompt(root, tmp_path, monkeypatch):
    """Library code that caught a Ctrl-C (test_ctrl_c.py) does not let the tool encode on to the end: it
    stops before the next prompt, the store's index listing what was encoded."""
    import shared.interrupt

    model = tiny_config("flux", root, dtype="float32")
    (tmp_path / "prompts.txt").write_text("a photo of a cat\nthe digit five\na red sign\n")
    config = Config(
        model=model,
        data=DataConfig(name="prompt_file", path=str(tmp_path / "prompts.txt")),
        train=TrainConfig(device="cpu"),
    )
    real_encoder = MODELS[model.name].prompt_encoder

    def swallowing(spec, config, device):
        encode = real_encoder(config, device)

        def encoded(prompt):
            monkeypatch.setattr(shared.interrupt, "_asked", True)  # the Ctrl-C came in here, and was caught
            return encode(prompt)

        return encoded

    monkeypatch.setattr(ModelSpec, "prompt_encoder", swallowing)
    with pytest.raises(KeyboardInterrupt):
        precompute.precompute(config, str(tmp_path / "out"))
    assert list(json.loads((tmp_path / "out" / TEXT_INDEX).read_text())["prompts"]) == ["a photo of a cat"]
