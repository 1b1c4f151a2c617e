"""Precompute what training would recompute from the same data at every step: text embeddings, so that
training runs without the text encoders (FLUX's T5, Qwen-Image's Qwen2.5-VL: 9-16 GB that only ever see the
same few thousand prompts), and the VAE latents of the dataset's image inputs (re-encoded at every rollout).

    python -m trainer.precompute --config CONFIG.yaml [--out DIR] [--latents LATENTS_DIR] [section.key=value ...]

``--out DIR`` loads only the configured model's text encoders and tokenizers (no denoiser, no VAE), encodes
every prompt of the configured dataset and of its evaluation (``eval.path``), the empty prompt and
``model.negative_prompt``, one prompt per forward as the adapters encode them, and writes them to DIR with an
index (see ``trainer.models.text.TextEmbeddingStore``; a DIR of the same model gains the prompts it lacks
and encodes no other). Then
train with ``model.text_embeddings=DIR``: the adapter loads no text encoder and reads the very tensors its
encoders would give (computed on this run's ``train.device``), refusing a DIR made for other text encoders or
settings.

``--latents LATENTS_DIR`` loads the model as training does (with the text embeddings of ``--out`` or
``model.text_embeddings`` when given, and then no text encoder), hands it the image inputs of every dataset
item (and evaluation item) as a rollout does, and writes the VAE posterior of each distinct VAE input to
LATENTS_DIR, keyed by the input's sha256 (see ``trainer.models.latents.LatentStore``; a LATENTS_DIR of the same VAE
gains the new
inputs). Then train with ``model.image_latents=LATENTS_DIR``: the inpainting models read their masked images'
posteriors, the editing models (flux_kontext, flux2, the Qwen-Image-Edit ones) their references' and the
image-to-video ones their first frames' (with HunyuanVideo 1.5's SigLIP tokens, in ``image_embeds/``) from it
(every adapter that VAE-encodes image inputs; the others refuse it), bit-identical to encoding them on this run's
``train.device``; a changed image is not found and is encoded, and a LATENTS_DIR of another VAE, dtype or
resolution is refused. Supervised targets (``encode_images``: warm-up and SFT) are not stored: the dataset
hands them out only as random batches, and a few warm-up steps are cheap to encode.

Both stores write their index every 256 entries (``trainer.models.stores.INDEX_SAVE_EVERY``) and when the run
stops on an error or Ctrl-C: an interrupted command, run again, encodes only what is not stored yet.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

ITEMS_PER_BATCH = 8
"""Dataset items handed to the model at once while precomputing latents (only the pixels' memory grows)."""


def precompute(config, out: str) -> tuple[int, int]:
    """Encode the prompts of ``config`` (a trainer Config) that the store ``out`` lacks into it; returns (prompts
    encoded, prompts the store already held). The text encoders are loaded only when there is one to encode."""
    import torch

    from shared.interrupt import stop_if_interrupted
    from trainer.build import resolve_device
    from trainer.data import build_tasks
    from trainer.models import MODELS
    from trainer.models.text import TextEmbeddingStore, text_fingerprint

    task, evaluated = build_tasks(config.data, config.eval)
    prompts = list(dict.fromkeys([*task.prompts, *evaluated.eval_prompts, "", config.model.negative_prompt]))
    store = TextEmbeddingStore.create(out, text_fingerprint(config.model))
    todo = store.missing(prompts)
    if todo:
        encode = MODELS[config.model.name].prompt_encoder(config.model, resolve_device(config.train.device, 0))
        try:
            with torch.no_grad():
                for prompt in todo:
                    stop_if_interrupted()  # a Ctrl-C that library code swallowed (shared/interrupt.py)
                    store.add(prompt, encode(prompt))
        finally:
            store.save()
    return len(todo), len(prompts) - len(todo)


def precompute_latents(config, directory: str) -> tuple[int, int]:
    """VAE-encode the image inputs of every item of ``config``'s dataset into the latent store ``directory``;
    returns (inputs encoded, inputs the store already held)."""
    from trainer.build import resolve_device
    from trainer.data import build_tasks
    from trainer.models import build_adapter, image_encoding_models
    from trainer.models.latents import LatentStore, vae_fingerprint

    encoders = image_encoding_models()
    none = (
        f"the {config.model.name} adapter VAE-encodes none of the image inputs of data.name={config.data.name!r}: "
        f"nothing to store with --latents ({', '.join(encoders)} with an inpainting or editing dataset encode some)"
    )
    if config.model.name not in encoders:  # before any model loads or store is made
        raise ValueError(none)
    task, evaluated = build_tasks(config.data, config.eval)
    store = LatentStore.create(directory, vae_fingerprint(config.model))
    adapter = build_adapter(replace(config.model, image_latents=""), resolve_device(config.train.device, 0))
    items = [(task, range(len(task.prompts)))] + (
        [(evaluated, evaluated.eval_indices)] if evaluated is not task else []
    )
    chunks = [(t, list(ids[k : k + ITEMS_PER_BATCH])) for t, ids in items for k in range(0, len(ids), ITEMS_PER_BATCH)]
    latents = write_latents(adapter, store, (([t.prompts[i] for i in c], t.inputs(c)) for t, c in chunks))
    if latents.hits + latents.misses == 0:
        raise ValueError(none)
    return latents.misses, latents.hits


def write_latents(adapter, store, batches):
    """Run ``adapter.encode_prompts`` on each (prompts, ImageInputs) of ``batches`` with its VAE posteriors
    recorded into ``store`` (a ``LatentStore``), then write the store's index (also when interrupted); returns the
    recording ``ImageLatents`` (its ``misses`` were encoded and added, its ``hits`` were in the store already)."""
    from shared.interrupt import stop_if_interrupted
    from trainer.models.latents import ImageLatents

    adapter.image_latents = ImageLatents(adapter.vae, store, record=True)
    try:
        for prompts, inputs in batches:
            stop_if_interrupted()
            adapter.encode_prompts(prompts, inputs)
    finally:
        store.save()
    return adapter.image_latents


def main(argv: list[str] | None = None) -> int:
    from trainer.tool import user_path

    parser = argparse.ArgumentParser(
        prog="python -m trainer.precompute", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        required=True,
        action="append",
        help="the training config (YAML; repeatable, later files win): its model and data sections",
    )
    parser.add_argument(
        "--out", type=lambda text: str(user_path(text)), help="directory of the text embeddings (model.text_embeddings)"
    )
    parser.add_argument(
        "--latents",
        type=lambda text: str(user_path(text)),
        help="directory of the image inputs' VAE latents (model.image_latents)",
    )
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    if not args.out and not args.latents:
        parser.error("give --out DIR (text embeddings), --latents DIR (VAE latents of image inputs) or both")
    for flag, path in (("--out", args.out), ("--latents", args.latents)):
        if path and Path(path).exists() and not Path(path).is_dir():
            parser.error(f"{flag} {path} is a file: give a directory (made if missing)")

    from trainer.config import ConfigError, load_config, user_error_exit
    from trainer.quiet import quiet_third_party

    quiet_third_party()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.out:
            start = time.perf_counter()
            encoded, present = precompute(config, args.out)
            print(
                f"{encoded} prompts of {config.model.name} ({config.model.path}) encoded into {args.out} "
                f"({present} were there) in {time.perf_counter() - start:.1f} s; train with "
                f"{shlex.quote(f'model.text_embeddings={args.out}')}"
            )
            config = replace(config, model=replace(config.model, text_embeddings=args.out))
        if args.latents:
            start = time.perf_counter()
            encoded, present = precompute_latents(config, args.latents)
            print(
                f"{encoded} image inputs of {config.model.name} ({config.model.path}) VAE-encoded into "
                f"{args.latents} ({present} were there) in {time.perf_counter() - start:.1f} s; train with "
                f"{shlex.quote(f'model.image_latents={args.latents}')}"
            )
    except ValueError as exc:
        return user_error_exit(exc)
    return 0


if __name__ == "__main__":
    from shared.interrupt import run_tool

    run_tool(main, "interrupted: what is in the store's index is kept, and the same command goes on from it")
