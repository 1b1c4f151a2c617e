"""Export trained weights as a diffusers model directory.

    python -m trainer.export --checkpoint outputs/RUN/checkpoints/step-000600-000030 --out exported/
    python -m trainer.export --checkpoint ... --out ... --model-path /weights/sd3   # the base moved
    python -m trainer.export --checkpoint ... --out ... --ema    # the EMA weights (what the run evaluated)
    python -m trainer.export --checkpoint outputs/RUN/best --ema --out exported/   # the best evaluation's

The checkpoint's config names the model; its base weights are loaded from ``model.path`` (or
``--model-path``), the checkpoint's trainable weights are loaded on top, LoRA is merged into the base, and
the denoiser is written with ``save_pretrained``: ``<Class>.from_pretrained(out)`` loads it. With LoRA the
adapter alone is also written under ``out/lora`` (diffusers' LoRA format: ``load_lora_adapter`` takes it).
An IP-Adapter is written apart, as ``out/ip_adapter.safetensors`` (``FluxPipeline.load_ip_adapter(out,
weight_name="ip_adapter.safetensors")`` reads it; see ``trainer.models.ip_adapter``), not into the denoiser,
whose diffusers class would drop its weights.
Runs in one CPU process; no GPU or torchrun needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: see trainer/main.py
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":  # before torch loads (seconds), so that a Ctrl-C then is one line too
    from shared.interrupt import run_module

    run_module("trainer.export", "interrupted: nothing exported (an earlier export at --out is as it was)")

import torch
from torch import nn


def export_denoiser(denoiser: nn.Module, out: Path) -> None:
    """Write ``denoiser`` (a plain, unsharded module, e.g. ``backend.main_copy``) to ``out`` as a diffusers
    model, LoRA merged, written aside and renamed into place (``out`` is never half there; a previous one is
    replaced); with LoRA, also the adapter alone under ``out/lora``; with an IP-Adapter, its weights as
    ``out/ip_adapter.safetensors``. Changes ``denoiser`` (the LoRA is fused into it, the IP-Adapter taken out)."""
    from safetensors.torch import save_file

    from trainer.checkpoint import swap_in, usual_mode
    from trainer.disk import diagnosed_writes
    from trainer.models.ip_adapter import IP_WEIGHTS, detach_ip_adapter

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".incomplete-{out.name}-", dir=out.parent))  # ``out`` is whole or absent
    try:
        with diagnosed_writes(out.parent):
            ip_weights = detach_ip_adapter(denoiser)
            if ip_weights is not None:
                save_file({k: v.cpu().contiguous() for k, v in ip_weights.items()}, tmp / IP_WEIGHTS)
            if getattr(denoiser, "peft_config", None):
                denoiser.save_lora_adapter(str(tmp / "lora"))
                denoiser.fuse_lora()
                denoiser.unload_lora()
            source = getattr(denoiser, "config", {}).get("_name_or_path")
            if source and Path(source).is_dir():  # as a resumed run names it (config.yaml: absolute paths)
                denoiser.register_to_config(_name_or_path=str(Path(source).absolute()))
            denoiser.save_pretrained(str(tmp))
            usual_mode(tmp)
            swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_checkpoint(checkpoint: Path, out: Path, model_path: str | None = None, ema: bool = False) -> Path:
    """Build the checkpoint's model on the CPU, load its trainable weights (``ema``: their EMA instead) and
    export the denoiser to ``out``."""
    _, adapter = load_checkpoint(checkpoint, model_path, ema)
    export_denoiser(adapter.denoiser, out)
    return out


def load_checkpoint(checkpoint: Path, model_path: str | None = None, ema: bool = False, device: str = "cpu"):
    """(the run's config, its adapter with the checkpoint's trainable weights, or their EMA if ``ema``) for a
    ``<run>/checkpoints/step-*`` or ``<run>/best`` directory. The weights do not depend on the run's precomputed
    stores (``model.text_embeddings``, ``model.image_latents``): one that is not here is left out (the text
    encoders then load from ``model.path``), one that is spares loading the text encoders."""
    from trainer.checkpoint import damaged, load_weights, whole_before
    from trainer.config import Config
    from trainer.config.building import build
    from trainer.distributed import SingleProcess
    from trainer.models import build_adapter

    if not (checkpoint / "trainable.safetensors").is_file():
        raise ValueError(
            f"{checkpoint} is not a complete checkpoint (no trainable.safetensors); pass a "
            "<run>/checkpoints/step-* directory or <run>/best"
        )
    read = ("config.json", "trainable.safetensors")
    if (why := damaged(checkpoint, only=read)) is not None:
        older = whole_before(checkpoint, read)
        raise ValueError(
            f"{checkpoint} cannot be loaded, {why}: "
            + (f"export the checkpoint before it, {older}" if older else "restore it from a copy")
        )
    raw = json.loads((checkpoint / "config.json").read_text())
    if model_path:
        raw.setdefault("model", {})["path"] = model_path
    config = build(Config, raw, "")
    model = replace(
        config.model,
        text_embeddings=_store_here(config.model.text_embeddings),
        image_latents=_store_here(config.model.image_latents),
    )
    if not Path(model.path).exists():
        if model_path:
            raise ValueError(f"--model-path {model_path}: no such base model directory")
        raise ValueError(
            f"the base model {model.path!r} named by the checkpoint's config does not exist here; pass --model-path"
        )
    adapter = build_adapter(model, torch.device(device))
    load_weights(checkpoint, adapter.denoiser, SingleProcess(torch.device(device)))
    if ema:
        load_ema(checkpoint, list(adapter.trainable.parameters()))
    adapter.denoiser.eval()
    return replace(config, model=model), adapter


def _store_here(directory: str) -> str:
    """A precomputed store's directory where its index is here, else "" (none)."""
    return directory if directory and (Path(directory) / "index.json").is_file() else ""


