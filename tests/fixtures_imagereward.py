"""A tiny random checkpoint in the released ImageReward layout (``blip.visual_encoder.*`` timm-style ViT,
``blip.text_encoder.*`` BLIP's med BERT with cross-attention, ``mlp.layers.*``), converted into
``<model_dir>/imagereward`` by the project's converter, and a plain-torch forward of that layout."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

TINY = {
    "v_width": 32,
    "v_layers": 2,
    "v_heads": 4,
    "patch": 8,
    "image": 32,
    "t_width": 32,
    "t_layers": 2,
    "t_heads": 2,
    "positions": 40,
}
WORDS = "a photo of the digit cat dog red blue green big small cup on table picture".split()


def bert_tokenizer(directory: Path):
    """A BertTokenizer (uncased WordPiece) over a few words and single characters, saved to ``directory``."""
    from transformers import BertTokenizer

    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz0123456789"]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(directory / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(directory)
    return tokenizer


def tiny_imagereward_state(vocab: int, seed: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1, base: float = 0.0) -> torch.Tensor:
        return base + scale * torch.randn(*shape, generator=g)

    vw, tw, grid = TINY["v_width"], TINY["t_width"], TINY["image"] // TINY["patch"]
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    state = {
        v + "cls_token": rand(1, 1, vw),
        v + "pos_embed": rand(1, grid * grid + 1, vw),
        v + "patch_embed.proj.weight": rand(vw, 3, TINY["patch"], TINY["patch"], scale=0.05),
        v + "patch_embed.proj.bias": rand(vw),
        v + "norm.weight": rand(vw, base=1.0),
        v + "norm.bias": rand(vw),
    }
    for i in range(TINY["v_layers"]):
        p = f"{v}blocks.{i}."
        state.update(
            {
                p + "norm1.weight": rand(vw, base=1.0),
                p + "norm1.bias": rand(vw),
                p + "attn.qkv.weight": rand(3 * vw, vw, scale=0.3),
                p + "attn.qkv.bias": rand(3 * vw),
                p + "attn.proj.weight": rand(vw, vw, scale=0.2),
                p + "attn.proj.bias": rand(vw),
                p + "norm2.weight": rand(vw, base=1.0),
                p + "norm2.bias": rand(vw),
                p + "mlp.fc1.weight": rand(4 * vw, vw, scale=0.2),
                p + "mlp.fc1.bias": rand(4 * vw),
                p + "mlp.fc2.weight": rand(vw, 4 * vw, scale=0.1),
                p + "mlp.fc2.bias": rand(vw),
            }
        )
    state.update(
        {
            t + "embeddings.word_embeddings.weight": rand(vocab, tw, scale=0.5),
            t + "embeddings.position_embeddings.weight": rand(TINY["positions"], tw),
            t + "embeddings.position_ids": torch.arange(TINY["positions"])[None],
            t + "embeddings.LayerNorm.weight": rand(tw, base=1.0),
            t + "embeddings.LayerNorm.bias": rand(tw),
        }
    )
    for i in range(TINY["t_layers"]):
        p = f"{t}encoder.layer.{i}."
        for part, source in (("attention", tw), ("crossattention", vw)):
            state.update(
                {
                    f"{p}{part}.self.query.weight": rand(tw, tw, scale=0.3),
                    f"{p}{part}.self.query.bias": rand(tw),
                    f"{p}{part}.self.key.weight": rand(tw, source, scale=0.3),
                    f"{p}{part}.self.key.bias": rand(tw),
                    f"{p}{part}.self.value.weight": rand(tw, source, scale=0.3),
                    f"{p}{part}.self.value.bias": rand(tw),
                    f"{p}{part}.output.dense.weight": rand(tw, tw, scale=0.2),
                    f"{p}{part}.output.dense.bias": rand(tw),
                    f"{p}{part}.output.LayerNorm.weight": rand(tw, base=1.0),
                    f"{p}{part}.output.LayerNorm.bias": rand(tw),
                }
            )
        state.update(
            {
                p + "intermediate.dense.weight": rand(4 * tw, tw, scale=0.2),
                p + "intermediate.dense.bias": rand(4 * tw),
                p + "output.dense.weight": rand(tw, 4 * tw, scale=0.1),
                p + "output.dense.bias": rand(tw),
                p + "output.LayerNorm.weight": rand(tw, base=1.0),
                p + "output.LayerNorm.bias": rand(tw),
            }
        )
    state.update(
        {
            "blip.vision_proj.weight": rand(16, vw),
            "blip.vision_proj.bias": rand(16),
            "blip.text_proj.weight": rand(16, tw),
            "blip.text_proj.bias": rand(16),
        }
    )
    for index, (fan_out, fan_in) in zip(
        (0, 2, 4, 6, 7), ((1024, tw), (128, 1024), (64, 128), (16, 64), (1, 16)), strict=True
    ):
        state[f"mlp.layers.{index}.weight"] = rand(fan_out, fan_in, scale=1 / math.sqrt(fan_in))
        state[f"mlp.layers.{index}.bias"] = rand(fan_out, scale=0.1)
    return state


def _attend(
    q_in: torch.Tensor, kv_in: torch.Tensor, w: dict[str, torch.Tensor], heads: int, additive: torch.Tensor | None
) -> torch.Tensor:
    """Multi-head attention from separate query/key/value weights ``w['q'], w['k'], w['v']`` (+ biases)."""
    batch, length, width = q_in.shape[0], q_in.shape[1], w["q"].shape[0]

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, x.shape[1], heads, width // heads).transpose(1, 2)

    q, k, v = (split(inp @ w[n].T + w[n + "b"]) for n, inp in (("q", q_in), ("k", kv_in), ("v", kv_in)))
    logits = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    if additive is not None:
        logits = logits + additive
    return (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)


def blip_vit(state: dict[str, torch.Tensor], pixels_BCHW: torch.Tensor) -> torch.Tensor:
    """BLIP's VisionTransformer.forward: patch embedding + cls + pos, pre-norm blocks (eps 1e-6), final norm."""
    v, eps = "blip.visual_encoder.", 1e-6
    x = (
        F.conv2d(
            pixels_BCHW, state[v + "patch_embed.proj.weight"], state[v + "patch_embed.proj.bias"], stride=TINY["patch"]
        )
        .flatten(2)
        .transpose(1, 2)
    )
    x = torch.cat([state[v + "cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + state[v + "pos_embed"]
    width = x.shape[-1]
    for i in range(TINY["v_layers"]):
        p = f"{v}blocks.{i}."
        h = F.layer_norm(x, (width,), state[p + "norm1.weight"], state[p + "norm1.bias"], eps)
        qw, kw, vw = state[p + "attn.qkv.weight"].chunk(3)
        qb, kb, vb = state[p + "attn.qkv.bias"].chunk(3)
        attended = _attend(h, h, {"q": qw, "k": kw, "v": vw, "qb": qb, "kb": kb, "vb": vb}, TINY["v_heads"], None)
        x = x + attended @ state[p + "attn.proj.weight"].T + state[p + "attn.proj.bias"]
        h = F.layer_norm(x, (width,), state[p + "norm2.weight"], state[p + "norm2.bias"], eps)
        x = (
            x
            + F.gelu(h @ state[p + "mlp.fc1.weight"].T + state[p + "mlp.fc1.bias"]) @ state[p + "mlp.fc2.weight"].T
            + state[p + "mlp.fc2.bias"]
        )
    return F.layer_norm(x, (width,), state[v + "norm.weight"], state[v + "norm.bias"], eps)


def imagereward_raw(
    state: dict[str, torch.Tensor], pixels_BCHW: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """ImageReward.score before normalisation: med BERT (post-norm, eps 1e-12, padding masked with -10000, every
    layer cross-attending to all image tokens), the [CLS] state, then the MLP (no activations)."""
    t, eps = "blip.text_encoder.", 1e-12
    image = blip_vit(state, pixels_BCHW)
    length = input_ids.shape[1]
    x = (
        state[t + "embeddings.word_embeddings.weight"][input_ids]
        + state[t + "embeddings.position_embeddings.weight"][:length]
    )
    width = x.shape[-1]
    x = F.layer_norm(x, (width,), state[t + "embeddings.LayerNorm.weight"], state[t + "embeddings.LayerNorm.bias"], eps)
    additive = ((1.0 - attention_mask.float()) * -10000.0)[:, None, None, :]
    for i in range(TINY["t_layers"]):
        p = f"{t}encoder.layer.{i}."
        for part, source, mask in (("attention", None, additive), ("crossattention", image, None)):
            w = {
                n: state[f"{p}{part}.self.{full}.weight"] for n, full in (("q", "query"), ("k", "key"), ("v", "value"))
            }
            w |= {
                n + "b": state[f"{p}{part}.self.{full}.bias"]
                for n, full in (("q", "query"), ("k", "key"), ("v", "value"))
            }
            attended = _attend(x, x if source is None else source, w, TINY["t_heads"], mask)
            out = attended @ state[f"{p}{part}.output.dense.weight"].T + state[f"{p}{part}.output.dense.bias"]
            x = F.layer_norm(
                out + x,
                (width,),
                state[f"{p}{part}.output.LayerNorm.weight"],
                state[f"{p}{part}.output.LayerNorm.bias"],
                eps,
            )
        h = F.gelu(x @ state[p + "intermediate.dense.weight"].T + state[p + "intermediate.dense.bias"])
        h = h @ state[p + "output.dense.weight"].T + state[p + "output.dense.bias"]
        x = F.layer_norm(h + x, (width,), state[p + "output.LayerNorm.weight"], state[p + "output.LayerNorm.bias"], eps)
    h = x[:, 0]
    for index in (0, 2, 4, 6, 7):
        h = h @ state[f"mlp.layers.{index}.weight"].T + state[f"mlp.layers.{index}.bias"]
    return h.squeeze(-1)


def build_tiny_imagereward(model_dir: Path, *, seed: int = 5) -> tuple[Path, dict[str, torch.Tensor]]:
    """``<model_dir>/imagereward`` converted from a tiny ImageReward-layout ``.pt`` (a bare state dict, as
    released) and a tiny BERT tokenizer (the converter adds [DEC] and [ENC]). Returns the directory and state."""
    from reward_server.scorers.convert_imagereward import convert

    tokenizer_dir = model_dir / "imagereward-src" / "tokenizer"
    vocab = len(bert_tokenizer(tokenizer_dir)) + 2  # + [DEC] and [ENC], as BLIP's tokenizer
    state = tiny_imagereward_state(vocab, seed)
    src = model_dir / "imagereward-src" / "ImageReward.pt"
    torch.save(state, src)
    out = convert(
        src,
        model_dir / "imagereward",
        tokenizer=tokenizer_dir,
        vision_heads=TINY["v_heads"],
        text_heads=TINY["t_heads"],
    )
    return out, state
