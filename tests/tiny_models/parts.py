"""The parts the tiny test models are built from: the real architectures' tokenizers, text encoders and VAE
at test sizes, built locally (no network), and a tiny IP-Adapter image encoder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CLIP_TEXT = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    projection_dim=32,
    max_position_embeddings=77,
    hidden_act="gelu",
)
T5_ENCODER = dict(
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
)
VAE_1X = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    block_out_channels=(4,),
    layers_per_block=1,
    norm_num_groups=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
)
"""One-block VAE without downsampling: latents have the image's size (fast, and enough to test the code)."""
CLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    image_size=32,
    patch_size=8,
    projection_dim=24,
    hidden_act="gelu",
)
"""16 patches of 8x8 pixels; 24-dim image embeddings (unlike every text width, so a mix-up fails)."""
TEXT_LENGTH = 16
"""Tokens per prompt for every tiny text encoder (CLIP model_max_length, T5 max_sequence_length)."""


_WORDS = (
    "a photo of the digit number cat dog red blue green big small image picture text sign handwritten "
    "zero one two three four five six seven eight nine"
).split()


def _corpus() -> list[str]:
    return [f"{a} {b} {c}" for a, b, c in zip(_WORDS, _WORDS[3:] + _WORDS[:3], _WORDS[7:] + _WORDS[:7], strict=True)]


def clip_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A CLIPTokenizer over a small local corpus (built deterministically), saved to ``directory``."""
    from transformers import CLIPTokenizer

    from trainer.models.tokenizers import clip_bpe_tokenizer

    clip_bpe_tokenizer(directory, max_length)
    return CLIPTokenizer.from_pretrained(directory)


def t5_tokenizer(directory: Path, max_length: int = TEXT_LENGTH):
    """A unigram T5 tokenizer whose pieces are the corpus words and single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [("▁" + w, -2.0) for w in _WORDS] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789"]
    tok = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)
    tok.save_pretrained(directory)
    return tok


def qwen_tokenizer(directory: Path, extra_special: tuple[str, ...] = ()):
    """A byte-level BPE with Qwen's chat special tokens (and ``extra_special``, e.g. the vision tokens of the
    editing pipelines), as a Qwen2Tokenizer. The vocabulary stays small so that the pipeline's prompt
    template still spans more than its 34 dropped prefix tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        _corpus(),
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    state = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Qwen2Tokenizer(
        vocab=state["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra_special]})
    tok.save_pretrained(directory)
    return tok


def clip_text_encoder(tok, cls_name: str = "CLIPTextModel"):
    import transformers

    config = transformers.CLIPTextConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **CLIP_TEXT,
    )
    return getattr(transformers, cls_name)(config).eval()


def t5_encoder(tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            decoder_start_token_id=0,
            **T5_ENCODER,
        )
    ).eval()


def vae_1x(latent_channels: int):
    """The one-block ``AutoencoderKL`` of ``VAE_1X`` with ``latent_channels`` channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(latent_channels=latent_channels, **VAE_1X).eval()


def build_tiny_image_encoder(path: str | Path, seed: int = 0) -> Path:
    """A CLIPVisionModelWithProjection and its CLIP image processor config, as IP-Adapters load them."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModelWithProjection

    path = Path(path)
    torch.manual_seed(seed)
    CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VISION)).eval().save_pretrained(path)
    side = CLIP_VISION["image_size"]
    CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(path)
    return path


def tiny_ip_adapter(root: str | Path, **overrides: Any):
    """IPAdapterSettings whose image encoder is a tiny CLIP vision tower built (once) under ``root``."""
    from trainer.models.ip_adapter import IPAdapterSettings

    path = Path(root) / "image_encoder"
    if not (path / "config.json").is_file():
        build_tiny_image_encoder(path)
    return IPAdapterSettings(**{"image_encoder": str(path), **overrides})


def randomize_ip_adapter(adapter, seed: int = 0, std: float = 0.5) -> None:
    """Replace every IP-Adapter weight of ``adapter`` by N(0, std^2) draws: a trained IP-Adapter's stand-in
    (fresh weights leave the output unchanged, so they cannot show that the IP path is used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.ip_adapter.parameters():
            p.copy_(std * torch.randn(p.shape, generator=g))
