"""Memory on paper: Wan2.1-T2V-14B's training activations per rank at 480p x 81 frames under sequence parallelism.

Pure arithmetic from the published config (Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py; diffusers'
Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json: 40 layers, 40 heads x 128 = dim 5120, ffn 13824,
patch (1, 2, 2); VAE stride (4, 8, 8); umT5 text of 512 tokens). Counts the tensors one block keeps for its
backward per token (bf16, flash/cuDNN attention: no S x S scores), with and without gradient checkpointing of
each block, for sequence-parallel groups of 1, 2, 4 and 8 ranks (parallel.sequence_parallel) of 8 GPUs.

    python bench/sequence_parallel.py
"""

from __future__ import annotations

import argparse

LAYERS, HEADS, HEAD_DIM, FFN = 40, 40, 128, 13824
DIM = HEADS * HEAD_DIM  # 5120
PATCH, VAE_STRIDE, TEXT_TOKENS = (1, 2, 2), (4, 8, 8), 512
PARAMS = 14.0e9
BYTES = 2  # bf16 activations

SAVED_PER_TOKEN = {
    "norm1 + modulation (in, normalised, modulated)": 3 * DIM,
    "self-attn q, k, v": 3 * DIM,
    "q/k RMS norm (in, out)": 4 * DIM,
    "rotary q, k": 2 * DIM,
    "Ulysses all-to-all q, k, v (heads/P of all tokens = dim of S/P tokens)": 3 * DIM,
    "attention out + lse, all-to-all back, to_out in": 3 * DIM,
    "gated residual": DIM,
    "norm2 (in, out) + cross-attn q, q-norm": 4 * DIM,
    "cross-attn out, to_out in, residual": 3 * DIM,
    "norm3 + modulation (in, out), ffn in": 3 * DIM,
    "ffn hidden before and after GELU": 2 * FFN,
    "ffn out, gated residual": 2 * DIM,
}
"""Elements one block keeps for backward per (local) token: a count of its saved tensors, not a measurement."""
TEXT_PER_LAYER = TEXT_TOKENS * 4 * DIM
"""Cross-attention's text keys and values (projections and k-norm) per layer: whole on every rank (not split)."""


def tokens(frames: int, height: int, width: int) -> int:
    """Transformer tokens of one video: latent frames x latent pixels / patch."""
    latent = ((frames - 1) // VAE_STRIDE[0] + 1, height // VAE_STRIDE[1], width // VAE_STRIDE[2])
    return (latent[0] // PATCH[0]) * (latent[1] // PATCH[1]) * (latent[2] // PATCH[2])


def table(frames: int, height: int, width: int, gpus: int) -> list[str]:
    """The rows of the table (GiB per rank, one sample per replica)."""
    seq = tokens(frames, height, width)
    per_token = sum(SAVED_PER_TOKEN.values())
    gib = 2**30
    rows = [
        f"Wan2.1-T2V-14B, {width}x{height} x {frames} frames: {seq} tokens; {per_token} saved elements per token and "
        f"block ({per_token * BYTES / 1024:.0f} KiB in bf16); {gpus} GPUs",
        "| SP | replicas | tokens/rank | heads/rank | activations, no checkpointing | with block checkpointing "
        "| S x S scores of one layer (math kernel) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sp in (1, 2, 4, 8):
        if sp > gpus or seq % sp or HEADS % sp:
            continue
        local = seq // sp
        text = LAYERS * TEXT_PER_LAYER * BYTES
        full = (LAYERS * local * per_token * BYTES + text) / gib
        checkpointed = (LAYERS * local * DIM * BYTES + local * per_token * BYTES + TEXT_PER_LAYER * BYTES) / gib
        scores = seq * seq * (HEADS // sp) * BYTES / gib
        rows.append(
            f"| {sp} | {gpus // sp} | {local} | {HEADS // sp} | {full:.1f} GiB | {checkpointed:.2f} GiB "
            f"| {scores:.0f} GiB |"
        )
    shard = PARAMS * (2 + 4 + 4 + 4 + 4) / gpus / gib  # bf16 compute copy, fp32 master, grads, Adam moments
    block = PARAMS / LAYERS * BYTES / gib
    rows.append(
        f"Weights and optimizer, full fine-tuning under FSDP2 over {gpus} ranks (bf16 + fp32 master, grads, Adam): "
        f"{shard:.0f} GiB per rank, whatever the SP size; one gathered bf16 block: {block:.2f} GiB"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    print("\n".join(table(args.frames, args.height, args.width, args.gpus)))


if __name__ == "__main__":
    main()
