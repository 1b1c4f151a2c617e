"""Qwen-Image's inpainting and editing adapters beyond the conformance suite (which covers their parity with
the pipelines, on-policy ratios, training, save/load and input checks): inpainting's known region is not the
policy's (its velocity points at the source latents, without gradient), and editing's text embeddings read
the image to edit, so that a store of prompt embeddings is refused with a message naming what works;
editing-plus reads every reference and runs 2511's transformer as well."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import tiny_models as testing
import torch
from tiny_models import tiny_config

from trainer.models import MODELS, build_adapter
from trainer.models.ip_adapter import IPAdapterSettings
from trainer.rollout import SamplerSettings, rollout

PROMPTS = ["a photo of a cat", "the digit five"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen_variants")


def test_inpainting_velocity_outside_the_mask_points_at_the_source_without_gradient(root):
    adapter = build_adapter(tiny_config("qwen_image_inpaint", root, dtype="float32"), "cpu")
    cond = adapter.encode_prompts(PROMPTS, testing.image_inputs(adapter, len(PROMPTS)))
    assert cond.mask.any() and not cond.mask.all()
    x = adapter.prepare_latents(len(PROMPTS), torch.Generator().manual_seed(0))
    sigma = adapter.sigmas(3)[1].expand(len(PROMPTS))
    v = adapter.predict(adapter.denoiser, x, sigma, cond, 3.0)
    known = ~cond.mask
    assert torch.equal(v[known], ((x - cond.image) / sigma.view(-1, 1, 1))[known])
    params = [p for p in adapter.denoiser.parameters() if p.requires_grad]
    outside = torch.autograd.grad(v[known].square().sum(), params, retain_graph=True, allow_unused=True)
    assert all(g is None or not g.any() for g in outside)
    inside = torch.autograd.grad(v[cond.mask].square().sum(), params, allow_unused=True)
    assert any(g is not None and g.any() for g in inside)


def test_inpainting_loads_qwen_images_own_directory_without_a_warning(root, caplog):
    """Qwen-Image's weights are the inpainting adapter's (its pipeline has none of its own)."""
    config = dataclasses.replace(tiny_config("qwen_image_inpaint", root), path=tiny_config("qwen_image", root).path)
    build_adapter(config, "cpu")
    assert "model_index.json" not in caplog.text


def test_edit_text_reads_the_image_to_edit(root):
    adapter = build_adapter(tiny_config("qwen_image_edit", root, dtype="float32"), "cpu")
    first, second = (testing.image_inputs(adapter, 1, seed=s) for s in (0, 1))
    same = dataclasses.replace(first, reference=first.reference.expand(2, -1, -1, -1))
    both = dataclasses.replace(first, reference=torch.cat([first.reference, second.reference]))
    a, b = adapter.encode_prompts(PROMPTS[:1] * 2, same), adapter.encode_prompts(PROMPTS[:1] * 2, both)
    for name in ("prompt_embeds", "negative_embeds"):
        assert torch.equal(a.embeds[name][0], a.embeds[name][1])
        assert torch.equal(a.embeds[name][0], b.embeds[name][0]) and not torch.equal(
            b.embeds[name][0], b.embeds[name][1]
        )
    assert not torch.equal(a.embeds["prompt_embeds"], a.embeds["negative_embeds"])


def test_edit_refuses_a_prompt_store_and_an_ip_adapter(root):
    config = tiny_config("qwen_image_edit", root)
    with pytest.raises(ValueError, match=r"model\.text_embeddings .* depend on the image to edit.*unset it"):
        dataclasses.replace(config, text_embeddings=str(root))
    with pytest.raises(ValueError, match=r"model\.ip_adapter .*unset it"):
        dataclasses.replace(config, ip_adapter=IPAdapterSettings(image_encoder=str(root)))
    with pytest.raises(ValueError, match=r"nothing to precompute with --out.*--latents"):
        MODELS["qwen_image_edit"].prompt_encoder(config, "cpu")


def test_edit_plus_reads_every_reference(root):
    """Qwen-Image-Edit-Plus: the second reference changes the text embeddings (the encoder reads it as
    "Picture 2") and the transformer's reference tokens (appended after the first's); one reference alone
    ([B, 3, H, W]) works; too many references, or several for qwen_image_edit, name the count it takes."""
    adapter = build_adapter(tiny_config("qwen_image_edit_plus", root, dtype="float32"), "cpu")
    inputs = testing.image_inputs(adapter, 1)
    assert inputs.reference.shape[1] == 2
    other = inputs.reference.clone()
    other[:, 1] = 1 - other[:, 1]
    a = adapter.encode_prompts(PROMPTS[:1], inputs)
    b = adapter.encode_prompts(PROMPTS[:1], dataclasses.replace(inputs, reference=other))
    tokens = adapter.latent_shape[0]
    assert a.reference.shape[1] == 2 * tokens
    assert torch.equal(a.reference[:, :tokens], b.reference[:, :tokens])
    assert not torch.equal(a.reference[:, tokens:], b.reference[:, tokens:])
    assert not torch.equal(a.embeds["prompt_embeds"], b.embeds["prompt_embeds"])
    one = adapter.encode_prompts(PROMPTS[:1], dataclasses.replace(inputs, reference=inputs.reference[:, 0]))
    assert one.reference.shape[1] == tokens and torch.equal(one.reference, a.reference[:, :tokens])
    with pytest.raises(ValueError, match=r"ImageInputs\.reference holds 5 images per item; .* takes 1 to 4"):
        adapter.encode_prompts(PROMPTS[:1], dataclasses.replace(inputs, reference=inputs.reference[:, [0] * 5]))
    edit = build_adapter(tiny_config("qwen_image_edit", root, dtype="float32"), "cpu")
    with pytest.raises(ValueError, match=r"holds 2 images per item; the qwen_image_edit adapter takes one"):
        edit.encode_prompts(PROMPTS[:1], inputs)


def test_edit_plus_runs_2511s_transformer(root, tmp_path):
    """Qwen-Image-Edit-2511's transformer (``zero_cond_t``: the reference tokens modulated at timestep 0) reads
    the same img_shapes: a rollout at noise level 0 equals its pipeline."""
    config = tiny_config("qwen_image_edit_plus", root, dtype="float32")
    shutil.copytree(config.path, tmp_path / "2511")
    saved = tmp_path / "2511" / "transformer" / "config.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "zero_cond_t": True}))
    adapter = build_adapter(dataclasses.replace(config, path=str(tmp_path / "2511")), "cpu")
    adapter.pipeline.set_progress_bar_config(disable=True)
    assert adapter.denoiser.config.zero_cond_t
    inputs = testing.image_inputs(adapter, len(PROMPTS))
    settings = SamplerSettings(num_steps=3, guidance_scale=3.0, noise_level=0.0)
    ro = rollout(
        adapter, adapter.denoiser, PROMPTS, torch.arange(2), settings, torch.Generator().manual_seed(0), inputs
    )
    expected = testing.run_pipeline(adapter, PROMPTS, inputs, 3, 3.0, torch.Generator().manual_seed(0))
    torch.testing.assert_close(ro.latents[:, -1], expected.float(), rtol=0, atol=1e-5)
