"""python -m trainer.generate on an inpainting model with the user's own files: every prompt is conditioned on the
given image and mask, each grid row starts with them, and a missing or misplaced input is one line naming it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from tiny_models import tiny_config

from trainer.config import load_config, saved_dict
from trainer.export import export_denoiser
from trainer.generate import main
from trainer.logging import MASK_TINT
from trainer.models import build_adapter


def _run(tmp_path, name: str, data: str, model=None) -> tuple[str, int]:
    """A run folder as a job leaves it (final/ and config.yaml) for the tiny model of adapter ``name`` (or the
    config ``model``) trained on ``data``; its side."""
    model = model or tiny_config(name, tmp_path / "model", dtype="float32")
    adapter = build_adapter(model, "cpu")
    side = adapter.resolution
    config = replace(
        load_config(overrides=[f"model.name={name}", f"data.name={data}", f"data.image_size={side}"]), model=model
    )
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(saved_dict(config), sort_keys=False))
    export_denoiser(adapter.denoiser, tmp_path / "run" / "final")
    return str(tmp_path / "run" / "final"), side


def test_an_inpainting_model_fills_the_given_image_where_the_given_mask_says(tmp_path, capsys):
    weights, side = _run(tmp_path, "flux_fill", "inpaint_jsonl")
    ramp = np.linspace(0, 255, side, dtype=np.float64)
    source = np.stack([ramp[None, :].repeat(side, 0), ramp[:, None].repeat(side, 1), np.full((side, side), 60.0)], -1)
    Image.fromarray(source.round().astype(np.uint8)).save(tmp_path / "source.png")
    for name, rows in ("top", slice(0, side // 2)), ("bottom", slice(side // 2, side)):
        mask = np.zeros((side, side), dtype=np.uint8)
        mask[rows] = 255
        Image.fromarray(mask).save(tmp_path / f"{name}.png")
    common = [
        "--weights",
        weights,
        "--prompts",
        "a sign saying OPEN",
        "--samples",
        "2",
        "--steps",
        "2",
        "--image",
        str(tmp_path / "source.png"),
    ]
    grids = {}
    for name in ("top", "bottom"):
        out = tmp_path / f"grid-{name}.png"
        assert main([*common, "--mask", str(tmp_path / f"{name}.png"), "--out", str(out)]) == 0
        grids[name] = np.asarray(Image.open(out), dtype=np.float64) / 255
    scale = max(1, min(4, 128 // side))
    assert grids["top"].shape == ((side + 2) * scale, (3 * (side + 1) + 1) * scale, 3)  # the source, then 2 samples

    def cell(grid: np.ndarray, column: int) -> np.ndarray:
        left = (1 + column * (side + 1)) * scale
        return grid[scale : scale + side * scale : scale, left : left + side * scale : scale]

    # the first cell: the source with the repaint region tinted (the upper half for the "top" mask)
    tinted = source / 255
    tinted[: side // 2] = 0.5 * tinted[: side // 2] + 0.5 * np.array(MASK_TINT)
    assert np.abs(cell(grids["top"], 0) - tinted).max() <= 1 / 255
    # the mask reaches the model: another mask gives other images
    assert not np.array_equal(cell(grids["top"], 1), cell(grids["bottom"], 1))
    capsys.readouterr()
    # an inpainting model without its mask, and files without --prompts: one line each, exit status 2
    assert main([*common, "--out", str(tmp_path / "no-mask.png")]) == 2
    assert "error: the flux_fill adapter needs --mask" in capsys.readouterr().err
    assert main(["--weights", weights, "--image", str(tmp_path / "source.png"), "--out", str(tmp_path / "x.png")]) == 2
    assert "--image, --mask, --reference, --style and --last-image need --prompts" in capsys.readouterr().err


def test_an_editing_model_edits_the_given_references(tmp_path):
    """Qwen-Image-Edit-Plus with two references given: each row starts with both, and the samples depend on them."""
    weights, side = _run(tmp_path, "qwen_image_edit_plus", "edit_jsonl")
    rng = np.random.default_rng(0)
    for name in ("a", "b", "c"):
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(tmp_path / f"{name}.png")
    grids = {}
    for pair in ("ab", "ac"):
        out = tmp_path / f"grid-{pair}.png"
        assert (
            main(
                [
                    "--weights",
                    weights,
                    "--prompts",
                    "make it blue",
                    "--samples",
                    "1",
                    "--steps",
                    "2",
                    "--reference",
                    *(str(tmp_path / f"{name}.png") for name in pair),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        grids[pair] = np.asarray(Image.open(out))
    scale = max(1, min(4, 128 // side))
    assert grids["ab"].shape == ((side + 2) * scale, (3 * (side + 1) + 1) * scale, 3)  # 2 references, 1 sample
    first = grids["ab"][scale : scale + side * scale : scale, scale : scale + side * scale : scale]
    assert np.array_equal(first, np.asarray(Image.open(tmp_path / "a.png")))  # at the model's size: unchanged
    last = slice((1 + 2 * (side + 1)) * scale, (1 + 2 * (side + 1) + side) * scale, scale)
    assert not np.array_equal(grids["ab"][scale::scale][:side, last], grids["ac"][scale::scale][:side, last])


def test_bad_counts_an_unknown_image_suffix_or_a_missing_gpu_are_refused_before_the_model_loads(tmp_path, capsys):
    """--samples 0 and --steps 0 silently took the run's defaults, negative ones were tracebacks, a wrong suffix
    failed after sampling and --device cuda on a machine without CUDA was an AssertionError; a NaN guidance was
    taken, and an --out under a file was a traceback after sampling."""
    weights = ["--weights", str(tmp_path / "absent"), "--out"]
    cases = [
        ([*weights, "g.png", "--samples", "0"], "argument --samples: 0 is not a positive count"),
        ([*weights, "g.png", "--steps", "-3"], "argument --steps: -3 is not a positive count"),
        ([*weights, "g.jpgx"], "--out g.jpgx: .jpgx is not an image format; use .png"),
        ([*weights, "g.png", "--guidance", "nan"], "--guidance nan: a guidance scale must be a finite number"),
    ]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    (tmp_path / "d.png").mkdir()
    cases += [
        ([*weights, str(a_file / "g.png")], f"--out {a_file / 'g.png'}: {a_file} is a file, not a folder"),
        ([*weights, str(tmp_path / "d.png")], f"--out {tmp_path / 'd.png'}: {tmp_path / 'd.png'} is a folder"),
    ]
    if not torch.cuda.is_available():
        cases.append(([*weights, "g.png", "--device", "cuda"], "--device cuda: this torch"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_weights_of_another_shape_than_the_base_model_are_one_line(tmp_path, capsys):
    """A --model-path whose denoiser has other shapes (another size of the same model) was a RuntimeError
    traceback listing every size mismatch."""
    import json
    import shutil

    import diffusers

    final, _ = _run(tmp_path, "flux", "digits")
    base = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["path"]
    other = tmp_path / "wider"
    shutil.copytree(base, other)
    settings = json.loads((other / "transformer" / "config.json").read_text())
    denoiser = getattr(diffusers, settings["_class_name"])
    settings = {k: v for k, v in settings.items() if not k.startswith("_")}
    denoiser(**{**settings, "attention_head_dim": 2 * settings["attention_head_dim"]}).save_pretrained(
        other / "transformer"
    )
    assert main(["--weights", final, "--model-path", str(other), "--out", str(tmp_path / "g.png")]) == 2
    err = capsys.readouterr().err
    assert (
        f"error: the denoiser in {final} is another architecture than the base model {other} (its tensors' shapes "
        "differ): pass the run's own base model as --model-path"
        in err
        and "Traceback" not in err
    ), err


def test_an_image_to_video_model_takes_a_first_and_a_last_frame(tmp_path, capsys):
    """``--image`` and ``--last-image`` (Wan 2.1 FLF2V): the video's first and last frames, shown before its
    samples (each held over the video's frames); another last frame gives another video; a last frame alone is
    one line."""
    weights, side = _run(
        tmp_path, "wan_i2v", "inpaint_jsonl", tiny_config("wan_i2v+last", tmp_path / "model", dtype="float32")
    )
    for name, colour in (("first", (250, 20, 20)), ("last", (20, 20, 250)), ("other", (20, 250, 20))):
        Image.new("RGB", (side, side), colour).save(tmp_path / f"{name}.png")
    common = ["--weights", weights, "--prompts", "a ball", "--samples", "1", "--steps", "2"]
    frames = {}
    for last in ("last", "other"):
        out = tmp_path / f"{last}.gif"
        given = ["--image", str(tmp_path / "first.png"), "--last-image", str(tmp_path / f"{last}.png")]
        assert main([*common, *given, "--out", str(out)]) == 0
        with Image.open(out) as gif:
            frames[last] = np.asarray(gif.convert("RGB"), dtype=np.float64)
    width = frames["last"].shape[1]
    third = width // 3  # the first frame, the last frame, then the sample
    assert frames["last"][:, third : 2 * third, 2].max() > 200 and frames["other"][:, third : 2 * third, 1].max() > 200
    assert not np.array_equal(frames["last"][:, 2 * third :], frames["other"][:, 2 * third :])
    capsys.readouterr()
    assert main([*common, "--last-image", str(tmp_path / "last.png"), "--out", str(tmp_path / "x.gif")]) == 2
    assert "error: --last-image needs --image: a first-last-frame video" in capsys.readouterr().err
