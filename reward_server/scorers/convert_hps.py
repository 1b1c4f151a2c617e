"""Convert an OpenCLIP checkpoint (HPS v2 / v2.1's ``HPS_v2*_compressed.pt``) into a transformers CLIPModel.

``python -m reward_server.scorers.convert_hps --src HPS_v2.1_compressed.pt --tokenizer <CLIP tokenizer dir>
--out <model_dir>/hpsv2`` writes ``config.json``, ``model.safetensors`` and the tokenizer files. The source
is read with safetensors or ``torch.load(weights_only=True)`` only: no arbitrary unpickling. Head counts
cannot be read from shapes: the defaults follow OpenCLIP's ViT-H/14 (head width 80 in the vision tower,
64 in the text tower); pass ``--vision-heads``/``--text-heads`` for other towers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch


def load_state(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch file (a bare state dict or ``{"state_dict": ...}``),
    with DDP's ``module.`` prefix stripped."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state: Any = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict; pass the checkpoint file")
    return {key.removeprefix("module."): value for key, value in state.items() if isinstance(value, torch.Tensor)}


def count_blocks(state: dict[str, torch.Tensor], prefix: str) -> int:
    """How many consecutive ``<prefix>N.*`` blocks the state dict has (0..N-1 all present)."""
    found = {int(key[len(prefix) :].split(".")[0]) for key in state if key.startswith(prefix)}
    if not found or found != set(range(len(found))):
        raise ValueError(f"no complete {prefix}N.* blocks in the checkpoint: is it an OpenCLIP ViT state dict?")
    return len(found)


def _blocks(state: dict[str, torch.Tensor], src: str, dst: str, layers: int) -> dict[str, torch.Tensor]:
    """OpenCLIP residual blocks (fused in_proj) -> transformers CLIPEncoderLayer names (q/k/v split)."""
    out = {}
    for i in range(layers):
        s, d = f"{src}{i}.", f"{dst}{i}."
        for kind in ("weight", "bias"):
            for name, part in zip(("q", "k", "v"), state[f"{s}attn.in_proj_{kind}"].chunk(3, dim=0), strict=True):
                out[f"{d}self_attn.{name}_proj.{kind}"] = part
            out[f"{d}self_attn.out_proj.{kind}"] = state[f"{s}attn.out_proj.{kind}"]
            out[f"{d}layer_norm1.{kind}"] = state[f"{s}ln_1.{kind}"]
            out[f"{d}layer_norm2.{kind}"] = state[f"{s}ln_2.{kind}"]
            out[f"{d}mlp.fc1.{kind}"] = state[f"{s}mlp.c_fc.{kind}"]
            out[f"{d}mlp.fc2.{kind}"] = state[f"{s}mlp.c_proj.{kind}"]
    return out


def default_heads(width: int, head_width: int) -> int:
    if width % head_width:
        raise ValueError(f"width {width} is not a multiple of head width {head_width}: pass the head count")
    return width // head_width


def openclip_to_transformers(
    state: dict[str, torch.Tensor],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    hidden_act: str = "gelu",
    token_ids: dict[str, int] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(CLIPConfig, transformers state dict) for an OpenCLIP ViT CLIP state dict; projections transposed,
    sizes read from the shapes. ``token_ids``: bos/eos/pad ids for the text config (CLIP's by default)."""
    from transformers import CLIPConfig

    unknown = [key for key in state if key.startswith(("visual.trunk", "text.transformer", "visual.attn_pool"))]
    if unknown or "visual.conv1.weight" not in state:
        raise ValueError("only OpenCLIP's built-in ViT towers are supported (no timm or HF text towers)")
    v_layers, t_layers = (
        count_blocks(state, "visual.transformer.resblocks."),
        count_blocks(state, "transformer.resblocks."),
    )
    v_width, _, patch, _ = state["visual.conv1.weight"].shape
    t_width = state["token_embedding.weight"].shape[1]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    vision = {
        "hidden_size": v_width,
        "num_hidden_layers": v_layers,
        "patch_size": patch,
        "image_size": grid * patch,
        "intermediate_size": state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        "num_attention_heads": vision_heads or default_heads(v_width, 80 if v_width == 1280 else 64),
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-5,
    }
    text = {
        "hidden_size": t_width,
        "num_hidden_layers": t_layers,
        "vocab_size": state["token_embedding.weight"].shape[0],
        "max_position_embeddings": state["positional_embedding"].shape[0],
        "intermediate_size": state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        "num_attention_heads": text_heads or default_heads(t_width, 64),
        "hidden_act": hidden_act,
        "layer_norm_eps": 1e-5,
        **(token_ids or {}),
    }
    config = CLIPConfig(vision_config=vision, text_config=text, projection_dim=state["text_projection"].shape[1])
    return config, _clip_weights(state, v_layers, t_layers)


def _clip_weights(state: dict[str, torch.Tensor], v_layers: int, t_layers: int) -> dict[str, torch.Tensor]:
    """The OpenCLIP weights under transformers' CLIP names, projections transposed, each a contiguous copy."""
    out = {
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "visual_projection.weight": state["visual.proj"].T,
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_projection.weight": state["text_projection"].T,
        "logit_scale": state["logit_scale"].reshape(()),
    }
    for kind in ("weight", "bias"):
        out[f"vision_model.pre_layrnorm.{kind}"] = state[f"visual.ln_pre.{kind}"]
        out[f"vision_model.post_layernorm.{kind}"] = state[f"visual.ln_post.{kind}"]
        out[f"text_model.final_layer_norm.{kind}"] = state[f"ln_final.{kind}"]
    out |= _blocks(state, "visual.transformer.resblocks.", "vision_model.encoder.layers.", v_layers)
    out |= _blocks(state, "transformer.resblocks.", "text_model.encoder.layers.", t_layers)
    return {key: value.contiguous().clone() for key, value in out.items()}


def convert(
    src: Path,
    out: Path,
    *,
    tokenizer: Path | None = None,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    hidden_act: str = "gelu",
) -> Path:
    """Write a transformers CLIPModel (and the tokenizer, when given) converted from ``src`` into ``out``."""
    from safetensors.torch import save_file

    token_ids, tok = None, None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        token_ids = {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
    config, state = openclip_to_transformers(
        load_state(src), vision_heads=vision_heads, text_heads=text_heads, hidden_act=hidden_act, token_ids=token_ids
    )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tok is not None:
        tok.model_max_length = config.text_config.max_position_embeddings
        tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="OpenCLIP checkpoint (.pt/.pth/.bin or .safetensors)")
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. <model_dir>/hpsv2")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a CLIP tokenizer directory to copy (e.g. a save of "
        "laion/CLIP-ViT-H-14-laion2B-s32B-b79K's); the scorer needs one beside the weights",
    )
    parser.add_argument("--vision-heads", type=int, help="default: width / 80 for width 1280 (ViT-H), else / 64")
    parser.add_argument("--text-heads", type=int, help="default: width / 64")
    parser.add_argument(
        "--hidden-act",
        default="gelu",
        choices=["gelu", "quick_gelu"],
        help="gelu for LAION/HPS towers, quick_gelu for OpenAI's",
    )
    args = parser.parse_args(argv)
    convert(
        args.src,
        args.out,
        tokenizer=args.tokenizer,
        vision_heads=args.vision_heads,
        text_heads=args.text_heads,
        hidden_act=args.hidden_act,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
