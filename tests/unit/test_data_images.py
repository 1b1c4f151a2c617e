"""Image datasets on real files written with PIL: the inpainting jsonl, the editing jsonl and the IP-Adapter
triplet folder give the right pixels, masks, crops and reward metadata, and every kind of bad row stops the
task's construction with the file and line named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_data import half_mask, solid, tiny_dataset, write_triplet_folder

from reward_server.scorers.ocr import crop_to_mask
from trainer.config import DataConfig
from trainer.data import DATASETS, build_task
from trainer.data.edit_jsonl import read_edit_jsonl
from trainer.data.inpaint_jsonl import read_inpaint_jsonl
from trainer.data.triplet_folder import parse_line, read_triplet_folder

SIZE = 8


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_inpaint_rows_give_source_mask_and_reward_metadata(tmp_path):
    solid(tmp_path / "a" / "red.png", (24, 16), (255, 0, 0))  # not square: resized to SIZE x SIZE
    half_mask(tmp_path / "a" / "red_mask.png", (24, 16))
    green = solid(tmp_path / "elsewhere" / "green.png", (12, 12), (0, 255, 0))
    half_mask(tmp_path / "elsewhere" / "green_mask.png", (12, 12))
    rows = [
        {
            "image_path": "a/red.png",
            "mask_path": "a/red_mask.png",
            "prompt": 'a sign saying "OPEN 24h"',
            "t5_embedding_path": "a/never_read.pt",
            "judge_task": "text",
        },
        {
            "image_path": str(green.resolve()),
            "mask_path": str(green.with_name("green_mask.png").resolve()),
            "prompt": "a green field",
        },
    ]
    task = read_inpaint_jsonl(str(_jsonl(tmp_path / "rows.jsonl", rows)), SIZE)
    assert task.prompts == ['a sign saying "OPEN 24h"', "a green field"] and task.eval_indices == [0, 1]

    inputs = task.inputs([1, 0, 0])
    assert inputs.image.shape == (3, 3, SIZE, SIZE) and inputs.mask.shape == (3, 1, SIZE, SIZE)
    assert inputs.reference is None and inputs.style is None
    assert torch.allclose(inputs.image[1], torch.tensor([1.0, 0, 0]).view(3, 1, 1))
    assert torch.allclose(inputs.image[0], torch.tensor([0, 1.0, 0]).view(3, 1, 1))
    assert set(inputs.mask.unique().tolist()) == {0.0, 1.0}
    assert inputs.mask[:, :, :, SIZE // 2 :].eq(1).all() and inputs.mask[:, :, :, : SIZE // 2].eq(0).all()

    meta = task.item_metadata([0, 1])
    assert meta[0]["text"] == "OPEN 24h" and meta[0]["judge_task"] == "text" and "text" not in meta[1]
    assert not {"prompt", "image_path", "mask_path", "t5_embedding_path"} & set(meta[0])
    mask = meta[0]["mask"]
    assert mask.dtype == np.uint8 and mask.shape == (SIZE, SIZE, 1) and set(np.unique(mask)) == {0, 255}
    # the OCR scorer reads only the repainted region: the right half of the generated image
    generated = np.arange(SIZE * SIZE * 3, dtype=np.uint8).reshape(SIZE, SIZE, 3)
    assert np.array_equal(crop_to_mask(generated, mask), generated[:, SIZE // 2 :])

    batch = task.supervised_batch(5, torch.Generator().manual_seed(0))
    assert batch.images.shape == (5, 3, SIZE, SIZE) and len(batch.prompts) == 5
    assert torch.equal(batch.images, batch.inputs.image)  # the target is the source inside the mask
    for image, prompt in zip(batch.images, batch.prompts, strict=True):
        assert torch.equal(image, inputs.image[1 if prompt.startswith("a sign") else 0])


def test_rows_sharing_a_prompt_keep_their_own_masks(tmp_path):
    """Metadata is looked up by item, not by prompt: two rows with one prompt send different masks."""
    path = Path(tiny_dataset("inpaint_jsonl", tmp_path, SIZE))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    mask = Image.new("L", (SIZE, SIZE), 0)
    mask.paste(255, (0, 0, SIZE, SIZE // 2))  # the top half instead of the right half
    mask.save(tmp_path / "top.png")
    rows[1].update(prompt=rows[0]["prompt"], mask_path=str(tmp_path / "top.png"))
    task = read_inpaint_jsonl(str(_jsonl(path, rows)), SIZE)
    first, second = task.item_metadata([0, 1])
    assert first["mask"][:, SIZE // 2 :].all() and not first["mask"][:, : SIZE // 2].any()
    assert second["mask"][: SIZE // 2].all() and not second["mask"][SIZE // 2 :].any()
    assert torch.equal(task.inputs([1]).mask[0, 0], torch.from_numpy(second["mask"][:, :, 0] / 255).float())


def _bad_inpaint(tmp_path: Path, case: str) -> Path:
    solid(tmp_path / "ok.png", (16, 16), (9, 9, 9))
    half_mask(tmp_path / "ok_mask.png", (16, 16))
    good = {"image_path": "ok.png", "mask_path": "ok_mask.png", "prompt": "fine"}
    bad = dict(good)
    if case == "missing image":
        bad["image_path"] = "nope.png"
    elif case == "unreadable image":
        (tmp_path / "text.png").write_text("not an image")
        bad["image_path"] = "text.png"
    elif case == "truncated image":
        data = (tmp_path / "ok.png").read_bytes()
        (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
        bad["image_path"] = "cut.png"
    elif case == "truncated jpeg":
        noise = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(noise).save(tmp_path / "whole.jpg", quality=95)
        data = (tmp_path / "whole.jpg").read_bytes()
        (tmp_path / "cut.jpg").write_bytes(data[: len(data) * 3 // 4])  # the header whole, the scan cut
        bad["image_path"] = "cut.jpg"
    elif case == "empty prompt":
        bad["prompt"] = "  "
    elif case == "mask of another size":
        half_mask(tmp_path / "small_mask.png", (8, 16))
        bad["mask_path"] = "small_mask.png"
    elif case == "empty mask":
        Image.new("L", (16, 16), 0).save(tmp_path / "black.png")
        bad["mask_path"] = "black.png"
    elif case == "no mask_path":
        del bad["mask_path"]
    elif case == "not json":
        bad = "{image_path: ok.png"
    return _jsonl(tmp_path / "rows.jsonl", [good, "", bad])  # the bad row is on line 3


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing image", r"image_path .*nope.png does not exist"),
        ("unreadable image", r".*text.png is not a readable image"),
        ("truncated image", r".*cut.png is not a readable image"),
        ("truncated jpeg", r".*cut.jpg is not a readable image"),
        ("empty prompt", r"a record needs a non-empty \"prompt\""),
        ("mask of another size", r".*small_mask.png is 8x16 but its image is 16x16"),
        ("empty mask", r".*black.png has no pixel to repaint"),
        ("no mask_path", r"\"mask_path\" must be a path"),
        ("not json", r"not valid JSON"),
    ],
)
def test_bad_inpaint_rows_name_file_and_line(tmp_path, case, message):
    path = _bad_inpaint(tmp_path, case)
    with pytest.raises(ValueError, match=rf"{path}:3: {message}"):
        read_inpaint_jsonl(str(path), SIZE)


def test_inpaint_rows_with_a_last_frame_give_image_to_video_first_and_last_frames(tmp_path):
    """``last_image_path``: image-to-video's last frame (``image_path`` the first), ``ImageInputs.last_image``;
    given in every row or none, at its first frame's size; the item key tells another last frame apart."""
    for name, colour in (("first", (255, 0, 0)), ("last", (0, 0, 255)), ("other", (0, 255, 0))):
        solid(tmp_path / f"{name}.png", (16, 16), colour)
    solid(tmp_path / "small.png", (8, 16), (0, 0, 255))
    half_mask(tmp_path / "mask.png", (16, 16))
    row = {"image_path": "first.png", "mask_path": "mask.png", "prompt": "a red ball turns blue"}
    rows = [dict(row, last_image_path="last.png"), dict(row, last_image_path="other.png")]
    task = read_inpaint_jsonl(str(_jsonl(tmp_path / "rows.jsonl", rows)), SIZE, ["image", "last_image"])
    inputs = task.inputs([1, 0])
    assert inputs.mask is None and inputs.image.shape == inputs.last_image.shape == (2, 3, SIZE, SIZE)
    assert torch.allclose(inputs.last_image[1], torch.tensor([0, 0, 1.0]).view(3, 1, 1))
    assert torch.allclose(inputs.last_image[0], torch.tensor([0, 1.0, 0]).view(3, 1, 1))
    assert task.item_key(0) != task.item_key(1)
    assert "last_image_path" not in task.item_metadata([0])[0]
    assert read_inpaint_jsonl(str(_jsonl(tmp_path / "plain.jsonl", [row])), SIZE).inputs([0]).last_image is None
    for bad, message in (
        ([rows[0], row], r'rows.jsonl:2: the first row has "last_image_path"; give it in every row or in none'),
        ([row, rows[0]], r'rows.jsonl:2: the first row has no "last_image_path"'),
        ([dict(row, last_image_path="small.png")], r"rows.jsonl:1: last image .*small.png is 8x16 but its first"),
    ):
        with pytest.raises(ValueError, match=message):
            read_inpaint_jsonl(str(_jsonl(tmp_path / "rows.jsonl", bad)), SIZE)


