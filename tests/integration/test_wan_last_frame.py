"""Wan image-to-video from a first and a last frame (``ImageInputs.last_image``), as ``WanImageToVideoPipeline(
image=..., last_image=...)`` runs it, beyond what the conformance suite's ``wan_i2v+last`` (a tiny Wan 2.1 FLF2V) and
``wan22_i2v+last`` cases check (parity with the pipeline, on-policy ratio 1, training, save / load, input shapes,
in every dtype): the condition equals the pipeline's ``prepare_latents``, stored latents of a first frame alone
never serve a first+last item, and each misuse of a last frame is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models as testing
import torch
from tiny_models import tiny_config
from tiny_models.wan import CLIP_TOKENS

from trainer import precompute
from trainer.models import build_adapter
from trainer.models.base import ImageInputs
from trainer.models.latents import LatentStore, vae_fingerprint

PROMPTS = ["a photo of a cat", "the digit five"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("wan_last_frame")


@pytest.fixture(scope="module")
def flf2v(root):
    adapter = build_adapter(tiny_config("wan_i2v+last", root, dtype="float32"), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


@pytest.fixture(scope="module")
def wan22_i2v(root):
    adapter = build_adapter(tiny_config("wan22_i2v", root, dtype="float32"), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    return adapter


def first_and_last(adapter, seed: int = 0) -> ImageInputs:
    """Random first and last frames of the tiny model's size, as its ``+last`` variant draws them."""
    return testing.image_inputs(adapter, len(PROMPTS), seed, case=f"{adapter.config.name}+last")


def test_the_condition_is_the_pipelines_first_and_last_frame_latents_and_mask(flf2v):
    """[mask; latents of [first, zeros..., last]] as ``prepare_latents(..., last_image=...)`` makes them (its
    posterior's mode, which the adapter takes), and both frames' CLIP tokens one after the other."""
    inputs = first_and_last(flf2v)
    cond = flf2v.encode_prompts(PROMPTS, inputs)
    p = flf2v.pipeline
    for i in range(len(PROMPTS)):
        _, expected = p.prepare_latents(
            inputs.image[i : i + 1] * 2 - 1,
            1,
            flf2v.vae.config.z_dim,
            flf2v.height,
            flf2v.width,
            flf2v.frames,
            torch.float32,
            "cpu",
            torch.Generator().manual_seed(0),
            last_image=inputs.last_image[i : i + 1] * 2 - 1,
        )
        torch.testing.assert_close(cond.image[i : i + 1], expected, rtol=0, atol=1e-6)
    assert cond.image[:, :4, -1].flatten(1).amax(1).tolist() == [1.0, 1.0]  # the last frame's mask channel
    assert cond.embeds["image_embeds"].shape == (2, 2 * CLIP_TOKENS, 32)


def test_stored_first_frame_latents_never_serve_a_first_and_last_item(wan22_i2v, root, tmp_path):
    """The store keys a VAE input by its bytes: [first, zeros...] and [first, zeros..., last] are two inputs, so
    a store written for first frames alone misses every first+last item (and encodes it), and one written for
    first+last items serves them."""
    config = wan22_i2v.config
    both = first_and_last(wan22_i2v)
    first = dataclasses.replace(both, last_image=None)
    store = LatentStore.create(str(tmp_path / "first"), vae_fingerprint(config))
    precompute.write_latents(build_adapter(config, "cpu"), store, [(PROMPTS, first)])
    reading = build_adapter(dataclasses.replace(config, image_latents=str(tmp_path / "first")), "cpu")
    cond = reading.encode_prompts(PROMPTS, both)
    assert (reading.image_latents.hits, reading.image_latents.misses) == (0, 2)
    assert torch.equal(cond.image, wan22_i2v.encode_prompts(PROMPTS, both).image)
    assert not torch.equal(cond.image, wan22_i2v.encode_prompts(PROMPTS, first).image)

    store = LatentStore.create(str(tmp_path / "both"), vae_fingerprint(config))
    precompute.write_latents(build_adapter(config, "cpu"), store, [(PROMPTS, both)])
    reading = build_adapter(dataclasses.replace(config, image_latents=str(tmp_path / "both")), "cpu")
    assert torch.equal(reading.encode_prompts(PROMPTS, both).image, cond.image)
    assert (reading.image_latents.hits, reading.image_latents.misses) == (2, 0)


def test_a_last_image_where_it_cannot_be_used_is_refused(wan22_i2v, flf2v, root):
    """Each message in full (the conformance suite checks that a last frame without a first, or of another shape,
    is refused naming it), and the models that take no last frame or need one."""
    both = first_and_last(wan22_i2v)
    with pytest.raises(ValueError, match=r"last_image is \(2, 3, 16, 16\) and ImageInputs\.image \(2, 3, 32, 32\)"):
        wan22_i2v.encode_prompts(PROMPTS, dataclasses.replace(both, last_image=both.last_image[..., ::2, ::2]))
    with pytest.raises(ValueError, match=r"FLF2V\) transformer \(pos_embed_seq_len=34\): give ImageInputs\.last_"):
        flf2v.encode_prompts(PROMPTS, dataclasses.replace(both, last_image=None))
    i2v = build_adapter(tiny_config("wan_i2v", root, dtype="float32"), "cpu")
    with pytest.raises(ValueError, match=r"one frame's CLIP tokens .*: point model\.path at a Wan 2\.1 FLF2V"):
        i2v.encode_prompts(PROMPTS, both)
    ti2v = build_adapter(tiny_config("wan_ti2v", root), "cpu")
    last = torch.rand(2, 3, ti2v.height, ti2v.width)
    with pytest.raises(ValueError, match=r"the wan_ti2v adapter takes no ImageInputs\.last_image \(it uses image\)"):
        ti2v.encode_prompts(PROMPTS, ImageInputs(image=last, last_image=last))
    t2v = build_adapter(tiny_config("wan", root), "cpu")
    with pytest.raises(ValueError, match=r"takes no ImageInputs\.last_image \(it is a text-to-video model\)"):
        t2v.encode_prompts(PROMPTS, ImageInputs(last_image=both.last_image))
