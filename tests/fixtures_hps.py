"""A tiny random OpenCLIP-layout checkpoint (as HPS v2.1's ``.pt``), converted into ``<model_dir>/hpsv2`` by the
project's converter, and a plain-torch forward of the OpenCLIP layout to check the converted scorer against."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

# Head counts differ between towers (and from width / 64) so that a mix-up in the conversion shows.
TINY = {
    "v_width": 32,
    "v_layers": 2,
    "v_heads": 4,
    "patch": 8,
    "image": 32,
    "t_width": 32,
    "t_layers": 2,
    "t_heads": 2,
    "context": 77,
    "embed": 24,
}


def tiny_openclip_state(vocab: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random tensors under OpenCLIP's ViT CLIP names (fused ``in_proj``, ``[width, embed]`` projections)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.1, base: float = 0.0) -> torch.Tensor:
        return base + scale * torch.randn(*shape, generator=g)

    state: dict[str, torch.Tensor] = {}

    def tower(prefix: str, width: int, layers: int) -> None:
        for i in range(layers):
            p = f"{prefix}transformer.resblocks.{i}."
            state.update(
                {
                    p + "ln_1.weight": rand(width, base=1.0),
                    p + "ln_1.bias": rand(width),
                    p + "attn.in_proj_weight": rand(3 * width, width, scale=0.3),
                    p + "attn.in_proj_bias": rand(3 * width),
                    p + "attn.out_proj.weight": rand(width, width, scale=0.2),
                    p + "attn.out_proj.bias": rand(width),
                    p + "ln_2.weight": rand(width, base=1.0),
                    p + "ln_2.bias": rand(width),
                    p + "mlp.c_fc.weight": rand(4 * width, width, scale=0.2),
                    p + "mlp.c_fc.bias": rand(4 * width),
                    p + "mlp.c_proj.weight": rand(width, 4 * width, scale=0.1),
                    p + "mlp.c_proj.bias": rand(width),
                }
            )

    vw, tw, grid = TINY["v_width"], TINY["t_width"], TINY["image"] // TINY["patch"]
    state |= {
        "visual.conv1.weight": rand(vw, 3, TINY["patch"], TINY["patch"], scale=0.05),
        "visual.class_embedding": rand(vw),
        "visual.positional_embedding": rand(grid * grid + 1, vw),
        "visual.ln_pre.weight": rand(vw, base=1.0),
        "visual.ln_pre.bias": rand(vw),
        "visual.ln_post.weight": rand(vw, base=1.0),
        "visual.ln_post.bias": rand(vw),
        "visual.proj": rand(vw, TINY["embed"], scale=0.2),
    }
    tower("visual.", vw, TINY["v_layers"])
    state |= {
        "token_embedding.weight": rand(vocab, tw, scale=0.5),
        "positional_embedding": rand(TINY["context"], tw),
        "ln_final.weight": rand(tw, base=1.0),
        "ln_final.bias": rand(tw),
        "text_projection": rand(tw, TINY["embed"], scale=0.2),
        "logit_scale": torch.tensor(math.log(1 / 0.07)),
    }
    tower("", tw, TINY["t_layers"])
    return state


def _block(
    x: torch.Tensor, state: dict[str, torch.Tensor], p: str, heads: int, mask: torch.Tensor | None
) -> torch.Tensor:
    batch, length, width = x.shape
    h = F.layer_norm(x, (width,), state[p + "ln_1.weight"], state[p + "ln_1.bias"], 1e-5)
    qkv = h @ state[p + "attn.in_proj_weight"].T + state[p + "attn.in_proj_bias"]
    q, k, v = (t.reshape(batch, length, heads, width // heads).transpose(1, 2) for t in qkv.split(width, dim=-1))
    logits = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    if mask is not None:
        logits = logits + mask
    attended = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)
    x = x + attended @ state[p + "attn.out_proj.weight"].T + state[p + "attn.out_proj.bias"]
    h = F.layer_norm(x, (width,), state[p + "ln_2.weight"], state[p + "ln_2.bias"], 1e-5)
    h = F.gelu(h @ state[p + "mlp.c_fc.weight"].T + state[p + "mlp.c_fc.bias"])
    return x + h @ state[p + "mlp.c_proj.weight"].T + state[p + "mlp.c_proj.bias"]


def openclip_image_features(state: dict[str, torch.Tensor], pixels_BCHW: torch.Tensor) -> torch.Tensor:
    """OpenCLIP VisionTransformer.forward: patches, class token, ln_pre, blocks, ln_post(class token) @ proj."""
    x = F.conv2d(pixels_BCHW, state["visual.conv1.weight"], stride=TINY["patch"]).flatten(2).transpose(1, 2)
    cls = state["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = torch.cat([cls, x], dim=1) + state["visual.positional_embedding"]
    x = F.layer_norm(x, (x.shape[-1],), state["visual.ln_pre.weight"], state["visual.ln_pre.bias"], 1e-5)
    for i in range(TINY["v_layers"]):
        x = _block(x, state, f"visual.transformer.resblocks.{i}.", TINY["v_heads"], None)
    pooled = F.layer_norm(x[:, 0], (x.shape[-1],), state["visual.ln_post.weight"], state["visual.ln_post.bias"], 1e-5)
    return pooled @ state["visual.proj"]


def openclip_text_features(state: dict[str, torch.Tensor], tokens_BL: torch.Tensor, eot_id: int) -> torch.Tensor:
    """OpenCLIP CLIP.encode_text on zero-padded context-length tokens: causal blocks, ln_final, the EOT token's
    state @ text_projection (OpenCLIP finds EOT by argmax, as it is the largest id in CLIP's vocabulary)."""
    length = tokens_BL.shape[1]
    x = state["token_embedding.weight"][tokens_BL] + state["positional_embedding"][:length]
    causal = torch.full((length, length), float("-inf")).triu(1)
    for i in range(TINY["t_layers"]):
        x = _block(x, state, f"transformer.resblocks.{i}.", TINY["t_heads"], causal)
    x = F.layer_norm(x, (x.shape[-1],), state["ln_final.weight"], state["ln_final.bias"], 1e-5)
    eot = (tokens_BL == eot_id).int().argmax(-1)
    return x[torch.arange(x.shape[0]), eot] @ state["text_projection"]


def build_tiny_hps(model_dir: Path, *, seed: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    """``<model_dir>/hpsv2`` converted from a tiny ``{"state_dict": {"module.<openclip name>": ...}}`` .pt
    file (HPS's training-checkpoint wrapping). Returns the directory and the OpenCLIP state."""
    from tiny_models import clip_tokenizer

    from reward_server.scorers.convert_hps import convert

    tokenizer_dir = model_dir / "hps-src" / "tokenizer"
    tokenizer = clip_tokenizer(tokenizer_dir, max_length=77)
    state = tiny_openclip_state(len(tokenizer), seed)
    src = model_dir / "hps-src" / "tiny_hps.pt"
    torch.save({"state_dict": {f"module.{key}": value for key, value in state.items()}, "epoch": 1}, src)
    out = convert(
        src, model_dir / "hpsv2", tokenizer=tokenizer_dir, vision_heads=TINY["v_heads"], text_heads=TINY["t_heads"]
    )
    return out, state