def test_edit_rows_give_reference_judge_metadata_and_targets(tmp_path):
    solid(tmp_path / "cat.png", (16, 16), (255, 0, 0))
    solid(tmp_path / "cat_blue.png", (16, 16), (0, 0, 255))
    solid(tmp_path / "dog.png", (16, 16), (0, 255, 0))
    path = _jsonl(
        tmp_path / "edit.jsonl",
        [
            {"image_path": "cat.png", "target_path": "cat_blue.png", "prompt": "make the cat blue"},
            {"image_path": "dog.png", "prompt": "add a hat", "source": "bench-7"},
        ],
    )
    task = read_edit_jsonl(str(path), SIZE)
    inputs = task.inputs([0, 1])
    assert inputs.image is None and inputs.mask is None and inputs.style is None
    assert torch.allclose(inputs.reference[0], torch.tensor([1.0, 0, 0]).view(3, 1, 1))
    meta = task.item_metadata([1])[0]
    assert meta["judge_task"] == "edit" and meta["source"] == "bench-7" and "target_path" not in meta
    reference = meta["reference_image"]  # what the qwenvl judge compares against; sent as an image
    assert reference.dtype == np.uint8 and reference.shape == (SIZE, SIZE, 3) and (reference == [0, 255, 0]).all()

    batch = task.supervised_batch(4, torch.Generator().manual_seed(1))
    assert batch.prompts == ["make the cat blue"] * 4  # only rows with a target
    assert torch.allclose(batch.images, torch.tensor([0, 0, 1.0]).view(1, 3, 1, 1).expand(4, 3, SIZE, SIZE))
    assert torch.allclose(batch.inputs.reference, inputs.reference[:1].expand(4, -1, -1, -1))

    only_untargeted = read_edit_jsonl(
        str(_jsonl(tmp_path / "e2.jsonl", [{"image_path": "dog.png", "prompt": "x"}])), SIZE
    )
    with pytest.raises(ValueError, match=r"need \"target_path\"\); set train.warmup_steps=0"):
        only_untargeted.supervised_batch(2, torch.Generator())
    solid(tmp_path / "big.png", (32, 16), (0, 0, 0))
    bad = _jsonl(tmp_path / "e3.jsonl", [{"image_path": "dog.png", "target_path": "big.png", "prompt": "x"}])
    with pytest.raises(ValueError, match=rf"{bad}:1: target .*big.png is \(32, 16\) pixels but the image to edit"):
        read_edit_jsonl(str(bad), SIZE)