@torch.no_grad()
def load_ema(checkpoint: Path, trainable: list[nn.Parameter]) -> None:
    """Write the checkpoint's EMA of whole weights into ``trainable``, the adapter's trainable parameters in their
    order: kept once by runs whose weights are not sharded; checkpoints written before that kept it per rank,
    and rank 0's is whole there too (single process, DDP, ZeRO-2)."""
    from safetensors.torch import load_file

    from trainer.checkpoint import damaged

    path = checkpoint / "ema.safetensors"
    if not path.is_file():
        path = checkpoint / "rank-00000" / "ema.safetensors"
    if not path.is_file():
        raise ValueError(f"{checkpoint} holds no EMA: the run kept none (train.ema_decay=0)")
    if (why := damaged(checkpoint, only=(str(path.relative_to(checkpoint)),))) is not None:
        raise ValueError(
            f"{checkpoint}'s EMA cannot be loaded, {why}: export its trained weights (without --ema), "
            "or use another checkpoint of the run"
        )
    shadow = load_file(path)
    if len(shadow) != len(trainable):
        raise ValueError(
            f"{checkpoint}'s EMA has {len(shadow)} tensors where the model has {len(trainable)} trainable ones"
        )
    for i, param in enumerate(trainable):
        saved = shadow[f"{i:05d}"]
        if saved.shape != param.shape:
            raise ValueError(
                f"{checkpoint} holds only each rank's part of the EMA (a backend that shards the "
                "weights: fsdp2, zero3), which cannot be exported as a whole; export the trained "
                "weights (without --ema)"
            )
        param.copy_(saved)


def main(argv: list[str] | None = None) -> int:
    from trainer.tool import cannot_write, user_path

    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=user_path,
        help="a <run>/checkpoints/step-* directory, or <run>/best (the best evaluation's weights)",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=user_path,
        help="directory to write the diffusers model to (a previous export there is replaced)",
    )
    parser.add_argument(
        "--model-path",
        type=lambda text: str(user_path(text)),
        help="the base model directory, when not where the run's config says",
    )
    parser.add_argument(
        "--ema",
        action="store_true",
        help="export the EMA of the trainable weights (what the run evaluated with eval.use_ema)",
    )
    args = parser.parse_args(argv)
    if (why := cannot_write(args.out, folder=True)) is not None:
        parser.error(f"--out {args.out}: {why}")
    if args.out.is_dir() and any(args.out.iterdir()) and not (args.out / "config.json").is_file():
        parser.error(f"--out {args.out} holds other files: give a new or empty folder (an export there is replaced)")
    from trainer.quiet import quiet_third_party

    quiet_third_party()
    try:
        export_checkpoint(args.checkpoint, args.out, args.model_path, args.ema)
    except (ValueError, OSError) as exc:  # OSError: a folder the checks above cannot foresee (/proc, a full disk)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {args.out}")
    return 0
