"""The text path every adapter shares: its text encoders and tokenizers (or none, with a precomputed store),
the prompt encoder ``trainer.precompute`` runs, the fingerprint a store is checked against, the store itself
and the per-prompt embedding cache."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models.common import DTYPES, DiffusersModelConfig, freeze
from trainer.models.stores import INDEX_SAVE_EVERY, hash_files, index_to_extend, read_index, write_index
from trainer.quiet import truncation_notice_once

TEXT_INDEX = "index.json"
PRECOMPUTE = "python -m trainer.precompute --config CONFIG.yaml --out DIR"


def _model(config: DiffusersModelConfig):
    from trainer.models import MODELS

    return MODELS[config.name]


def load_text_components(config: DiffusersModelConfig, device: torch.device) -> dict[str, Any]:
    """The text encoders and tokenizers of model ``config.name`` (its ``text_components``: subfolder -> class)
    from ``config.path``, encoders frozen on ``device``; all None when ``config.text_embeddings`` is set.
    Subfolders in its ``optional_text`` may be absent (None)."""
    model = _model(config)
    if config.text_embeddings:
        return dict.fromkeys(model.text_components)
    path = Path(config.path)
    components: dict[str, Any] = {}
    for sub, cls in model.text_components.items():
        if not (path / sub).is_dir():
            if sub in model.optional_text:
                components[sub] = None
                continue
            raise ValueError(f"model.path={config.path!r} has no {sub}/ (a diffusers directory of this model)")
        if issubclass(cls, nn.Module):
            components[sub] = cls.from_pretrained(path, subfolder=sub, torch_dtype=DTYPES[config.dtype]).to(device)
            freeze(components[sub])
        else:
            components[sub] = cls.from_pretrained(path, subfolder=sub)
    return components


def text_pipeline(model, config: DiffusersModelConfig, device: torch.device, **extra: Any):
    """``model.pipeline_class`` (``model``: a ``ModelSpec``) holding only the text encoders, tokenizers and
    ``extra``; every other component None (``encode_prompt`` needs no more). What ``trainer.precompute`` encodes
    with."""
    params = inspect.signature(model.pipeline_class.__init__).parameters
    required = [n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty]
    text = load_text_components(config, device)
    return model.pipeline_class(**{**dict.fromkeys(required), **text, **extra})


def prompt_encoder(
    model, config: DiffusersModelConfig, device: torch.device | str, **extra: Any
) -> Callable[[str], dict[str, torch.Tensor]]:
    """The text path of ``model`` (a ``ModelSpec``) alone (text encoders and tokenizers; no denoiser or VAE is
    loaded) as a function: prompt -> the tensors its ``encode_prompts`` caches for that prompt. A text path
    exposes it as ``prompt_encoder(model, config, device)``; ``trainer.precompute`` runs it."""
    device = torch.device(device)
    pipeline = text_pipeline(model, replace(config, text_embeddings=""), device, **extra)
    truncation_notice_once()
    return functools.partial(model.encode_text, pipeline, config, device)


def text_fingerprint(config: DiffusersModelConfig) -> str:
    """sha256 over what decides the text embeddings of model ``config.name`` without loading a text encoder: the
    text component classes, the config fields of its ``text_settings`` (dtype, max_sequence_length), and per file of
    the text subfolders its name, size and the sha256 of its last MiB (whole configs and tokenizers; weight
    files by a tail of their tensor data, cheap for a 9 GB T5)."""
    model = _model(config)
    digest = hashlib.sha256(
        json.dumps(
            {
                "components": {sub: cls.__name__ for sub, cls in model.text_components.items()},
                "settings": {name: getattr(config, name) for name in model.text_settings},
            },
            sort_keys=True,
        ).encode()
    )
    hash_files(digest, Path(config.path), model.text_components)
    return digest.hexdigest()


class TextEmbeddingStore:
    """Precomputed text embeddings (``python -m trainer.precompute``) in one directory: ``index.json``
    = {"fingerprint": ``text_fingerprint`` of the model, "prompts": {prompt: file}}, and per prompt a
    safetensors file named by the sha256 of the prompt, holding the tensors the adapter caches for it by name.
    ``open`` reads a store for training; ``create`` starts or extends one for ``trainer.precompute``."""

    save_every = INDEX_SAVE_EVERY

    def __init__(self, directory: str, fingerprint: str, files: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.files: dict[str, str] = dict(files or {})
        self._unsaved = 0

    @classmethod
    def open(cls, directory: str, fingerprint: str) -> TextEmbeddingStore:
        """The store in ``directory`` for training; a missing index or another fingerprint is refused."""
        index = read_index(
            f"model.text_embeddings={directory!r}",
            Path(directory) / TEXT_INDEX,
            fingerprint,
            "other text encoders",
            "text encoder files, dtype, max_sequence_length",
            PRECOMPUTE,
        )
        return cls(directory, fingerprint, index["prompts"])

    @classmethod
    def create(cls, directory: str, fingerprint: str) -> TextEmbeddingStore:
        """The store in ``directory`` (created when missing); one of another fingerprint is refused."""
        index = index_to_extend(
            directory,
            TEXT_INDEX,
            fingerprint,
            f"--out {directory!r} holds embeddings of other text encoders or settings; choose another directory",
        )
        return cls(directory, fingerprint, index["prompts"] if index else None)

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts of ``prompts`` that the store lacks, in order."""
        return [p for p in dict.fromkeys(prompts) if p not in self.files]

    def load(self, prompt: str, device: torch.device) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if prompt not in self.files:
            raise ValueError(
                f"prompt {prompt!r} is not in model.text_embeddings={str(self.directory)!r} "
                f"({len(self.files)} prompts); add it to the dataset and rerun {PRECOMPUTE}"
            )
        return load_file(self.directory / self.files[prompt], device=str(device))

    def add(self, prompt: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write the tensors of ``prompt``; the index lists it from the next ``save`` (one every ``save_every``
        additions)."""
        from safetensors.torch import save_file

        name = hashlib.sha256(prompt.encode()).hexdigest() + ".safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, self.directory / name)
        self.files[prompt] = name
        self._unsaved += 1
        if self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        write_index(self.directory / TEXT_INDEX, {"fingerprint": self.fingerprint, "prompts": self.files})
        self._unsaved = 0


class PromptEmbeddings:
    """Text embeddings per prompt (tensor name -> tensor), cached by prompt text: computed by ``encode`` one
    prompt per forward (an embedding must not depend on which prompts it was batched with: the rounding of
    batched matmuls does, and a resumed run would drift from the uninterrupted one), or read from a
    ``TextEmbeddingStore`` when the adapter runs without text encoders."""

    def __init__(
        self,
        encode: Callable[[str], dict[str, torch.Tensor]] | None,
        store: TextEmbeddingStore | None,
        device: torch.device,
    ):
        assert (encode is None) != (store is None)
        self.encode, self.store, self.device = encode, store, device
        self.cache: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, adapter, config: DiffusersModelConfig) -> PromptEmbeddings:
        """From ``config.text_embeddings`` when set (checked against the model's fingerprint), else encoded with
        the ``encode_text`` of model ``config.name`` on the adapter's pipeline."""
        if config.text_embeddings:
            store = TextEmbeddingStore.open(config.text_embeddings, text_fingerprint(config))
            return cls(None, store, adapter.device)
        truncation_notice_once()
        encode_text = _model(config).encode_text
        return cls(lambda p: encode_text(adapter.pipeline, config, adapter.device, p), None, adapter.device)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        for p in sorted({p for p in prompts if p not in self.cache}):
            self.cache[p] = self.store.load(p, self.device) if self.store is not None else self.encode(p)
        return [self.cache[p] for p in prompts]

    def missing(self, prompts: Iterable[str]) -> list[str]:
        """The distinct prompts of ``prompts`` that cannot be encoded: those not in the store read; none when
        the text encoders encode."""
        return self.store.missing(prompts) if self.store is not None else []

    def cat(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Every tensor of ``prompts`` concatenated along the batch dimension."""
        embeds = self(prompts)
        return {name: torch.cat([e[name] for e in embeds]) for name in embeds[0]}

    def clear(self) -> None:
        self.cache.clear()
