"""What the conformance suite does not ask of the HunyuanVideo 1.5 adapter: the video size checks, the refusal of
image inputs and of another variant's folder or a guider it does not reproduce, its two text encoders' embeddings
(template crop, quoted text for ByT5) and their precompute, and the layout of decoded frames."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from tiny_models import tiny_config
from video_checks import video_size_test

from trainer.models import MODELS, build_adapter
from trainer.models.base import ImageInputs

PROMPTS = ["a photo of a cat", 'a sign that says "five"']


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("hunyuan_video15")


@pytest.fixture(scope="module")
def adapter(root):
    return build_adapter(tiny_config("hunyuan_video15", root, dtype="float32"), "cpu")


test_video_sizes_are_checked_as_the_adapter_loads = video_size_test("hunyuan_video15")


def test_an_image_input_is_refused_in_one_line(adapter):
    with pytest.raises(ValueError, match=r"takes no ImageInputs\.image \(it is a text-to-video model\)") as error:
        adapter.encode_prompts(PROMPTS, ImageInputs(image=torch.rand(2, 3, 32, 32)))
    assert "\n" not in str(error.value)


def _copy(root, tmp_path, edit: str, change: dict):
    """The tiny folder copied with ``change`` written into its ``edit`` JSON file."""
    path = tmp_path / "copy"
    shutil.copytree(root / "hunyuan_video15", path)
    file = path / edit
    file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    return dataclasses.replace(tiny_config("hunyuan_video15", root), path=str(path))


@pytest.mark.parametrize(
    ("edit", "change", "message"),
    [
        (
            "model_index.json",
            {"_class_name": "HunyuanVideo15ImageToVideoPipeline"},
            r"image-to-video weights, and model\.name=hunyuan_video15 runs text-to-video .*: point model\.path at",
        ),
        ("transformer/config.json", {"in_channels": 4}, r"a transformer of 4 input channels, .* feeds it 9"),
        ("guider/guider_config.json", {"guidance_rescale": 0.7}, r"configures CFG with .* set guidance_rescale 0"),
    ],
    ids=["image-to-video", "in-channels", "guider"],
)
def test_a_folder_of_another_variant_is_refused_with_its_fix(edit, change, message, root, adapter, tmp_path):
    with pytest.raises(ValueError, match=message):
        build_adapter(_copy(root, tmp_path, edit, change), "cpu")


def test_the_text_is_the_pipelines_two_encoders(adapter):
    """The tiny tokenizer's template spans a few more than the 108 tokens the pipeline crops (Qwen2.5-VL's spans
    108), so each prompt keeps all its tokens; ByT5 reads quoted text only (zeros and an empty mask without); both
    match ``encode_prompt`` of the pipeline."""
    pipeline, crop = adapter.pipeline, adapter.pipeline.prompt_template_encode_start_idx

    def tokens(prompt: str) -> list[int]:
        messages = [{"role": "system", "content": pipeline.system_message}, {"role": "user", "content": prompt}]
        template = pipeline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return pipeline.tokenizer(template)["input_ids"]

    template = pipeline.tokenizer.apply_chat_template(
        [{"role": "system", "content": pipeline.system_message}, {"role": "user", "content": "PROMPT"}],
        tokenize=False,
    )
    assert crop == 108 <= len(pipeline.tokenizer(template[: template.index("PROMPT")])["input_ids"]) <= crop + 8
    plain, quoted = adapter.prompts(PROMPTS)
    assert [int(e["prompt_mask"].sum()) for e in (plain, quoted)] == [len(tokens(p)) - crop for p in PROMPTS]
    assert not plain["prompt_mask_2"].any() and not plain["prompt_embeds_2"].any()
    assert int(quoted["prompt_mask_2"].sum()) == len('Text "five". ') + 1  # its bytes and </s>
    expected = pipeline.encode_prompt(PROMPTS, device="cpu", dtype=torch.float32, batch_size=2)
    got = [torch.cat([plain[k], quoted[k]]) for k in ("prompt_embeds", "prompt_mask")]
    got += [torch.cat([plain[k], quoted[k]]) for k in ("prompt_embeds_2", "prompt_mask_2")]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-6)


def test_precomputed_embeddings_are_the_text_paths_alone(root, adapter, tmp_path):
    """``trainer.precompute``'s encoder (text encoders only: the pipeline itself needs a VAE) gives the adapter's
    embeddings, and an adapter reading them loads no text encoder."""
    from trainer.models.text import TextEmbeddingStore, text_fingerprint

    config = tiny_config("hunyuan_video15", root, dtype="float32")
    encode = MODELS["hunyuan_video15"].prompt_encoder(config, "cpu")
    store = TextEmbeddingStore.create(str(tmp_path / "store"), text_fingerprint(config))
    for prompt in [*PROMPTS, ""]:
        store.add(prompt, encode(prompt))
    store.save()
    stored = build_adapter(dataclasses.replace(config, text_embeddings=str(tmp_path / "store")), "cpu")
    assert stored.pipeline.text_encoder is None and stored.pipeline.text_encoder_2 is None
    for got, want in zip(stored.prompts(PROMPTS), adapter.prompts(PROMPTS), strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_decode_gives_frames_first_and_encode_inverts_its_layout(adapter):
    """The video convention: ``decode`` -> [B, F, C, H, W] in [0, 1], one clip at a time (diffusers' VAE attends
    over one clip only), equal to decoding each clip alone; ``encode_images`` takes that layout."""
    assert adapter.modality == "video" and (adapter.frames, adapter.fps) == (5, 24)
    latents = adapter.prepare_latents(2, torch.Generator().manual_seed(0))
    frames = adapter.decode(latents)
    assert frames.shape == (2, 5, 3, 32, 32) and frames.dtype == torch.float32
    assert 0 <= float(frames.min()) <= float(frames.max()) <= 1
    torch.testing.assert_close(frames[1:], adapter.decode(latents[1:]), rtol=0, atol=0)
    assert adapter.encode_images(frames).shape == (2, *adapter.latent_shape)
