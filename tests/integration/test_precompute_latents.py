"""Precomputed VAE latents (``python -m trainer.precompute --latents`` -> ``model.image_latents``) on the tiny
models of the adapters that VAE-encode image inputs (flux_fill and sd15_inpaint: the masked image;
flux_kontext: the reference). Encoding takes each distinct input once, in its own forward (a row's
conditioning is the same in any batch); conditioning read from a store is bit-identical to the adapter that
encodes, and the reading adapter calls its real VAE encoder (counted by a wrapper) for no stored input; an
input missing from the store is encoded, counted and warned about; a store of another VAE, dtype or
resolution is refused naming the precompute command. The CLI (its main(), in process) runs on a YAML config with an
inpainting dataset, and on an editing dataset that grows between two runs."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_models as testing
import torch
import yaml
from PIL import Image
from tiny_data import write_edit_jsonl, write_inpaint_jsonl, write_prompt_file
from tiny_models import tiny_config

from trainer import precompute
from trainer.config import DataConfig, to_dict
from trainer.data import build_task
from trainer.models import build_adapter, image_encoding_models
from trainer.models.base import Conditioning, ImageInputs
from trainer.models.latents import LATENT_INDEX, LatentStore, vae_fingerprint

IMAGE_CONDITIONED = tuple(image_encoding_models())
PROMPTS = ["a photo of a cat", "the digit five"] * 2
GROUPS = [0, 1, 0, 1]
"""Rows of the test batch: two items, each repeated as a rollout group repeats its item."""
SIZE = 16
"""Image side of the tiny models (model.resolution) and of the tiny datasets (data.image_size)."""


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("precompute_latents")


def count_vae_encodes(adapter) -> list[int]:
    """Batch sizes of the calls to ``adapter.vae.encode`` from now on (the real encoder still runs)."""
    calls: list[int] = []
    encode = adapter.vae.encode

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return encode(x, *args, **kwargs)

    adapter.vae.encode = counted
    return calls


def rows(inputs: ImageInputs, index: list[int]) -> ImageInputs:
    return ImageInputs(**{k: v[index] for k, v in vars(inputs).items() if v is not None})


def assert_same(a: Conditioning, b: Conditioning) -> None:
    assert a.embeds.keys() == b.embeds.keys()
    assert all(torch.equal(a.embeds[k], b.embeds[k]) for k in a.embeds)
    for name in ("image", "mask", "reference", "style"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        assert x is None or torch.equal(x, y), name


def write_config(path: Path, model, data: dict) -> Path:
    path.write_text(
        yaml.safe_dump({"model": to_dict(model), "data": {**data, "image_size": SIZE}, "train": {"device": "cpu"}})
    )
    return path


@pytest.mark.parametrize("name", IMAGE_CONDITIONED)
def test_stored_latents_equal_the_encoded_ones_and_spare_the_vae(name, root, tmp_path, caplog):
    config = tiny_config(name, root, dtype="float32")
    encoding = build_adapter(config, "cpu")
    inputs = rows(testing.image_inputs(encoding, 2, optional=True), GROUPS)
    # VAE inputs per item: the image (inpainting) and each reference (several: Qwen-Image-Edit-Plus)
    per_item = (inputs.image is not None) + (inputs.reference is not None) * testing.tiny(name).references
    encoded = count_vae_encodes(encoding)
    live = encoding.encode_prompts(PROMPTS, inputs)
    assert encoded == [1] * 2 * per_item
    assert_same(
        live,
        Conditioning.cat([encoding.encode_prompts(PROMPTS[i : i + 1], rows(inputs, [i])) for i in range(len(PROMPTS))]),
    )

    store = LatentStore.create(str(tmp_path), vae_fingerprint(config))
    written = precompute.write_latents(build_adapter(config, "cpu"), store, [(PROMPTS, inputs)])
    assert (written.misses, written.hits) == (2 * per_item, 0)
    assert len(json.loads((tmp_path / LATENT_INDEX).read_text())["keys"]) == 2 * per_item

    reading = build_adapter(dataclasses.replace(config, image_latents=str(tmp_path)), "cpu")
    calls = count_vae_encodes(reading)
    assert_same(live, reading.encode_prompts(PROMPTS, inputs))
    assert calls == [] and (reading.image_latents.hits, reading.image_latents.misses) == (2 * per_item, 0)

    new = testing.image_inputs(encoding, 1, seed=1, optional=True)
    with caplog.at_level(logging.WARNING, logger="rewardflow.latents"):
        assert_same(encoding.encode_prompts(PROMPTS[:1], new), reading.encode_prompts(PROMPTS[:1], new))
    assert calls == [1] * per_item and reading.image_latents.misses == per_item
    assert "not in model.image_latents" in caplog.text


def test_a_store_of_another_vae_or_settings_is_refused(root, tmp_path):
    fill = tiny_config("flux_fill", root, dtype="float32")
    LatentStore.create(str(tmp_path), vae_fingerprint(fill)).save()
    build_adapter(dataclasses.replace(fill, image_latents=str(tmp_path)), "cpu")
    sd15 = tiny_config("sd15_inpaint", root, dtype="float32")
    for other in (
        dataclasses.replace(fill, dtype="bfloat16"),
        dataclasses.replace(fill, resolution=2 * SIZE),
        tiny_config("flux_kontext", root, dtype="float32"),
        sd15,
    ):
        with pytest.raises(ValueError, match=r"computed for another VAE or settings.*trainer\.precompute .*--latents"):
            build_adapter(dataclasses.replace(other, image_latents=str(tmp_path)), "cpu")
    with pytest.raises(ValueError, match="holds latents of another VAE or settings"):
        LatentStore.create(str(tmp_path), vae_fingerprint(sd15))
    with pytest.raises(ValueError, match="empty': no such folder; write the store there with .*trainer\\.precompute"):
        build_adapter(dataclasses.replace(fill, image_latents=str(tmp_path / "empty")), "cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"holds no {LATENT_INDEX}.*trainer\\.precompute"):
        build_adapter(dataclasses.replace(fill, image_latents=str(tmp_path / "empty")), "cpu")


def test_precompute_cli_writes_the_latents_training_reads(root, tmp_path, capsys):
    config = tiny_config("flux_fill", root, dtype="float32")
    data = {"name": "inpaint_jsonl", "path": str(write_inpaint_jsonl(tmp_path / "data", size=SIZE))}
    run = write_config(tmp_path / "run.yaml", config, data)
    assert (
        precompute.main(["--config", str(run), "--out", str(tmp_path / "text"), "--latents", str(tmp_path / "latents")])
        == 0
    )
    out = capsys.readouterr().out
    assert "4 image inputs of flux_fill" in out and "(0 were there)" in out
    assert len(json.loads((tmp_path / "latents" / LATENT_INDEX).read_text())["keys"]) == 4

    task = build_task(DataConfig(image_size=SIZE, **data))
    items = [0, 0, 1, 1, 2, 2, 3, 3]
    prompts = [task.prompts[i] for i in items]
    reading = build_adapter(
        dataclasses.replace(config, text_embeddings=str(tmp_path / "text"), image_latents=str(tmp_path / "latents")),
        "cpu",
    )
    calls = count_vae_encodes(reading)
    assert_same(
        build_adapter(config, "cpu").encode_prompts(prompts, task.inputs(items)),
        reading.encode_prompts(prompts, task.inputs(items)),
    )
    assert calls == [] and reading.image_latents.hits == 4


def test_precompute_latents_of_a_growing_editing_dataset(root, tmp_path, capsys):
    config = tiny_config("flux_kontext", root, dtype="float32")
    data = {"name": "edit_jsonl", "path": str(write_edit_jsonl(tmp_path / "data", size=SIZE, count=2))}
    run = write_config(tmp_path / "run.yaml", config, data)
    latents = str(tmp_path / "latents")
    assert precompute.main(["--config", str(run), "--latents", latents]) == 0
    assert "2 image inputs of flux_kontext" in capsys.readouterr().out

    write_edit_jsonl(tmp_path / "data", size=SIZE, count=4)
    assert precompute.main(["--config", str(run), "--latents", latents]) == 0
    assert "2 image inputs of flux_kontext" in (out := capsys.readouterr().out) and "(2 were there)" in out

    task = build_task(DataConfig(image_size=SIZE, **data))
    reading = build_adapter(dataclasses.replace(config, image_latents=latents), "cpu")
    calls = count_vae_encodes(reading)
    reading.encode_prompts(task.prompts, task.inputs(list(range(4))))
    assert calls == [] and reading.image_latents.hits == 4

    evaluation = write_edit_jsonl(tmp_path / "test", size=SIZE, count=3)  # a test split of other images
    for i in range(3):
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(
            tmp_path / "test" / "images" / f"{i}_0.png"
        )
    assert precompute.main(["--config", str(run), "--latents", latents, f"eval.path={evaluation}"]) == 0
    assert "3 image inputs of flux_kontext" in capsys.readouterr().out
    test = build_task(DataConfig(image_size=SIZE, name="edit_jsonl", path=str(evaluation)))
    reading = build_adapter(dataclasses.replace(config, image_latents=latents), "cpu")  # reads the grown store
    calls = count_vae_encodes(reading)
    reading.encode_prompts(test.prompts, test.inputs(list(range(3))))
    assert calls == [] and reading.image_latents.hits == 3

    assert precompute.main(["--config", str(run), "--latents", latents, "model.dtype=bfloat16"]) == 2
    assert "holds latents of another VAE or settings" in capsys.readouterr().err


def test_precompute_latents_needs_an_image_conditioned_model(root, tmp_path, capsys):
    config = tiny_config("flux", root, dtype="float32")
    run = write_config(
        tmp_path / "run.yaml", config, {"name": "prompt_file", "path": str(write_prompt_file(tmp_path / "data"))}
    )
    assert precompute.main(["--config", str(run), "--latents", str(tmp_path / "latents")]) == 2
    assert "VAE-encodes none of the image inputs" in capsys.readouterr().err
    assert not (tmp_path / "latents").exists()  # refused before a store (or the model) was made
    with pytest.raises(SystemExit):
        precompute.main(["--config", str(run)])
    assert "--latents" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["sd3", "flux", "qwen_image"])
def test_adapters_that_encode_no_image_input_refuse_a_latent_store(name, root, tmp_path):
    with pytest.raises(ValueError, match=f"the {name} adapter VAE-encodes no image input"):
        build_adapter(dataclasses.replace(tiny_config(name, root, dtype="float32"), image_latents=str(tmp_path)), "cpu")


def test_an_interrupted_latent_precompute_keeps_what_it_encoded(root, tmp_path, monkeypatch):
    """Stopped by an exception at the 4th of 5 inputs, the store's index lists the 3 encoded (written as the error
    unwinds); a kill at the same point leaves the index of the last periodic save (2 of them). Run again, each
    encodes only the inputs its index lacks, and ends equal to an uninterrupted run."""
    config = tiny_config("flux_kontext", root, dtype="float32")
    adapter = build_adapter(config, "cpu")
    inputs = [testing.image_inputs(adapter, 1, seed=seed) for seed in range(5)]
    monkeypatch.setattr(LatentStore, "save_every", 2)

    def batches(stop_at=None):
        for i, item in enumerate(inputs):
            if i == stop_at:
                shutil.copytree(tmp_path / "out", tmp_path / "killed")  # what a kill would leave
                raise KeyboardInterrupt
            yield PROMPTS[:1], item

    def write(name, stop_at=None):
        return precompute.write_latents(
            adapter, LatentStore.create(str(tmp_path / name), vae_fingerprint(config)), batches(stop_at)
        )

    with pytest.raises(KeyboardInterrupt):
        write("out", stop_at=3)
    held = {name: len(json.loads((tmp_path / name / LATENT_INDEX).read_text())["keys"]) for name in ("out", "killed")}
    assert held == {"out": 3, "killed": 2}
    for name, count in held.items():
        again = write(name)
        assert (again.misses, again.hits) == (5 - count, count)
    assert write("straight").misses == 5
    stores = [LatentStore.open(str(tmp_path / name), vae_fingerprint(config)) for name in ("straight", "out", "killed")]
    assert len(stores[0].keys) == 5 and all(s.keys == stores[0].keys for s in stores)
    for key in stores[0].keys:
        straight = stores[0].load(key, torch.device("cpu"))
        assert all(torch.equal(s.load(key, torch.device("cpu")), straight) for s in stores[1:])
