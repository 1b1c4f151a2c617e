"""``python -m trainer.export``: a checkpoint becomes a diffusers model that ``from_pretrained`` loads and that
computes what the trained denoiser computes (full fine-tuning, and LoRA merged into the base)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from tiny_models import tiny_config

from trainer.checkpoint import Checkpoints, Progress
from trainer.config import Config, to_dict
from trainer.distributed import SingleProcess
from trainer.export import export_denoiser, main
from trainer.models.flux import FluxAdapter
from trainer.models.latents import LatentStore, vae_fingerprint
from trainer.models.sd3 import SD3Adapter
from trainer.models.text import TextEmbeddingStore, text_fingerprint
from trainer.models.tiny import TinyConfig
from trainer.models.trainable import LoraSettings


def _forward(net: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return net(
            hidden_states=torch.randn(2, 1, 16, 16, generator=g),
            timestep=torch.tensor([300.0, 800.0]),
            encoder_hidden_states=torch.randn(2, 8, 64, generator=g),
            pooled_projections=torch.randn(2, 64, generator=g),
            return_dict=False,
        )[0]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_loads_back_with_diffusers_and_matches_the_trained_denoiser(tmp_path, tiny_model_dir, lora):
    model = TinyConfig(path=tiny_model_dir, lora=LoraSettings(rank=4, alpha=8) if lora else None)
    adapter = SD3Adapter(model)
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # stands for training: every trainable weight moves (LoRA B starts at zero)
        for p in adapter.trainable.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    base = _forward(SD3Transformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer"))
    trained = _forward(adapter.denoiser)
    assert (trained - base).abs().max() > 1e-3  # the export below must carry the training

    config = Config(model=model)
    Checkpoints(tmp_path / "checkpoints", keep=1, is_main=True).save(
        Progress(4, 2, True), adapter, backend, {}, to_dict(config)
    )
    checkpoint = next((tmp_path / "checkpoints").glob("step-*"))
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0

    exported = SD3Transformer2DModel.from_pretrained(tmp_path / "exported")
    assert not getattr(exported, "peft_config", None)  # LoRA merged: a plain diffusers model
    torch.testing.assert_close(_forward(exported), trained, atol=1e-5, rtol=1e-5)
    assert (tmp_path / "exported" / "lora").is_dir() == lora
    if lora:  # the adapter alone, on the base model
        with_adapter = SD3Transformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
        with_adapter.load_lora_adapter(
            str(tmp_path / "exported" / "lora"), weight_name="pytorch_lora_weights.safetensors", prefix=None
        )
        torch.testing.assert_close(_forward(with_adapter), trained, atol=1e-5, rtol=1e-5)


def test_an_export_is_whole_or_absent_and_replaces_the_previous_one(tmp_path, tiny_model_dir, capsys):
    """Written aside and renamed into place: an export cut short (here Ctrl-C as the weights are gathered) leaves
    no half model at ``out`` (it left a lone config.json there, which diffusers and generate then failed on)."""
    adapter = SD3Adapter(TinyConfig(path=tiny_model_dir))

    def interrupted(*_):
        raise KeyboardInterrupt

    hook = adapter.denoiser.register_state_dict_post_hook(interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_denoiser(adapter.denoiser, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing at out, no temporary folder left
    hook.remove()
    export_denoiser(adapter.denoiser, tmp_path / "final")
    with torch.no_grad():
        next(adapter.denoiser.parameters()).add_(1.0)
    export_denoiser(adapter.denoiser, tmp_path / "final")  # again: the new weights replace the old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    again = SD3Transformer2DModel.from_pretrained(tmp_path / "final")
    assert torch.equal(next(again.parameters()), next(adapter.denoiser.parameters()))
    # the command replaces an export, but not a folder of other files
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["--checkpoint", str(tmp_path / "any"), "--out", str(tmp_path / "mine")])
    assert "holds other files: give a new or empty folder" in capsys.readouterr().err


def test_cli_names_what_is_wrong(tmp_path, capsys):
    (tmp_path / "not-a-checkpoint").mkdir()
    assert main(["--checkpoint", str(tmp_path / "not-a-checkpoint"), "--out", str(tmp_path / "out")]) == 2
    assert "is not a complete checkpoint (no trainable.safetensors)" in capsys.readouterr().err
    a_file = tmp_path / "a-file"  # --out at a file, or under one: a traceback once the weights had loaded
    a_file.write_text("")
    for out, why in (
        (a_file, f"{a_file} is a file, not a folder"),
        (a_file / "x", f"{a_file} is a file, not a folder"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["--checkpoint", str(tmp_path / "not-a-checkpoint"), "--out", str(out)])
        assert exited.value.code == 2 and f"--out {out}: {why}" in capsys.readouterr().err


def test_export_needs_none_of_the_run_s_precomputed_stores(tmp_path, capsys):
    """A run that read its text embeddings and image latents from precomputed stores exports where neither
    exists: the weights do not depend on them."""
    model = tiny_config("flux_kontext", tmp_path / "models", dtype="float32")
    stores = {"text_embeddings": tmp_path / "text", "image_latents": tmp_path / "latents"}
    TextEmbeddingStore.create(str(stores["text_embeddings"]), text_fingerprint(model)).save()
    LatentStore.create(str(stores["image_latents"]), vae_fingerprint(model)).save()
    model = dataclasses.replace(model, **{k: str(v) for k, v in stores.items()})
    adapter = FluxAdapter(model)
    backend = SingleProcess(torch.device("cpu"))
    backend.prepare(adapter.denoiser, adapter.trainable.parameters(), lambda p: torch.optim.AdamW(p))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter.trainable.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    Checkpoints(tmp_path / "checkpoints", keep=1, is_main=True).save(
        Progress(4, 2, True), adapter, backend, {}, to_dict(Config(model=model))
    )
    for store in stores.values():
        shutil.rmtree(store)
    checkpoint = next((tmp_path / "checkpoints").glob("step-*"))
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0

    exported = FluxTransformer2DModel.from_pretrained(tmp_path / "exported").state_dict()
    trained = adapter.denoiser.state_dict()
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    # A wrong --model-path is named as such (it was blamed on the checkpoint's config).
    assert main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "again"), "--model-path", "/nowhere"]) == 2
    assert "error: --model-path /nowhere: no such base model directory" in capsys.readouterr().err
