"""Precompute text embeddings, so that training runs without the text encoders (FLUX's T5, Qwen-Image's
Qwen2.5-VL: 9-16 GB that only ever see the same few thousand prompts).

    python -m trainer.precompute --config CONFIG.yaml --out DIR [section.key=value ...]

loads only the configured model's text encoders and tokenizers (no denoiser, no VAE), encodes every prompt of
the configured dataset (its ``prompts`` and ``eval_prompts``), the empty prompt and ``model.negative_prompt``,
one prompt per forward as the adapters encode them, and writes them to DIR with an index (see
``trainer.models.common.TextEmbeddingStore``; a DIR of the same model gains the new prompts). Then train with
``model.text_embeddings=DIR``: the adapter loads no text encoder and reads the very tensors its encoders
would give (computed on this run's ``train.device``), refusing a DIR made for other text encoders or settings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def precompute(config, out: str) -> int:
    """Encode the prompts of ``config`` (a trainer Config) into the store ``out``; returns how many."""
    import torch

    from trainer.build import resolve_device
    from trainer.data import build_task
    from trainer.models import MODELS
    from trainer.models.common import TextEmbeddingStore, text_fingerprint

    task = build_task(config.data)
    prompts = list(dict.fromkeys([*task.prompts, *task.eval_prompts, "", config.model.negative_prompt]))
    adapter_class = MODELS[config.model.name].load()
    encode = adapter_class.prompt_encoder(config.model, resolve_device(config.train.device, 0))
    with torch.no_grad():
        return TextEmbeddingStore.write(out, text_fingerprint(adapter_class, config.model),
                                        ((p, encode(p)) for p in prompts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.precompute", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the training config (YAML): its model and data sections")
    parser.add_argument("--out", required=True, help="directory of the embeddings (model.text_embeddings)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)

    from trainer.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        count = precompute(config, args.out)
    except ValueError as exc:
        if os.environ.get("RF_TRACEBACK"):
            raise
        print(f"error: {exc}\n(set RF_TRACEBACK=1 for the traceback)", file=sys.stderr)
        return 2
    print(f"{count} prompts of {config.model.name} ({config.model.path}) encoded into {args.out} in "
          f"{time.perf_counter() - start:.1f} s; train with model.text_embeddings={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
