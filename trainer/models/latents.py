"""VAE posteriors of per-item image inputs, computed per distinct input or read from a precomputed store."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from trainer.models.common import DiffusersModelConfig
from trainer.models.stores import INDEX_SAVE_EVERY, hash_files, index_to_extend, read_index, write_index

LATENT_INDEX = "index.json"
PRECOMPUTE_LATENTS = "python -m trainer.precompute --config CONFIG.yaml --latents DIR"
logger = logging.getLogger("rewardflow.latents")


def vae_fingerprint(config: DiffusersModelConfig) -> str:
    """sha256 over what decides a VAE posterior besides the VAE input itself (which keys the store): the
    files of ``vae/`` (its class and config included; hashed as ``text_fingerprint`` hashes files), ``dtype``
    and ``resolution``. The resolution changes only the inputs, so a store of another resolution would just
    miss every input; it is in the fingerprint to refuse such a store instead."""
    digest = hashlib.sha256(json.dumps({"dtype": config.dtype, "resolution": config.resolution}).encode())
    hash_files(digest, Path(config.path), ["vae"])
    return digest.hexdigest()


def vae_input_key(x: torch.Tensor) -> str:
    """sha256 of one VAE input (a CPU tensor): its dtype, shape and bytes."""
    digest = hashlib.sha256(f"{x.dtype}{tuple(x.shape)}".encode())
    digest.update(x.contiguous().flatten().view(torch.uint8).numpy())
    return digest.hexdigest()


class LatentStore:
    """Precomputed VAE posteriors (``python -m trainer.precompute --latents DIR``) in one directory:
    ``index.json`` = {"fingerprint": ``vae_fingerprint`` of the model, "keys": [...]}, and per VAE input a
    safetensors file named by its ``vae_input_key``, holding ``parameters``: the posterior's mean and
    log-variance as the VAE returns them, so that its mode and a sample of it both equal the live ones.
    ``open`` reads a store for training; ``create`` starts or extends one for ``trainer.precompute``."""

    save_every = INDEX_SAVE_EVERY

    def __init__(self, directory: str, fingerprint: str, keys: Iterable[str] = ()):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.keys = set(keys)
        self._unsaved = 0

    @classmethod
    def open(cls, directory: str, fingerprint: str) -> LatentStore:
        """The store in ``directory`` for training; a missing index or another fingerprint is refused."""
        index = read_index(
            f"model.image_latents={directory!r}",
            Path(directory) / LATENT_INDEX,
            fingerprint,
            "another VAE",
            "VAE files, dtype, resolution",
            PRECOMPUTE_LATENTS,
        )
        return cls(directory, fingerprint, index["keys"])

    @classmethod
    def create(cls, directory: str, fingerprint: str) -> LatentStore:
        """The store in ``directory`` (created when missing); one of another fingerprint is refused."""
        index = index_to_extend(
            directory,
            LATENT_INDEX,
            fingerprint,
            f"--latents {directory!r} holds latents of another VAE or settings; choose another directory",
        )
        return cls(directory, fingerprint, index["keys"] if index else ())

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def load(self, key: str, device: torch.device) -> torch.Tensor:
        """The parameters of input ``key``, [1, 2C, ...] on ``device``."""
        from safetensors.torch import load_file

        return load_file(self.directory / f"{key}.safetensors", device=str(device))["parameters"][None]

    def add(self, key: str, parameters: torch.Tensor) -> None:
        """Write the parameters [1, 2C, ...] of input ``key``; the index lists it from the next ``save`` (one
        every ``save_every`` additions)."""
        from safetensors.torch import save_file

        save_file({"parameters": parameters[0].detach().cpu().contiguous()}, self.directory / f"{key}.safetensors")
        self.keys.add(key)
        self._unsaved += 1
        if self._unsaved >= self.save_every:
            self.save()

    def save(self) -> None:
        write_index(self.directory / LATENT_INDEX, {"fingerprint": self.fingerprint, "keys": sorted(self.keys)})
        self._unsaved = 0


def refuse_image_latents(model: str, config: DiffusersModelConfig) -> None:
    """ValueError when ``model.image_latents`` is set for an adapter that VAE-encodes no image input."""
    if config.image_latents:
        raise ValueError(f"model.image_latents is set, but the {model} adapter VAE-encodes no image input: unset it")


class ImageLatents:
    """VAE posteriors of image inputs: for a batch ``x`` of VAE inputs, what ``vae.encode(x).latent_dist``
    gives, but computed per distinct input, each in its own forward. A group's repeats of an item are
    encoded once, and an input's latents do not depend on its batch-mates (the rounding of batched
    convolutions can), so a store hit equals the live encode bit for bit and a resumed run the uninterrupted
    one. Inputs in ``store`` are read from it, the others encoded, and with ``record`` added to it (what
    ``trainer.precompute`` does). ``hits`` and ``misses`` count the inputs read and encoded (a repeat
    within a call counts once); a training run's first miss logs a warning."""

    def __init__(self, vae: nn.Module, store: LatentStore | None, record: bool = False):
        assert store is not None or not record
        self.vae, self.store, self.record = vae, store, record
        self.hits = self.misses = 0

    @classmethod
    def of(cls, vae: nn.Module, config: DiffusersModelConfig) -> ImageLatents:
        """Reading ``config.image_latents`` when set (checked against the model's ``vae_fingerprint``)."""
        if not config.image_latents:
            return cls(vae, None)
        return cls(vae, LatentStore.open(config.image_latents, vae_fingerprint(config)))

    @torch.no_grad()
    def __call__(self, x: torch.Tensor):
        """The posterior (a diffusers ``DiagonalGaussianDistribution``) of VAE inputs ``x`` [B, ...] (on the
        VAE's device, in its dtype)."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        keys = [vae_input_key(row) for row in x.detach().cpu()]
        parameters: dict[str, torch.Tensor] = {}
        for key, row in zip(keys, x, strict=True):
            if key in parameters:
                continue
            if self.store is not None and key in self.store:
                parameters[key] = self.store.load(key, x.device)
                self.hits += 1
                continue
            parameters[key] = self.vae.encode(row[None]).latent_dist.parameters
            self.misses += 1
            if self.record:
                self.store.add(key, parameters[key])
            elif self.store is not None and self.misses == 1:
                logger.warning(
                    "an image input is not in model.image_latents=%s: VAE-encoding it (and any other "
                    "missing one); rerun %s to include the dataset's current images",
                    self.store.directory,
                    PRECOMPUTE_LATENTS,
                )
        return DiagonalGaussianDistribution(torch.cat([parameters[key] for key in keys]))
