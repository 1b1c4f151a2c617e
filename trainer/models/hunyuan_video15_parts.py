"""HunyuanVideo 1.5's image-to-video conditioning (registry data, ``ModelSpec.parts``): the first frame VAE-encoded
as condition channels with their mask, and its SigLIP tokens as the transformer's image embeddings, as
``HunyuanVideo15ImageToVideoPipeline`` builds them (trainer/models/hunyuan_video15.py is the adapter). A
``model.image_latents`` store holds both: the latents as every image-conditioned model's, the tokens beside them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.models.base import ImageInputs
from trainer.models.inputs import VIDEO_SIZE, as_8bit, require_image_input
from trainer.models.latents import LATENT_INDEX, PRECOMPUTE_LATENTS, LatentStore, vae_input_key
from trainer.models.stores import hash_files, index_to_extend, read_index

TOKENS = "image_embeds"
"""The subfolder of a ``model.image_latents`` store that holds the first frames' SigLIP tokens."""


@dataclass(frozen=True)
class FirstFrame:
    """The first frame (``ImageInputs.image`` [B, 3, H, W] at the video's size) as the image-to-video pipeline
    conditions on it, taken as the 8-bit picture the pipeline is given: its VAE latents (posterior mean times the
    scaling factor) on the first latent frame of C condition channels, zeros after it, and a mask channel that is 1
    there, concatenated to the latents at every forward; and SigLIP's last hidden states of the picture as
    ``image_embeds``, which every text token sequence of the transformer attends to."""

    fields = ("image",)
    encodes_text = False
    reads_trajectory = False

    def components(self, path: Path, dtype: torch.dtype, device: torch.device) -> dict:
        """The pipeline's ``image_encoder`` (SiglipVisionModel, frozen) and ``feature_extractor``."""
        from transformers import SiglipImageProcessor, SiglipVisionModel

        encoder = SiglipVisionModel.from_pretrained(path, subfolder="image_encoder", torch_dtype=dtype).to(device)
        processor = SiglipImageProcessor.from_pretrained(path, subfolder="feature_extractor")
        return {"image_encoder": encoder.requires_grad_(False).eval(), "feature_extractor": processor}

    @torch.no_grad()
    def encode(self, adapter, batch_size: int, inputs: ImageInputs | None) -> dict[str, torch.Tensor]:
        """``image``: the first frame's latents [B, C, 1, h, w], float32 (the VAE's dtype's values); ``image_embeds``
        (an entry of ``Conditioning.embeds``): its SigLIP tokens [B, N, D] in the weights' dtype."""
        size = (adapter.height, adapter.width)
        because = "it generates the video from that first frame"
        image = require_image_input(
            adapter.config.name, inputs, "image", batch_size, 3, size, because=because, sized_by=VIDEO_SIZE
        )
        pictures = as_8bit(image)
        pixels = (pictures.to(adapter.device, torch.float32) / 255.0).permute(0, 3, 1, 2) * 2.0 - 1.0
        posterior = adapter.image_latents(pixels.to(adapter.vae.dtype)[:, :, None])
        latents = (posterior.mode() * adapter.vae.config.scaling_factor).float()
        store, record = token_store(adapter), adapter.image_latents.record
        tokens = siglip_tokens(adapter.pipeline, pictures, adapter.device, store, record)
        return {"image": latents, "image_embeds": tokens}

    def join(self, adapter, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """The condition channels [B, C + 1, F, h, w] and image embeddings [B, N, D], in the weights' dtype."""
        if cond.image is None:
            raise ValueError(f"{adapter.config.name} needs Conditioning.image: encode prompts with ImageInputs.image")
        first = cond.image.to(adapter.dtype)
        n, channels, _, h, w = first.shape
        frames = adapter.latent_shape[1]
        condition = torch.cat([first, first.new_zeros(n, channels, frames - 1, h, w)], dim=2)
        mask = first.new_zeros(n, 1, frames, h, w)
        mask[:, :, 0] = 1
        return torch.cat([condition, mask], dim=1), cond.embeds["image_embeds"].to(adapter.dtype)


def siglip_tokens(
    pipeline, pictures: torch.Tensor, device: torch.device, store: LatentStore | None = None, record: bool = False
) -> torch.Tensor:
    """``HunyuanVideo15ImageToVideoPipeline._get_image_embeds`` of each picture (uint8 [B, H, W, 3]): SigLIP's last
    hidden states [B, N, D] in the weights' dtype, one forward per distinct picture, so that a row's tokens do not
    depend on its batch-mates (batched matmuls round differently); read from ``store`` where it holds them, added to
    it with ``record``."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline as Pipeline
    from PIL import Image

    dtype = pipeline.transformer.dtype
    seen: dict[str, torch.Tensor] = {}
    for picture in pictures:
        key = vae_input_key(picture)
        if key in seen:
            continue
        if store is not None and key in store:
            seen[key] = store.load(key, device)
            continue
        image = Image.fromarray(picture.numpy())
        seen[key] = Pipeline._get_image_embeds(pipeline.image_encoder, pipeline.feature_extractor, image, device)
        if record:
            store.add(key, seen[key])
    if record:
        store.save()
    return torch.cat([seen[vae_input_key(picture)].to(dtype) for picture in pictures])


def token_fingerprint(config) -> str:
    """sha256 over what decides a picture's SigLIP tokens: the files of image_encoder/ and feature_extractor/, and
    ``dtype``."""
    digest = hashlib.sha256(json.dumps({"dtype": config.dtype}).encode())
    hash_files(digest, Path(config.path), ["image_encoder", "feature_extractor"])
    return digest.hexdigest()


def token_store(adapter) -> LatentStore | None:
    """The SigLIP tokens' store (``TOKENS``) beside the adapter's latent store: written where the latents are being
    written (``trainer.precompute --latents``), read where they are read; None without a latent store or where it
    holds no tokens. Kept on the adapter while its ``image_latents`` stays the same."""
    latents = adapter.image_latents
    cached = getattr(adapter, "_token_store", None)
    if cached is not None and cached[0] is latents:
        return cached[1]
    store = None
    if latents.store is not None:
        directory = latents.store.directory / TOKENS
        fingerprint = token_fingerprint(adapter.config)
        if latents.record:
            refusal = f"{directory} holds SigLIP tokens of another image encoder or dtype: choose another --latents"
            index = index_to_extend(str(directory), LATENT_INDEX, fingerprint, refusal)
            store = LatentStore(str(directory), fingerprint, index["keys"] if index else ())
        elif (directory / LATENT_INDEX).is_file():
            setting, covers = f"model.image_latents={str(latents.store.directory)!r}", "image_encoder, dtype"
            index = read_index(
                setting, directory / LATENT_INDEX, fingerprint, "another image encoder", covers, PRECOMPUTE_LATENTS
            )
            store = LatentStore(str(directory), fingerprint, index["keys"])
    adapter._token_store = (latents, store)
    return store


FIRST_FRAME = FirstFrame()
"""HunyuanVideo 1.5 I2V (480p, 720p): the first frame as condition channels and SigLIP tokens."""
