"""What the conformance suite does not ask of the HunyuanVideo 1.5 adapter: the video size checks, the refusal of
image inputs and of another variant's folder or a guider it does not reproduce, its two text encoders' embeddings
(template crop, quoted text for ByT5) and their precompute, and the layout of decoded frames; for image-to-video,
its first frame's checks, latents and SigLIP tokens, and both stores (text embeddings, first-frame latents)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_config, write_text_store
from video_checks import video_size_test

from trainer.models import build_adapter
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
            r"image-to-video weights, and model\.name=hunyuan_video15 runs text-to-video: set "
            r"model\.name=hunyuan_video15_i2v, or point model\.path at",
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
    config = tiny_config("hunyuan_video15", root, dtype="float32")
    write_text_store(config, tmp_path / "store", [*PROMPTS, ""])
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


# --- image-to-video ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def i2v(root):
    return build_adapter(tiny_config("hunyuan_video15_i2v", root, dtype="float32"), "cpu")


def _raises_one_line(call, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        call()
    assert "\n" not in str(error.value)


def test_the_first_frame_is_checked_in_one_line(i2v):
    frame = torch.rand(2, 3, 32, 32)
    _raises_one_line(
        lambda: i2v.encode_prompts(PROMPTS),
        r"needs ImageInputs\.image .* because it generates the video from that first frame; none was given",
    )
    _raises_one_line(
        lambda: i2v.encode_prompts(PROMPTS, ImageInputs(image=frame[..., :16, :16])),
        r"ImageInputs\.image is \(16, 16\) pixels; .* generates \(32, 32\) \(model\.height x model\.width\): give it "
        r"that size \(data\.image_size",
    )
    _raises_one_line(lambda: i2v.encode_prompts(PROMPTS, ImageInputs(image=frame[:1])), r"expects \[2, 3, H, W\]")
    _raises_one_line(
        lambda: i2v.encode_prompts(PROMPTS, ImageInputs(image=frame, mask=frame[:, :1])),
        r"takes no ImageInputs\.mask \(it uses image\)",
    )


def _copy_of(name: str, root, tmp_path, edit: str = "", change: dict | None = None, drop: str = ""):
    """The tiny folder of ``name`` copied, with ``change`` written into its ``edit`` JSON file, ``drop`` removed."""
    path = tmp_path / "copy"
    shutil.copytree(root / name, path)
    if edit:
        file = path / edit
        file.write_text(json.dumps({**json.loads(file.read_text()), **change}))
    if drop:
        shutil.rmtree(path / drop) if (path / drop).is_dir() else (path / drop).unlink()
    return dataclasses.replace(tiny_config(name, root), path=str(path))


@pytest.mark.parametrize(
    ("edit", "change", "drop", "message"),
    [
        (
            "model_index.json",
            {"_class_name": "HunyuanVideo15Pipeline"},
            "",
            r"text-to-video weights, and model\.name=hunyuan_video15_i2v runs image-to-video: set "
            r"model\.name=hunyuan_video15, or point model\.path at",
        ),
        (
            "transformer/config.json",
            {"task_type": "t2v"},
            "model_index.json",
            r"text-to-video weights, .* set model\.name=hunyuan_video15,",
        ),
        (
            "transformer/config.json",
            {"use_meanflow": True},
            "",
            r"a step-distilled transformer \(use_meanflow\), .*: point model\.path at .* without use_meanflow",
        ),
        ("", None, "image_encoder", r"holds no image_encoder/, which .* reads its first frame with: point model\.path"),
    ],
    ids=["t2v-pipeline", "t2v-task-type", "meanflow", "no-image-encoder"],
)
def test_an_image_to_video_folder_it_cannot_run_is_refused(edit, change, drop, message, root, i2v, tmp_path):
    config = _copy_of("hunyuan_video15_i2v", root, tmp_path, edit, change, drop)
    _raises_one_line(lambda: build_adapter(config, "cpu"), message)


def test_the_first_frame_is_the_pipelines_condition_and_siglip_tokens(i2v):
    """The condition channels and image embeddings of each row equal the pipeline's ``prepare_cond_latents_and_mask``
    and ``encode_image`` of the frame as the 8-bit picture it takes; the tokens are not zero (the transformer
    attends to them)."""
    from PIL import Image

    from trainer.models.inputs import as_8bit

    frames = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    cond = i2v.encode_prompts(PROMPTS, ImageInputs(image=frames))
    channels, embeds = i2v.first_frame.join(i2v, cond)
    pipeline, noise = i2v.pipeline, i2v.prepare_latents(1, torch.Generator().manual_seed(0))
    for i, picture in enumerate(as_8bit(frames)):
        picture = Image.fromarray(picture.numpy())
        latents, mask = pipeline.prepare_cond_latents_and_mask(noise, picture, 1, 32, 32, torch.float32, "cpu")
        assert torch.equal(channels[i : i + 1], torch.cat([latents, mask], dim=1))
        assert torch.equal(embeds[i : i + 1], pipeline.encode_image(picture, 1, "cpu", torch.float32))
    assert embeds.shape == (2, 16, 24) and embeds.abs().min() > 0


def test_an_image_to_video_run_reads_precomputed_text_latents_and_siglip_tokens(root, i2v, tmp_path):
    """With ``model.text_embeddings`` (no text encoder loaded) and ``model.image_latents`` (written by
    ``trainer.precompute``'s ``write_latents``: the first frames' latents, their SigLIP tokens beside them), the
    conditioning is bit for bit the one encoded live, and neither the VAE nor the SigLIP tower runs; a frame not in
    the store is encoded by both."""
    from trainer.models.latents import LatentStore, vae_fingerprint
    from trainer.precompute import write_latents

    config = tiny_config("hunyuan_video15_i2v", root, dtype="float32")
    write_text_store(config, tmp_path / "text", [*PROMPTS, ""])
    inputs = ImageInputs(image=torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
    writing = build_adapter(config, "cpu")
    write_latents(writing, LatentStore.create(str(tmp_path / "latents"), vae_fingerprint(config)), [(PROMPTS, inputs)])
    stores = dict(text_embeddings=str(tmp_path / "text"), image_latents=str(tmp_path / "latents"))
    stored = build_adapter(dataclasses.replace(config, **stores), "cpu")
    assert stored.pipeline.text_encoder is None and stored.pipeline.image_encoder is not None
    towers = []
    stored.pipeline.image_encoder.register_forward_hook(lambda *_: towers.append(1))
    got, want = stored.encode_prompts(PROMPTS, inputs), i2v.encode_prompts(PROMPTS, inputs)
    assert (stored.image_latents.hits, stored.image_latents.misses, len(towers)) == (2, 0, 0)
    assert got.embeds.keys() == want.embeds.keys() and all(
        torch.equal(got.embeds[k], want.embeds[k]) for k in got.embeds
    )
    assert torch.equal(got.image, want.image)
    new = ImageInputs(image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)))
    got, want = stored.encode_prompts(PROMPTS[:1], new), i2v.encode_prompts(PROMPTS[:1], new)
    assert (stored.image_latents.misses, len(towers)) == (1, 1)
    assert torch.equal(got.embeds["image_embeds"], want.embeds["image_embeds"]) and torch.equal(got.image, want.image)


def test_siglip_tokens_of_another_image_encoder_are_refused(root, tmp_path):
    """A store whose SigLIP tokens were computed with other image-encoder files (here another processor setting)
    is refused as the first frame is encoded, naming the precompute command."""
    from trainer.models.latents import LatentStore, vae_fingerprint
    from trainer.precompute import write_latents

    config = _copy_of("hunyuan_video15_i2v", root, tmp_path)
    inputs = ImageInputs(image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)))
    store = LatentStore.create(str(tmp_path / "latents"), vae_fingerprint(config))
    write_latents(build_adapter(config, "cpu"), store, [(PROMPTS[:1], inputs)])
    processor = Path(config.path) / "feature_extractor" / "preprocessor_config.json"
    processor.write_text(json.dumps({**json.loads(processor.read_text()), "resample": 2}))
    reading = build_adapter(dataclasses.replace(config, image_latents=str(tmp_path / "latents")), "cpu")
    _raises_one_line(
        lambda: reading.encode_prompts(PROMPTS[:1], inputs),
        r"model\.image_latents=.* was computed for another image encoder or settings .*trainer\.precompute",
    )
