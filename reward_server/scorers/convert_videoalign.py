"""Convert the released VideoReward checkpoint into the layout :mod:`reward_server.scorers.videoalign` loads.

The authors (KwaiVGI/VideoAlign ``train_reward.py``, ``trainer.py``, ``utils.load_model_from_checkpoint``) save a
LoRA run: ``<src>/model_config.json`` (data, model, LoRA and inference settings) and ``<src>/checkpoint-<step>/``
with ``adapter_model.safetensors`` (PEFT's LoRA A/B of the language model's linear layers) and
``non_lora_state_dict.pth`` (the trained tensors outside the LoRA: vision tower and merger, the token embeddings
with the three reward tokens, ``rm_head.weight``), all under ``base_model.model.`` and transformers 4.45's
Qwen2-VL names. They rebuild Qwen2-VL from ``model_name_or_path`` (Qwen2-VL-2B-Instruct), add the reward tokens to
its tokenizer, resize the embeddings to it and load both files over it.

``python -m reward_server.scorers.convert_videoalign --src <VideoReward dir> --base <Qwen2-VL-2B-Instruct dir>
--out <model_dir>/videoalign [--step N]`` does the same and merges each LoRA pair into its weight
(``W + B @ A * alpha / r``, ``alpha / sqrt(r)`` with rsLoRA), then writes the model as a save_pretrained directory
in the base's dtype, the tokenizer with the reward tokens, the base's image processor, ``reward_head.safetensors``
and a copy of ``model_config.json``. The latest checkpoint is taken unless ``--step`` names one (as the authors'
loader). ``non_lora_state_dict.pth`` is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from reward_server.scorers.convert_hpsv3 import LEGACY_PREFIXES
from reward_server.scorers.videoalign import CONFIG_FILE, HEAD_FILE, SPECIAL_TOKENS

PEFT_PREFIX = "base_model.model."


def checkpoint_dir(src: Path, step: int | None) -> Path:
    """``src/checkpoint-<step>``, the highest step when ``step`` is None."""
    found = {int(path.name.rsplit("-", 1)[1]): path for path in src.glob("checkpoint-*") if path.name[11:].isdigit()}
    if not found:
        raise FileNotFoundError(f"no checkpoint-<step> folder in {src}")
    if step is not None and step not in found:
        raise FileNotFoundError(f"no checkpoint-{step} in {src}; found steps {sorted(found)}")
    return found[max(found) if step is None else step]


def current_name(key: str, expected: set[str]) -> str:
    """The installed transformers' name of a 4.45 Qwen2-VL tensor name (PEFT's prefix removed); KeyError if none."""
    key = key.removeprefix(PEFT_PREFIX)
    candidates = [key] + [new + key[len(old) :] for old, new in LEGACY_PREFIXES if key.startswith(old)]
    name = next((c for c in candidates if c in expected), None)
    if name is None:
        raise KeyError(
            f"{key} is not a tensor of the base model (is --base the Qwen2-VL VideoReward was trained from?)"
        )
    return name


def merge_lora(state: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], adapter: dict) -> None:
    """Add each ``B @ A * scaling`` of ``lora`` (PEFT keys) into its weight in ``state`` (current names), in float32."""
    if adapter.get("rank_pattern") or adapter.get("alpha_pattern"):
        raise ValueError("per-module LoRA ranks or alphas (rank_pattern, alpha_pattern) are not supported")
    rank, alpha = adapter["r"], adapter["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if adapter.get("use_rslora") else alpha / rank
    other = [key for key in lora if ".lora_A.weight" not in key and ".lora_B.weight" not in key]
    if other:
        raise ValueError(f"only linear LoRA layers are supported, found {other[:3]}")
    for key_a in (key for key in lora if key.endswith(".lora_A.weight")):
        module = key_a.removesuffix(".lora_A.weight")
        name = current_name(module + ".weight", set(state))
        delta = lora[module + ".lora_B.weight"].float() @ lora[key_a].float() * scaling
        state[name] = (state[name].float() + delta).to(state[name].dtype)


def convert(src: Path, base: Path, out: Path, step: int | None = None) -> Path:
    """Write the merged backbone, tokenizer, image processor, head and model_config.json from ``src`` into ``out``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not (src / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {src}: pass the released VideoReward folder as --src")
    checkpoint = checkpoint_dir(src, step)
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    lora = load_file(str(checkpoint / "adapter_model.safetensors"))
    non_lora = torch.load(checkpoint / "non_lora_state_dict.pth", map_location="cpu", weights_only=True)
    head = non_lora.pop(PEFT_PREFIX + "rm_head.weight", None)
    if head is None or head.shape[0] != len(SPECIAL_TOKENS):
        raise ValueError(f"{checkpoint} has no 3-output rm_head.weight: not a VideoReward (VQ, MQ, TA) checkpoint")
    config = AutoConfig.from_pretrained(base)
    if config.model_type != "qwen2_vl":
        raise ValueError(f"{base} holds a {config.model_type!r} model; VideoReward is a qwen2_vl")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    state = model.state_dict()
    for key, value in non_lora.items():
        name = current_name(key, set(state))
        if state[name].shape != value.shape:
            raise ValueError(f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(state[name].shape)} here")
        state[name] = value.to(state[name].dtype)
    merge_lora(state, lora, adapter)
    model.load_state_dict(state, strict=True)
    dtype = getattr(config.get_text_config(), "dtype", None) or getattr(config, "dtype", None) or torch.float32
    model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    has_processor = (base / "preprocessor_config.json").is_file()
    (Qwen2VLImageProcessorPil.from_pretrained(base) if has_processor else Qwen2VLImageProcessorPil()).save_pretrained(
        out
    )
    save_file({"weight": head.float().contiguous()}, str(out / HEAD_FILE))
    shutil.copyfile(src / CONFIG_FILE, out / CONFIG_FILE)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src", type=Path, required=True, help="the VideoReward folder (model_config.json, checkpoint-*)"
    )
    parser.add_argument("--base", type=Path, required=True, help="the Qwen2-VL-2B-Instruct directory")
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. <model_dir>/videoalign")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    args = parser.parse_args(argv)
    convert(args.src, args.base, args.out, args.step)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
