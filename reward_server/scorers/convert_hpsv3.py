"""Convert the released HPSv3 checkpoint (``HPSv3.safetensors``: the whole reward model's state dict under
transformers 4.45's Qwen2-VL names, ``model.*`` / ``visual.*`` / ``lm_head.*``, plus ``rm_head.*``) into the layout
:mod:`reward_server.scorers.hpsv3` loads.

``python -m reward_server.scorers.convert_hpsv3 --src HPSv3.safetensors --base <Qwen2-VL-7B-Instruct dir> --out
<model_dir>/hpsv3`` writes the backbone as a save_pretrained directory (the base's config with the checkpoint's
vocabulary size, tensors renamed to the installed transformers' names and checked one to one), the base's
tokenizer with HPSv3's added ``<|Reward|>`` token and its image processor, and ``reward_head.safetensors``. The
source is read with safetensors or ``torch.load(weights_only=True)`` only (a ``{"model": ...}`` wrapper is opened).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from reward_server.scorers.hpsv3 import HEAD_FILE, REWARD_TOKEN

LEGACY_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))
"""transformers 4.45 -> 5 Qwen2-VL names (tried in order when a name is not already a current one)."""


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` (.safetensors, or a torch file holding a state dict or ``{"model": state dict}``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict; pass the checkpoint file")
    return {key.removeprefix("module."): value for key, value in state.items() if isinstance(value, torch.Tensor)}


def rename_backbone(state: dict[str, torch.Tensor], expected: set[str]) -> dict[str, torch.Tensor]:
    """The backbone tensors under the names in ``expected``; ValueError naming what is missing or left over."""
    out, unknown = {}, []
    for key, value in state.items():
        candidates = [key] + [new + key[len(old) :] for old, new in LEGACY_PREFIXES if key.startswith(old)]
        name = next((c for c in candidates if c in expected), None)
        if name is None:
            unknown.append(key)
        else:
            out[name] = value
    missing = sorted(expected - set(out))
    if unknown or missing:
        raise ValueError(
            f"the checkpoint does not match the base model: unknown {unknown[:5]}, missing {missing[:5]} "
            "(is --base the Qwen2-VL HPSv3 was trained from?)"
        )
    return out


def convert(src: Path, base: Path, out: Path) -> Path:
    """Write the converted backbone, tokenizer, image processor and head from ``src`` (and ``base``) into ``out``."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    state = read_checkpoint(src)
    head = {key.removeprefix("rm_head."): value for key, value in state.items() if key.startswith("rm_head.")}
    backbone = {key: value for key, value in state.items() if not key.startswith("rm_head.")}
    embed = next(
        (
            backbone[k]
            for k in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
            if k in backbone
        ),
        None,
    )
    if not head or embed is None:
        raise ValueError(f"{src} is not an HPSv3 checkpoint: expected rm_head.* and model.embed_tokens.weight")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
    if len(tokenizer) != embed.shape[0]:
        raise ValueError(
            f"the checkpoint has {embed.shape[0]} token embeddings, the base tokenizer plus {REWARD_TOKEN} "
            f"{len(tokenizer)}: pass the Qwen2-VL HPSv3 was trained from as --base"
        )
    config = AutoConfig.from_pretrained(base)
    if config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"{base} holds a {config.model_type!r} model; expected qwen2_vl")
    config.get_text_config().vocab_size = embed.shape[0]
    with torch.device("meta"):
        expected = set(AutoModelForImageTextToText.from_config(config).state_dict())
    backbone = rename_backbone(backbone, expected)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(
        {k: v.contiguous() for k, v in backbone.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    save_file({k: v.float().contiguous() for k, v in head.items()}, str(out / HEAD_FILE))
    tokenizer.save_pretrained(out)
    processor = base / "preprocessor_config.json"
    (
        Qwen2VLImageProcessorPil.from_pretrained(base) if processor.is_file() else Qwen2VLImageProcessorPil()
    ).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="HPSv3.safetensors (or a .pth of the reward model)")
    parser.add_argument(
        "--base",
        type=Path,
        required=True,
        help="the Qwen2-VL-7B-Instruct directory (config, tokenizer, preprocessor_config.json)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. <model_dir>/hpsv3")
    args = parser.parse_args(argv)
    convert(args.src, args.base, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
