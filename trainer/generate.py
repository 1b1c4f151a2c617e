"""Sample a grid of images from a run's trained weights.

    python -m trainer.generate --weights outputs/RUN/final --out grid.png
    python -m trainer.generate --weights outputs/RUN/final --out grid.png \\
        --prompts "a handwritten digit 3" "a handwritten digit 8"
    python -m trainer.generate --weights outputs/RUN/final --out grid.png \\
        --prompts "a sign saying OPEN" --image shop.png --mask sign.png

``--weights`` is a run's ``final/`` (the denoiser as the final evaluation sampled it, in diffusers format,
LoRA merged, with the run's ``config.yaml`` one level up naming the base model) or ``best/`` (the best
evaluation's trained weights and EMA, in a checkpoint's layout; the EMA when the run evaluated with it). Without
``--prompts`` it samples the run's evaluation items with the evaluation's noise (the first 16, as its grids
show), so the grid of ``final/`` is the run's ``samples_after.png``.
One row per prompt.
Editing and inpainting models take the files every prompt is conditioned on (``--image``, ``--mask``, ``--reference``);
image-to-video models a first frame (``--image``) and optionally a last one (``--last-image``).
Runs in one process on the CPU (or ``--device cuda``); no reward servers.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: see trainer/main.py
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # before torch loads (seconds), so that a Ctrl-C then is one line too
    from shared.interrupt import run_module

    run_module("trainer.generate", "interrupted: no image written")

import torch

from trainer.models.base import ImageInputs


def load_trained(weights: Path, model_path: str | None = None, device: str = "cpu"):
    """(the run's config, its adapter with the denoiser of ``weights`` loaded) for a run's ``final/`` or
    ``best/`` directory."""
    import yaml

    from trainer.config import Config
    from trainer.config.building import build
    from trainer.export import _store_here
    from trainer.models import build_adapter
    from trainer.models.ip_adapter import IP_WEIGHTS

    if (weights / "trainable.safetensors").is_file():  # best/ (a checkpoint's layout): as the run evaluated it
        from trainer.export import load_checkpoint

        raw = yaml.safe_load((weights / "config.json").read_text())
        use_ema = raw.get("eval", {}).get("use_ema", True) and (weights / "ema.safetensors").is_file()
        return load_checkpoint(weights, model_path, ema=use_ema, device=device)
    config_file = weights.parent / "config.yaml"
    if not (weights / "config.json").is_file() or not config_file.is_file():
        raise ValueError(
            f"--weights {weights} is not a run's final/ or best/ directory (it needs the denoiser's "
            "config.json, and the run's config.yaml one level up): pass e.g. outputs/<run>/final"
        )
    config = build(Config, yaml.safe_load(config_file.read_text()), "")
    model = replace(
        config.model,
        lora=None,
        path=model_path or config.model.path,
        text_embeddings=_store_here(config.model.text_embeddings),
        image_latents=_store_here(config.model.image_latents),
    )
    if getattr(model, "ip_adapter", None) is not None and (weights / IP_WEIGHTS).is_file():
        model = replace(model, ip_adapter=replace(model.ip_adapter, weights=str(weights)))
    if not Path(model.path).exists():
        if model_path:
            raise ValueError(f"--model-path {model_path}: no such base model directory")
        raise ValueError(
            f"the run's base model {model.path!r} (model.path in {config_file}) is not here: pass --model-path"
        )
    adapter = build_adapter(model, torch.device(device))
    trained = type(adapter.denoiser).from_pretrained(str(weights), torch_dtype=adapter.denoiser.dtype)
    other = f"the denoiser in {weights} is another architecture than the base model {model.path}"
    try:
        missing, unexpected = adapter.denoiser.load_state_dict(trained.state_dict(), strict=False)
    except RuntimeError:  # same names, other shapes ("size mismatch for ...")
        raise ValueError(
            f"{other} (its tensors' shapes differ): pass the run's own base model as --model-path"
        ) from None
    if unexpected or (missing and getattr(model, "ip_adapter", None) is None):
        raise ValueError(f"{other}: pass the run's own base model as --model-path")
    adapter.denoiser.eval()
    return replace(config, model=model), adapter


def given_inputs(files: dict[str, Path | list[Path] | None], size: int) -> ImageInputs | None:
    """One item's image inputs from files (``image``, ``mask``, ``reference``: one or several, ``style``), read as
    the datasets read them at ``size`` pixels; None when no file is given."""
    from trainer.data.images import load_mask, load_references, load_rgb

    if not any(files.values()):
        return None
    load = {
        "image": lambda path: load_rgb(path, size, "--image"),
        "mask": lambda path: load_mask(path, size, "--mask"),
        "reference": lambda paths: load_references(paths[0] if len(paths) == 1 else tuple(paths), size, "--reference"),
        "style": lambda path: load_rgb(path, size, "--style"),
        "last_image": lambda path: load_rgb(path, size, "--last-image"),
    }
    return ImageInputs(**{name: load[name](value)[None] for name, value in files.items() if value})


@torch.no_grad()
def generate(
    weights: Path,
    prompts: list[str] | None,
    out: Path,
    samples: int | None = None,
    seed: int | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    model_path: str | None = None,
    device: str = "cpu",
    inputs: dict[str, Path | list[Path] | None] | None = None,
) -> Path:
    """Sample ``samples`` images per prompt (default: the run's evaluation settings) and save them as one grid row
    per prompt at ``out``; without ``prompts``, the run's evaluation items, each row led by its item's image
    inputs as the run's grids show them. ``inputs``: files (``given_inputs``) every prompt is conditioned on, for
    editing and inpainting models."""
    from trainer.data import build_tasks
    from trainer.evaluation import GRID_PROMPTS
    from trainer.logging import save_grid, with_inputs
    from trainer.rollout import SamplerSettings

    config, adapter = load_trained(weights, model_path, device)
    ev = config.eval
    samples, seed = samples or ev.samples_per_prompt, ev.seed if seed is None else seed
    settings = SamplerSettings(
        num_steps=steps or ev.num_steps,
        guidance_scale=ev.guidance_scale if guidance is None else guidance,
        noise_level=0.0,
    )
    given = given_inputs(inputs or {}, config.data.image_size)
    if given is not None and not prompts:
        raise ValueError(
            "--image, --mask, --reference, --style and --last-image need --prompts (without them each evaluation item "
            "brings its own inputs)"
        )
    task = None if prompts else build_tasks(config.data, config.eval)[1]
    rows = prompts or task.eval_prompts[:GRID_PROMPTS]

    images = [  # the noise of row k as the run's evaluation draws it for its prompt k
        _sample_row(
            adapter, prompt, samples, settings, (seed * 1_000_003 + k) % 2**63, _row_inputs(task, given, [k] * samples)
        )
        for k, prompt in enumerate(rows)
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    save_grid(
        with_inputs(torch.cat(images), len(rows), _row_inputs(task, given, list(range(len(rows))))), len(rows), out
    )
    return out


def _row_inputs(task: Any, given: ImageInputs | None, items: list[int]) -> ImageInputs | None:
    """The image inputs of grid rows ``items``: each row's own evaluation item, or the given files for each."""
    if task is not None:
        return task.inputs([task.eval_indices[k] for k in items])
    return given and ImageInputs(
        **{name: value.expand(len(items), *value.shape[1:]) for name, value in vars(given).items() if value is not None}
    )


def _sample_row(
    adapter: Any, prompt: str, samples: int, settings: Any, seed: int, inputs: ImageInputs | None
) -> torch.Tensor:
    """``samples`` images of ``prompt``, sampled from the noise of generator seed ``seed``."""
    from trainer.rollout import rollout

    generator = torch.Generator().manual_seed(seed)
    return rollout(
        adapter, adapter.denoiser, [prompt] * samples, torch.arange(samples), settings, generator, inputs
    ).images


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainer.generate``."""
    from trainer.tool import user_path

    parser = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, type=user_path, help="a run's final/ or best/ directory")
    parser.add_argument(
        "--prompts",
        nargs="+",
        metavar="PROMPT",
        help="one grid row each (default: the run's evaluation prompts, with the evaluation's noise)",
    )
    parser.add_argument("--out", required=True, type=user_path, help="the PNG to write")
    parser.add_argument(
        "--samples", type=_positive, help="images per prompt (default: the run's eval.samples_per_prompt)"
    )
    parser.add_argument("--seed", type=int, help="noise seed (default: the run's eval.seed)")
    parser.add_argument("--steps", type=_positive, help="sampling steps (default: the run's eval.num_steps)")
    parser.add_argument("--guidance", type=float, help="CFG scale (default: the run's eval.guidance_scale)")
    parser.add_argument(
        "--image",
        type=user_path,
        help="the image to inpaint or edit, or a video's first frame, for every prompt (with --prompts)",
    )
    parser.add_argument("--mask", type=user_path, help="the inpainting mask (white: repaint), for every prompt")
    parser.add_argument(
        "--reference",
        type=user_path,
        nargs="+",
        metavar="IMAGE",
        help="the reference image(s) an editing model edits, for every prompt",
    )
    parser.add_argument("--style", type=user_path, help="the IP-Adapter's image prompt, for every prompt")
    parser.add_argument(
        "--last-image",
        type=user_path,
        help="the frame an image-to-video model ends on (--image: the first), for every prompt",
    )
    parser.add_argument(
        "--model-path",
        type=lambda text: str(user_path(text)),
        help="the base model directory, when not where the run's config says",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    return parser


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any model loads, an output no image can be written to, a guidance that is not finite and a
    CUDA device this torch cannot see (``parser.error``: one line and status 2)."""
    from PIL import Image

    from trainer.tool import cannot_write

    if args.out.suffix.lower() not in Image.registered_extensions():
        parser.error(f"--out {args.out}: {args.out.suffix or 'no extension'} is not an image format; use .png")
    if (why := cannot_write(args.out, folder=False)) is not None:
        parser.error(f"--out {args.out}: {why}")
    if args.guidance is not None and not math.isfinite(args.guidance):
        parser.error(f"--guidance {args.guidance}: a guidance scale must be a finite number")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; use --device cpu")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    from trainer.config import user_error_exit
    from trainer.quiet import quiet_third_party

    quiet_third_party()
    try:
        generate(
            args.weights,
            args.prompts,
            args.out,
            args.samples,
            args.seed,
            args.steps,
            args.guidance,
            args.model_path,
            args.device,
            {
                "image": args.image,
                "mask": args.mask,
                "reference": args.reference,
                "style": args.style,
                "last_image": args.last_image,
            },
        )
    except ValueError as exc:  # an adapter names its inputs as ImageInputs' fields: here they are options
        option = re.sub(r"ImageInputs\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(exc))
        return user_error_exit(ValueError(option) if args.prompts else exc)
    print(f"wrote {args.out}")
    return 0
