"""The plain diffusers side of bench/adapters.py's rollout column where a pipeline cannot run as is: what it
runs instead, so that both sides do the same work (sampling, then decoding the video)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

ONE_CLIP_VAES = ("hunyuan_video15",)
"""VAEs failing on a batch of clips (HunyuanVideo 1.5's in diffusers 0.42.1, as our adapter's decode says): the
plain side samples latents with the pipeline and decodes them per clip, with the steps of the pipeline's decode."""


def output_type(adapter, name: str) -> str:
    """What the plain pipeline returns: latents where it has no VAE or decodes here (``decoded``), else images."""
    return "latent" if adapter.vae is None or name in ONE_CLIP_VAES else "pt"


def decoded(pipeline, name: str, out: torch.Tensor) -> torch.Tensor:
    """``out`` of the pipeline, decoded per clip where its VAE takes one clip at a time."""
    if name not in ONE_CLIP_VAES:
        return out
    vae = pipeline.vae
    clips = [vae.decode(x[None].to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0] for x in out]
    return pipeline.video_processor.postprocess_video(torch.cat(clips), output_type="pt")


@contextlib.contextmanager
def stand_ins(pipeline, name: str) -> Iterator[None]:
    """LTX-2's pipeline also decodes its audio latents to a mel spectrogram and vocodes it, where our adapter
    leaves the untrained audio as latents (and a video-only folder has no vocoder): both stood in by identities."""
    with contextlib.ExitStack() as stack:
        if name == "ltx2":
            stack.enter_context(mock.patch.object(pipeline, "vocoder", lambda mel: mel))
            stack.enter_context(mock.patch.object(pipeline.audio_vae, "decode", lambda z, return_dict=False: (z,)))
        yield
