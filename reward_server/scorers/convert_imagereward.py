"""Convert the released ImageReward checkpoint (``ImageReward.pt``: ``blip.visual_encoder.*``,
``blip.text_encoder.*``, ``mlp.layers.*``) into the layout :mod:`reward_server.scorers.imagereward` loads.

``python -m reward_server.scorers.convert_imagereward --src ImageReward.pt --tokenizer <bert-base-uncased dir>
--out <model_dir>/imagereward`` writes a BlipConfig, ``model.safetensors`` and BLIP's tokenizer (the BERT
tokenizer plus [DEC] and [ENC], as BLIP's ``init_tokenizer``). The source is read with safetensors or
``torch.load(weights_only=True)`` only. Head counts default to width / 64 (ViT-L/16: 16, BERT-base: 12).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from reward_server.scorers.convert_hps import count_blocks, default_heads, load_state

VISION_BLOCK = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


def blip_to_transformers(
    state: dict[str, torch.Tensor],
    *,
    vision_heads: int | None = None,
    text_heads: int | None = None,
    token_ids: dict[str, int] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(BlipConfig, state dict of :class:`ImageRewardModel`) for an ImageReward state dict; sizes from shapes."""
    from transformers import BlipConfig

    if "blip.visual_encoder.patch_embed.proj.weight" not in state or "mlp.layers.0.weight" not in state:
        raise ValueError("not an ImageReward checkpoint: expected blip.visual_encoder.* and mlp.layers.* keys")
    v_prefix, t_prefix = "blip.visual_encoder.", "blip.text_encoder."
    v_layers = count_blocks(state, v_prefix + "blocks.")
    t_layers = count_blocks(state, t_prefix + "encoder.layer.")
    v_width, _, patch, _ = state[v_prefix + "patch_embed.proj.weight"].shape
    grid = round((state[v_prefix + "pos_embed"].shape[1] - 1) ** 0.5)
    vocab, t_width = state[t_prefix + "embeddings.word_embeddings.weight"].shape
    vision = {
        "hidden_size": v_width,
        "num_hidden_layers": v_layers,
        "patch_size": patch,
        "image_size": grid * patch,
        "intermediate_size": state[v_prefix + "blocks.0.mlp.fc1.weight"].shape[0],
        "num_attention_heads": vision_heads or default_heads(v_width, 64),
        "layer_norm_eps": 1e-6,
    }
    text = {
        "hidden_size": t_width,
        "num_hidden_layers": t_layers,
        "vocab_size": vocab,
        "max_position_embeddings": state[t_prefix + "embeddings.position_embeddings.weight"].shape[0],
        "intermediate_size": state[t_prefix + "encoder.layer.0.intermediate.dense.weight"].shape[0],
        "num_attention_heads": text_heads or default_heads(t_width, 64),
        "layer_norm_eps": 1e-12,
        "encoder_hidden_size": v_width,
        **(token_ids or {}),
    }
    config = BlipConfig(vision_config=vision, text_config=text)
    out = {
        "vision_model.embeddings.class_embedding": state[v_prefix + "cls_token"],
        "vision_model.embeddings.position_embedding": state[v_prefix + "pos_embed"],
    }
    for kind in ("weight", "bias"):
        out[f"vision_model.embeddings.patch_embedding.{kind}"] = state[f"{v_prefix}patch_embed.proj.{kind}"]
        out[f"vision_model.post_layernorm.{kind}"] = state[f"{v_prefix}norm.{kind}"]
        for i in range(v_layers):
            for src, dst in VISION_BLOCK.items():
                out[f"vision_model.encoder.layers.{i}.{dst}.{kind}"] = state[f"{v_prefix}blocks.{i}.{src}.{kind}"]
    for key, value in state.items():
        if key.startswith(t_prefix) and not key.startswith(UNUSED):
            out["text_encoder." + key[len(t_prefix) :]] = value
        elif key.startswith("mlp.layers."):
            out[key] = value
    return config, {key: value.contiguous().clone() for key, value in out.items()}


def convert(
    src: Path,
    out: Path,
    *,
    tokenizer: Path | None = None,
    vision_heads: int | None = None,
    text_heads: int | None = None,
) -> Path:
    """Write the converted model (and BLIP's tokenizer, when given) from ``src`` into ``out``."""
    from safetensors.torch import save_file

    token_ids, tok = None, None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        if "[DEC]" not in tok.get_vocab():  # BLIP's init_tokenizer: bos [DEC], additional special [ENC]
            tok.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        token_ids = {
            "bos_token_id": tok.bos_token_id,
            "pad_token_id": tok.pad_token_id,
            "sep_token_id": tok.sep_token_id,
        }
    config, state = blip_to_transformers(
        load_state(src), vision_heads=vision_heads, text_heads=text_heads, token_ids=token_ids
    )
    if tok is not None and len(tok) != config.text_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tok)} tokens, the checkpoint {config.text_config.vocab_size}: "
            "pass bert-base-uncased's tokenizer"
        )
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tok is not None:
        tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, required=True, help="ImageReward.pt (or a .safetensors of it)")
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. <model_dir>/imagereward")
    parser.add_argument("--tokenizer", type=Path, help="a bert-base-uncased tokenizer directory; [DEC]/[ENC] are added")
    parser.add_argument("--vision-heads", type=int, help="default: width / 64")
    parser.add_argument("--text-heads", type=int, help="default: width / 64")
    args = parser.parse_args(argv)
    convert(args.src, args.out, tokenizer=args.tokenizer, vision_heads=args.vision_heads, text_heads=args.text_heads)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