@pytest.mark.parametrize(
    "line, parsed",
    [
        ("s001\ta cat in the style of the reference", ("s001", "a cat in the style of the reference")),
        ("id with spaces\t a prompt ", ("id with spaces", "a prompt")),
        ("s002 a dog  wearing a hat", ("s002", "a dog  wearing a hat")),
        ("  s003   padded prompt\r", ("s003", "padded prompt")),
        ("s004", ("s004", "")),
    ],
)
def test_triplet_list_lines_split_at_tab_else_first_space(line, parsed):
    assert parse_line(line) == parsed


def test_triplet_folder_gives_source_mask_reference_and_centred_style_crop(tmp_path):
    folder = write_triplet_folder(tmp_path / "bench", size=16, count=2)
    (folder / "self_bench.txt").write_text('s000\ta cat\n\ns001 a "SALE" sign\n')
    task = read_triplet_folder(str(folder), SIZE)
    assert task.prompts == ["a cat", 'a "SALE" sign']
    inputs = task.inputs([0, 1])
    assert all(
        getattr(inputs, f).shape == (2, c, SIZE, SIZE)
        for f, c in (("image", 3), ("mask", 1), ("reference", 3), ("style", 3))
    )
    red = torch.tensor([1.0, 0, 0]).view(3, 1, 1)
    assert torch.allclose(inputs.style, red.expand(2, 3, SIZE, SIZE), atol=1e-6)  # the red centre only
    assert torch.allclose(inputs.reference[:, :, 0, 0], torch.tensor([0, 0, 1.0]))  # blue border kept
    assert torch.allclose(inputs.reference[:, :, SIZE // 2, SIZE // 2], torch.tensor([1.0, 0, 0]))
    meta = task.item_metadata([1])[0]
    assert meta["sample_id"] == "s001" and meta["text"] == "SALE" and meta["mask"].shape == (SIZE, SIZE, 1)

    style_only = read_triplet_folder(str(folder), SIZE, image_inputs=["style"])  # e.g. a text-to-image IP-Adapter
    only = style_only.inputs([1])
    assert only.image is None and only.mask is None and only.reference is None
    assert torch.equal(only.style, inputs.style[1:])
    assert style_only.item_metadata([1])[0]["mask"].shape == (SIZE, SIZE, 1)  # the reward still sees the mask
    with pytest.raises(
        ValueError,
        match=r"data.image_inputs=\['style', 'depth'\] names depth; .* provides "
        r"image, mask, reference, style",
    ):
        read_triplet_folder(str(folder), SIZE, image_inputs=["style", "depth"])
    whole = read_triplet_folder(str(folder), SIZE, style_crop=1.0)
    assert torch.equal(whole.inputs([0]).style, whole.inputs([0]).reference)
    with pytest.raises(ValueError, match=r"data.style_crop=0 must be in \(0, 1\]"):
        read_triplet_folder(str(folder), SIZE, style_crop=0)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing ref", r"ref image .*s001_ref.png does not exist"),
        ("no prompt", r"expected '<sample id><TAB><prompt>', found no prompt in 's001'"),
        ("repeated id", r"sample id 's000' already listed on line 1"),
        ("mask of another size", r".*s001_mask.png is 8x8 but its image is 16x16"),
        ("unreadable ref", r".*s001_ref.png is not a readable image"),
    ],
)
def test_bad_triplets_name_list_file_and_line(tmp_path, case, message):
    folder = write_triplet_folder(tmp_path / "bench", size=16, count=2)
    bench = folder / "self_bench.txt"
    if case == "missing ref":
        (folder / "s001_ref.png").unlink()
    elif case == "no prompt":
        bench.write_text("s000\ta cat\ns001\n")
    elif case == "repeated id":
        bench.write_text("s000\ta cat\ns000\ta dog\n")
    elif case == "mask of another size":
        half_mask(folder / "s001_mask.png", (8, 8))
    elif case == "unreadable ref":
        (folder / "s001_ref.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(ValueError, match=rf"{bench}:2: {message}"):
        read_triplet_folder(str(folder), SIZE)
    with pytest.raises(ValueError, match="no self_bench.txt there"):
        read_triplet_folder(str(tmp_path), SIZE)


@pytest.mark.parametrize(
    "name", sorted(set(DATASETS) - {"digits", "words", "moving_digits"})
)  # the built-in ones read no file
def test_every_file_format_builds_from_data_config(tmp_path, name):
    """Through the registry, as the job builds it; missing paths name the config key."""
    config = DataConfig(name=name, path=tiny_dataset(name, tmp_path, 16), image_size=16)
    task = build_task(config)
    assert len(task.prompts) == 4 and task.eval_prompts == [task.prompts[i] for i in task.eval_indices]
    assert len(task.item_metadata([0, 0, 3])) == 3
    inputs = task.inputs([2, 2])
    if name == "prompt_file":
        assert inputs is None
    else:
        assert all(t.shape[0] == 2 and t.shape[-2:] == (16, 16) for t in vars(inputs).values() if t is not None)
    with pytest.raises(ValueError, match="data.path='/nowhere'"):
        build_task(DataConfig(name=name, path="/nowhere", image_size=16))


@pytest.mark.parametrize("name", ["digits", "prompt_file"])
def test_settings_a_text_only_task_would_ignore_are_refused(tmp_path, name):
    path = tiny_dataset(name, tmp_path, 16)
    with pytest.raises(ValueError, match=rf"data.image_inputs=\['mask'\] but data.name='{name}' gives no image inputs"):
        build_task(DataConfig(name=name, path=path, image_inputs=["mask"]))
    if name == "digits":
        with pytest.raises(ValueError, match=r"data.path='prompts.txt' is not read by data.name='digits'.*prompt_file"):
            build_task(DataConfig(name=name, path="prompts.txt"))


def test_unknown_dataset_names_the_choices():
    with pytest.raises(ValueError, match=r"data.name='webdataset' is not registered; choose one of: digits, "):
        build_task(DataConfig(name="webdataset"))


def test_edit_rows_with_several_references(tmp_path):
    """A list of ``image_path``: [B, N, 3, H, W] references (Qwen-Image-Edit-Plus), the first one the judge's;
    a row with another count of references names its line."""
    for name, colour in (("a.png", (255, 0, 0)), ("b.png", (0, 255, 0)), ("c.png", (0, 0, 255))):
        solid(tmp_path / name, (16, 16), colour)
    path = _jsonl(
        tmp_path / "plus.jsonl",
        [
            {"image_path": ["a.png", "b.png"], "prompt": "put the first on the second"},
            {"image_path": ["c.png", "a.png"], "prompt": "swap them"},
        ],
    )
    task = read_edit_jsonl(str(path), SIZE)
    references = task.inputs([1, 0, 1]).reference
    assert references.shape == (3, 2, 3, SIZE, SIZE)
    assert torch.allclose(references[0, 0], torch.tensor([0, 0, 1.0]).view(3, 1, 1))
    assert torch.allclose(references[1, 1], torch.tensor([0, 1.0, 0]).view(3, 1, 1))
    assert (task.item_metadata([1])[0]["reference_image"] == [0, 0, 255]).all()
    bad = _jsonl(
        tmp_path / "bad.jsonl",
        [{"image_path": ["a.png", "b.png"], "prompt": "x"}, {"image_path": "c.png", "prompt": "y"}],
    )
    with pytest.raises(ValueError, match=rf"{bad}:2: 1 image_path entries, but the first row has 2"):
        read_edit_jsonl(str(bad), SIZE)
