"""bench/shapes.py: every registered adapter has benchmark sizes, and its 9 M, published and variant denoiser
configs build from its tiny denoiser's config (on the meta device: no weights drawn)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import diffusers
import pytest
import tiny_models
import torch

from trainer.models import MODELS

SPEC = importlib.util.spec_from_file_location("bench_shapes", Path(__file__).parents[2] / "bench" / "shapes.py")
shapes = sys.modules["bench_shapes"] = importlib.util.module_from_spec(SPEC)  # its dataclass looks itself up
SPEC.loader.exec_module(shapes)


def test_every_registered_model_has_bench_shapes():
    assert sorted(shapes.SHAPES) == sorted(MODELS)


def tiny_denoiser_config(name: str, folder: Path) -> dict:
    """The config of adapter ``name``'s tiny denoiser, its components built on the meta device where they allow
    it (Wan's UniPC scheduler computes its tables on the host: those build on the CPU, still tiny)."""
    spec = tiny_models.tiny(name)
    if spec.build is not None:
        return json.loads((spec.build(folder / name, 0) / "transformer" / "config.json").read_text())
    try:
        with torch.device("meta"):
            components = spec.components(folder)
    except NotImplementedError:
        components = spec.components(folder)
    denoiser = components.get("transformer") or components["unet"]
    return {"_class_name": type(denoiser).__name__, **denoiser.config}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bench_shapes_build_on_the_meta_device(name: str, tmp_path: Path):
    config = tiny_denoiser_config(name, tmp_path)
    cls = getattr(diffusers, config["_class_name"])
    shape = shapes.SHAPES[name]
    for size, overrides in {"9m": shape.denoiser_9m, "real": shape.denoiser_real, **shape.variants}.items():
        assert not set(overrides) - set(config), f"{name} {size}: not fields of {cls.__name__}"
        with torch.device("meta"):
            params = sum(p.numel() for p in cls.from_config({**config, **overrides}).parameters())
        if size == "9m":
            assert 8e6 <= params <= 13e6, f"{name} 9m: {params / 1e6:.2f} M parameters"
        else:
            assert params >= 0.8e9, f"{name} {size}: {params / 1e9:.2f} B parameters"
